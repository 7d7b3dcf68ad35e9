// The distributed side of a training run: rendezvous, the communicator, the synchronization
// strategy from sync.mode, and the per-step agreement between ranks (mean loss, stop flags).
//
// Threading: created and used by the trainer thread.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "comm/counting_communicator.h"
#include "comm/store.h"
#include "comm/world.h"
#include "core/config.h"
#include "core/torch_fwd.h"
#include "sync/strategy.h"
#include "train/checkpoint.h"
#include "train/run_options.h"

namespace caravan {

class Heartbeat;
class Timeline;

struct Agreement {
  double meanLoss = 0.0;
  bool interrupted = false;  // some rank was asked to stop (signal, --stop-at-step)
  bool timeUp = false;       // some rank reached train.max_minutes
  double meanTrainSeconds = 0.0;  // the workers' training time so far (their mean)
};

// One rank's numbers for the train record's per-rank columns (the report's skew chart): the
// per-step means over the log window of compute and of time blocked on synchronization.
struct RankWindow {
  double computeS = 0.0;
  double syncWaitS = 0.0;
  double trackedPeakBytes = 0.0;  // the window's tracked memory peak (float precision)
};

// What every rank of one job must be started with alike: the config, less the keys that may
// differ between hosts (paths, the store, the network, threads, the memory tier's place).
// Ranks started with another model, batch, mode or length would exchange tensors of other sizes
// (Gloo aborts the process) or stop at other steps.
std::string jobSignature(const Config& config);

// The job's store as the rendezvous makes it (dist.store; a file store without dist.store_path
// in `runDir`): for what the ranks agree on before the communicator exists (parallel.layout =
// auto, train/layout_setup.h), then handed to Distributed. Null for dist.backend = mpi (none).
c10::intrusive_ptr<c10d::Store> makeJobStore(const RunOptions& options, const WorldInfo& world,
                                             const std::string& runDir);

class Distributed {
 public:
  // Connects to the job's store and builds the communicator (dist.backend); throws PeerError
  // naming the master address, or how many ranks arrived, when the rendezvous does not
  // complete within fault.rendezvous_timeout. `runDir`: where a file store without
  // dist.store_path keeps its file. `options` must have passed validate().
  // `job`: what every rank of the job must agree on (jobSignature); a rank whose differs is
  // refused on every rank (ConfigError), before any tensor of the run is exchanged.
  // `store`: the job's store made before (makeJobStore), else made here.
  Distributed(const RunOptions& options, const WorldInfo& world, const std::string& runDir,
              const std::string& job = "", c10::intrusive_ptr<c10d::Store> store = {});
  ~Distributed();

  // Builds the strategy of sync.mode and attaches it: `context` as the run has it (optimizer,
  // parameter groups, restored state); the event sink is this object's, which follows the
  // strategy's communication events (each bucket's all-reduce, gossip exchange, parameter
  // averaging: from launch until the trainer took the result) for takeOutstandingSeconds()
  // and the timeline. Broadcasts rank 0's parameters. Returns the strategy for the step engine
  // (train/data_parallel_step.h).
  Strategy* attach(torch::nn::Module& model, AttachContext context);
  // Records each communication event on the timeline's communication track while `timeline`
  // is set (null: stop; call before the timeline goes).
  void setTimeline(Timeline* timeline);
  // Seconds since the last call with some exchange outstanding (launched, its result not yet
  // taken; overlapping exchanges count once), or nullopt when the strategy reports no events
  // (parameter servers, OSP). An upper bound on the time spent communicating: Gloo tells a
  // transfer's completion only when asked.
  std::optional<double> takeOutstandingSeconds();
  // The mean loss and training seconds over the workers and whether any must stop. With
  // `window`, also every worker's window (returned in rank order; empty without).
  Agreement agree(double loss, bool interrupted, bool timeUp, double trainSeconds,
                  const RankWindow* window = nullptr, std::vector<RankWindow>* all = nullptr);

  // Liveness (Gloo runs; under MPI, mpirun itself stops the job when a rank dies and names it).
  // The last step this rank completed, published with its heartbeat.
  void stepDone(int64_t step);
  // One line for a communication failure this rank saw, naming the lost rank when the
  // heartbeats tell (waits up to the heartbeat window), else `seen` unchanged.
  std::string explain(const std::string& seen);
  // Tells the other ranks this one is leaving because of `reason`.
  void leave(const std::string& reason);

  // Parameter-server modes: the last sync.servers ranks serve; the others are workers.
  bool isServer() const { return servers_ > 0 && world_->rank() >= workers_; }
  // A server's whole run (parameter_server.h); returns when every worker said goodbye.
  void serve();

  // The workers (the world without servers): the strategy's, evaluation's and the per-step
  // agreement's communicator.
  const std::shared_ptr<Communicator>& workers() const { return comm_; }
  // Pipelines of K stages replicated D > 1 times (parallel.pipeline_stages = K, world K x D):
  // this rank's stage and its D - 1 replicas (ranks s, s + K, ...; rank in it = replica).
  // Null otherwise.
  const std::shared_ptr<Communicator>& stageReplicas() const { return stageReplicas_; }
  // Before attach: the workers' communicator becomes `wrap`'s (a benchmark's probe around it).
  void wrapWorkers(
      const std::function<std::shared_ptr<Communicator>(std::shared_ptr<Communicator>)>& wrap) {
    comm_ = wrap(comm_);
  }

  // Bytes this rank sent and received so far over both communicators (counting_communicator.h:
  // exact for point to point, a ring estimate for collectives).
  ByteCount bytes() const;

 private:
  std::shared_ptr<Communicator> counted(std::shared_ptr<Communicator> inner);

  std::shared_ptr<Communicator> world_;          // every rank
  std::shared_ptr<Communicator> comm_;           // workers()
  std::shared_ptr<Communicator> stageReplicas_;  // stageReplicas()
  std::vector<std::shared_ptr<CountingCommunicator>> counters_;
  RunOptions options_;
  int servers_ = 0;
  int workers_ = 1;
  std::unique_ptr<Strategy> strategy_;
  // The event sink's state, shared with the sink (which may run on the trainer's or the
  // weight updater's thread, and outlive this run's timeline).
  struct CommObserver {
    std::mutex mutex;
    Timeline* timeline = nullptr;
    bool events = false;
    std::vector<std::pair<std::chrono::steady_clock::time_point,
                          std::chrono::steady_clock::time_point>> intervals;
  };
  std::shared_ptr<CommObserver> observer_ = std::make_shared<CommObserver>();
  std::unique_ptr<Heartbeat> heartbeat_;  // declared last: destroyed (lingers) first
};

}  // namespace caravan
