// Liveness: every rank's heartbeat through the job's store, and the diagnosis that names the
// lost rank when a collective fails.
//
// A collective that fails tells a rank little: Gloo reports "connection closed by peer" with an
// address, or a timeout naming "one of ranks ...". A Heartbeat gives the answer: each rank's
// background thread writes `caravan/hb/<rank>` = "<beat> <last completed step> <state>" every
// `interval`, and a rank that saw a failure watches every other rank's key for a short window.
// A rank whose beat did not move and that did not say it left is lost (killed, stopped, or cut
// off); a rank that said it left names its reason. The store's host (rank 0 with the TCP store)
// is lost when the store itself stops answering.
//
// A rank leaving after an error stays reachable long enough for the others to diagnose: the
// store's host waits (bounded by `linger`) in its destructor until every other rank left or
// was found lost.
//
// Threading: one background thread per Heartbeat; setStep/leave/diagnose from any one thread.
// The store must be thread-safe (TcpStore and c10d::FileStore are).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/counting_communicator.h"

namespace caravan {

struct HeartbeatOptions {
  std::chrono::milliseconds interval{500};  // between beats
  std::chrono::milliseconds window{2500};   // how long diagnose() watches for beats
  std::chrono::milliseconds linger{5000};   // store host: waits this long for others to leave
  int workers = 1 << 30;  // ranks below are named "worker" in diagnoses, the others "server"
  bool hostsStore = false;                  // this rank serves the store (rank 0, TCP store)
  bool storeOnRank0 = true;                 // TCP store: its host is rank 0; false: a file
  std::string storeAddress;                 // host:port of the store, for messages
  // Stall inspector: a rank waiting this long in one collective reports, once per collective
  // and while the job runs on, which ranks have not reached it (0: never).
  std::chrono::milliseconds stallReport{0};
};

// What diagnose() found about one other rank.
struct RankStatus {
  int rank = 0;
  enum class State { kAlive, kLost, kLeft, kUnknown } state = State::kUnknown;
  int64_t lastStep = -1;  // its last completed step (-1: none yet)
  std::string reason;     // kLeft: the one-line reason it gave
};

class Heartbeat {
 public:
  Heartbeat(c10::intrusive_ptr<c10d::Store> store, int rank, int size, HeartbeatOptions options);
  // Says this rank left (reason "finished" unless leave() said otherwise), stops the thread;
  // the store's host then lingers until the others left.
  ~Heartbeat();
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // The last step this rank completed, published with the next beat.
  void setStep(int64_t step) { step_.store(step); }
  // Where this rank is in its collectives (published with every beat as "c<issued>"), for the
  // stall inspector. Set before the first beat matters; called on the heartbeat thread.
  void setProgressProbe(std::function<CollectiveProgress()> probe);
  // Publishes that this rank is leaving because of `reason` (one line) and stops beating.
  void leave(const std::string& reason);

  // Watches the other ranks for the window and says who is alive, lost or left. When the
  // store stops answering, storeLost() becomes true and ranks not yet seen stay kUnknown.
  std::vector<RankStatus> diagnose();
  bool storeLost() const { return storeLost_.load(); }

  // One line for a failure this rank saw: the lost ranks named first, then `seen` (the
  // communication error). Returns `seen` alone when nobody could be named.
  std::string explain(const std::string& seen);

 private:
  void run();
  void publish(const std::string& state);
  // The stall inspector's report for `p` (this rank waits in p.waitingIn): one line on stderr.
  // Called on the heartbeat thread without mutex_.
  void reportStall(const CollectiveProgress& p);

  c10::intrusive_ptr<c10d::Store> store_;
  int rank_;
  int size_;
  HeartbeatOptions options_;
  std::atomic<int64_t> step_{-1};
  std::atomic<bool> storeLost_{false};
  int64_t beat_ = 0;
  std::string leftReason_;  // set once by leave()
  std::set<int> knownLost_;  // ranks diagnose() found lost: the linger does not wait for them
  // What another rank diagnosed (store key caravan/lost), read with each beat: a rank blocked
  // in a collective until the store's host exits can still name the lost rank.
  std::string publishedLoss_;
  std::mutex lossMutex_;  // guards publishedLoss_ only (never held across store calls)
  std::mutex mutex_;        // guards stop_, leftReason_, beat_, and store writes
  std::condition_variable wake_;
  bool stop_ = false;
  std::function<CollectiveProgress()> probe_;  // guarded by mutex_
  int64_t reportedStall_ = 0;                  // the last collective reported (heartbeat thread)
  std::thread thread_;
};

}  // namespace caravan
