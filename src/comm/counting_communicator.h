// CountingCommunicator: a Communicator that forwards every operation to another and counts the
// bytes this rank puts on and takes off the wire, for the bytes-per-step metrics.
//
// send/recv count exactly (recv counts when issued; a recv that never completes still counts).
// Collectives count what a ring algorithm moves per rank, since the transport picks its own
// algorithm and does not report bytes: allreduce 2(P-1)/P of the tensor each way,
// reduce-scatter (P-1)/P of its input each way (Gloo's and shm's rings move that),
// allgather (P-1) inputs each way,
// broadcast the tensor received by every rank but the root and sent P-1 times by the root.
// Operations on oneself and on one-rank communicators count nothing.
//
// It also numbers the collectives (every rank issues the same ones in the same order) and
// knows which one a thread is waiting in since when: progress(), for the stall inspector.
//
// Threading: as the wrapped communicator; the counters are atomic.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "comm/communicator.h"

namespace caravan {

struct ByteCount {
  int64_t sent = 0;
  int64_t received = 0;
};

// Where a rank is in its collectives, for the stall inspector (comm/liveness.h): how many it
// has issued on this communicator, and the oldest one a thread waits in (0: none): its number
// (1-based, the same on every rank for the same collective), what it is, for how long.
struct CollectiveProgress {
  int64_t issued = 0;
  int64_t waitingIn = 0;
  std::string what;
  double waitedSeconds = 0.0;
};

class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner);

  ByteCount bytes() const { return {sent_.load(), received_.load()}; }
  CollectiveProgress progress() const;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  WorkPtr allreduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr broadcast(at::Tensor tensor, int root) override;
  WorkPtr allgather(at::Tensor output, at::Tensor input) override;
  WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) override;
  WorkPtr send(at::Tensor tensor, int dstRank, int tag) override;
  WorkPtr recv(at::Tensor tensor, int srcRank, int tag) override;
  WorkPtr barrier() override;

  // The collectives being waited for, by number (shared with the works that wait).
  struct Waits {
    std::mutex mutex;
    std::map<int64_t, std::pair<std::string, std::chrono::steady_clock::time_point>> byNumber;
  };

 private:
  void count(double sent, double received);
  // Numbers a collective and returns its work, which registers its waits.
  WorkPtr track(WorkPtr work, std::string what);

  std::shared_ptr<Communicator> inner_;
  std::atomic<int64_t> sent_{0}, received_{0};
  std::atomic<int64_t> collectives_{0};
  std::shared_ptr<Waits> waits_ = std::make_shared<Waits>();
};

}  // namespace caravan
