// OSP: two-stage synchronization with local-gradient parameter correction (sync.mode = "osp"),
// ALGORITHMS.md §1.3, on the parameter-server layout of parameter_server.h.
//
// Each server cuts its shard into chunks of `chunkElements` and marks a fraction of them
// stage 1 (I_t), the rest stage 2 (U_t). A worker's step t, after backward:
//   1. waits for stage 2 of step t-1 and installs its global values w_t[U_{t-1}] (and the
//      split for step t that came with them);
//   2. stage 1 (blocking): pushes g_t[I_t] with the learning rate; servers average all W,
//      update those chunks and return w_{t+1}[I_t], which the worker installs;
//   3. LGP: w~_{t+1}[U_t] = w_t[U_t] - lr * g_t[U_t] + mu * (w_t - w_{t-1})[U_t]: the update
//      the servers' optimizer would make with the worker's own gradient standing in for the
//      global one. For SGD with momentum mu the last global update w_t - w_{t-1} is
//      -lr * the momentum buffer, so this is heavy-ball SGD's step (ours: weight decay and
//      Nesterov's look-ahead are left out); for other optimizers mu = 0, the plain-SGD
//      correction. With LGP off U_t keeps w_t[U_t], one step stale;
//   4. stage 2 (on the CommThread, overlapping step t+1's forward and backward): pushes
//      g_t[U_t]; servers average, update, and return w_{t+1}[U_t] with the split for t+1.
// Every gradient is applied exactly once, on the server, in step order: a server serves stage 1
// then stage 2 of step t before stage 1 of step t+1, and its optimizer holds one parameter per
// chunk and steps only the chunks of the current stage, so momentum and Adam moments see each
// chunk's updates in order. Staleness is bounded by one step.
//
// The split for step t+1 is chosen from the full averaged gradient of step t, so it travels with
// the stage-2 reply (ours; the paper's stage-1 reply would only know I_t's part). Policies:
// "magnitude" (chunks by mean |g|, largest first), "layer-order" (the first chunks of the flat
// vector — the first layers, which the next forward needs first). Step 0 uses layer order.
// With fraction 1 every chunk is stage 1: exactly ps-bsp (test).
//
// `auto` sizing (sync.osp_auto_fraction; ours): the servers search the fraction by measuring
// step times (fraction_search.h), every stage-1 push carrying the worker's previous stage-1
// round trip and the time since its reply (neither counts evaluations and checkpoints). The
// search starts from a model's guess that each worker sends along: from the time
// between steps' exchanges (forward + backward: the compute stage 2 can hide behind) and the
// rate of its exchanges (elements per second over stage 1 and the previous stage 2, smoothed),
// the smallest fraction whose stage 2 fits under 95% of that compute time; the servers take
// the largest guess. Every server runs the same search on the same headers, so all use the
// same fraction (each stage-2 reply says which, and why it moved: workers check that every
// server's split has that share and keep the moves for metrics.jsonl, "osp_fraction" records).
// Step 0 uses sync.osp_fraction. The search's state is not in checkpoints: a resumed run
// starts again from sync.osp_fraction and searches again.
//
// Threading: trainer thread; stage 2 on the strategy's CommThread.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm_thread.h"
#include "sync/fraction_search.h"
#include "sync/parameter_server.h"
#include "sync/sync_mode.h"

namespace caravan {

struct OspOptions {
  double fraction = 0.5;             // of each server's chunks in stage 1, (0, 1]
  bool autoFraction = false;         // search the fraction by step times (step 0: fraction)
  FractionSearchOptions search;      // with autoFraction
  std::string policy = "magnitude";  // magnitude | layer-order
  bool lgp = true;
  double lgpMomentum = 0.0;  // mu of the servers' SGD (0: plain-SGD correction)
  int64_t chunkElements = 4096;
};

// The chunks of one server's shard and which are stage 1.
struct ChunkSplit {
  int64_t shardSize = 0;
  int64_t chunk = 1;
  std::vector<uint8_t> stage1;  // per chunk
  int64_t numChunks() const { return static_cast<int64_t>(stage1.size()); }
  int64_t begin(int64_t c) const { return c * chunk; }
  int64_t size(int64_t c) const { return std::min(chunk, shardSize - c * chunk); }
};

// Step 0's split: the first ceil(fraction * chunks) chunks (at least one when any).
ChunkSplit initialSplit(int64_t shardSize, const OspOptions& options);

class OspWorkerStrategy : public Strategy {
 public:
  OspWorkerStrategy(std::shared_ptr<Communicator> world, std::shared_ptr<Communicator> workers,
                    int numServers, OspOptions options);
  std::string name() const override { return syncModeName(SyncMode::kOsp); }
  void attachModel(torch::nn::Module& model) override;
  void setLearningRate(double lr) override { lr_ = lr; }
  void beforeForward(int64_t step) override {
    if (firstStep_ < 0) firstStep_ = step;
  }
  void finishGradients() override;
  bool updatesParameters() const override { return true; }
  double consolidate() override;
  // stage1_fraction: the share of parameters synchronized in stage 1, mean over the steps.
  std::map<std::string, double> takeMetrics() override;
  // "osp_fraction": each move of the auto fraction (from, to, reason, the measurements).
  std::vector<StrategyEvent> takeEvents() override;
  void finish() override;
  // The servers' optimizer state into rank 0's optimizer (a stage-1 round whose push header asks
  // for it); heavy-ball LGP's w_{t-1}. Not kept: the split for the next step (the resumed
  // run's first step uses layer order) and auto sizing's measurements.
  std::map<std::string, at::Tensor> saveState() override;
  void restoreState(const std::map<std::string, at::Tensor>& state,
                    int64_t savedWorkers) override;

 private:
  ServerGroup servers() const { return ServerGroup(world_.get(), servers_); }
  // A stage-1-sized push of `kind` (goodbye, checkpoint state) to every server.
  void sendToServers(PushKind kind);
  // Flat indices of server s's stage-1 (stage1 = true) or stage-2 chunks.
  at::Tensor indices(int s, bool stage1) const;
  void install(const at::Tensor& index, const at::Tensor& values);
  void drainStage2();
  // auto sizing: fold in one measurement; the fraction to ask the servers for.
  void measure(double computeSeconds, int64_t elements, double seconds);
  double requestedFraction() const;

  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Communicator> workers_;
  int servers_;
  OspOptions options_;
  std::vector<at::Tensor> params_;
  ShardLayout layout_;
  std::vector<ChunkSplit> splits_;  // per server
  at::Tensor global_;               // w_t as far as known: flat
  double lr_ = 0.0;
  bool finished_ = false;
  // Stage 2 in flight: per server, the flat indices it covers and the reply buffer.
  WorkPtr stage2_;
  std::vector<at::Tensor> stage2Index_, stage2Reply_;
  std::unique_ptr<CommThread> commThread_;
  double fractionSum_ = 0.0;
  int64_t fractionSteps_ = 0;
  // auto sizing: smoothed compute time per step and exchange rate; the last stage 2's timing
  // (written by the CommThread, read after drainStage2).
  struct Stage2Timing {
    int64_t elements = 0;
    double seconds = 0.0;
  };
  std::shared_ptr<Stage2Timing> stage2Timing_ = std::make_shared<Stage2Timing>();
  std::chrono::steady_clock::time_point lastReturn_{};
  // The fraction search's sample: the last stage 1's reply and round trip.
  std::chrono::steady_clock::time_point lastStage1End_{};
  double lastStage1Seconds_ = 0.0;
  int64_t firstStep_ = -1;  // the run's step at this process's first step (resumed: > 0)
  std::vector<StrategyEvent> events_;
  double computeSeconds_ = 0.0, elementsPerSecond_ = 0.0;
  at::Tensor previous_;  // heavy-ball LGP: w_{t-1}, flat
  at::Tensor restoredPrevious_;  // from a checkpoint, installed by attach()
};

// A server rank's whole life under OSP (see runParameterServer).
void runOspServer(Communicator& world, int numWorkers, const OspOptions& options,
                  const OptimizerFactory& optimizer,
                  const std::function<void(int64_t)>& stepDone = {});

}  // namespace caravan
