// Parameter server: BSP, ASP and SSP consistency (sync.mode = "ps-bsp", "ps-asp", "ps-ssp"),
// ALGORITHMS.md §1.2.
//
// The world's first W ranks are workers, the last S (sync.servers) are servers. The flat
// vector of the model's trainable parameters (float32, registration order) is cut into S
// contiguous shards of equal size (balanced by bytes; a parameter may straddle two shards);
// server s owns shard s and runs the optimizer on it. Per step every worker pushes its
// gradient shard to each server with the step's learning rate; a server waits for all W
// pushes, averages them in rank order, applies its optimizer and sends the new shard back;
// workers install it. So every worker holds the same parameters after every step, and the
// result equals the BSP all-reduce up to the order of the float sums (test).
//
// ASP and SSP(s): a server applies each push on arrival, with the learning rate divided by W
// (so W pushes make about one BSP step, weight decay included; ours), and counts the pushes
// per worker: worker k's clock c_k. The reply to worker k's push (its pull for the next step)
// goes out once c_k - min_j c_j <= s, so no worker reads parameters missing more than s clocks
// of another worker's updates (Ho et al.'s bounded staleness, read-my-writes included: a
// worker's own push is applied before its reply). ASP is s = infinity: the reply goes out at
// once. A worker that said goodbye no longer holds the others back. Pushes arrive in any
// order; the server waits on every worker's recv at once (CompletionQueue). Workers' replicas
// differ between pulls, so consolidate() (before evaluation and checkpoints) measures their
// consensus distance and then pulls the same parameters everywhere: a sync request that the
// servers answer once every worker sent it.
//
// Messages (all through the Communicator, tags below): at start rank 0 sends each server the
// parameter count, its shard's initial values and its shard of the optimizer state (from a
// checkpoint, cut for this number of servers; optimizer_state.h). A push (ps_message.h) is a
// header (kind, learning rate) and the gradient shard: a gradient, the worker's goodbye at the
// end of training (zeros), a sync request (asynchronous modes) or a state request
// (checkpoints: answered like a sync, after the server sent worker 0 its shard's optimizer
// state); a server returns when every worker said goodbye. A pull is a header (staleness:
// c_k - min_j c_j when the reply left, 0 under BSP) and the shard. With compression a push's
// payload is the codec's words instead of the shard.
//
// Checkpoints hold the servers' optimizer state in rank 0's own optimizer (the in-core form,
// so a checkpoint resumes on any number of servers and workers, or under another sync.mode)
// and every worker's top-k residual (resumed on another number of workers: each gets their
// mean, which keeps the update the residuals still owe).
//
// Servers wait for workers without a deadline of their own (kServerWait): workers evaluate and
// checkpoint between steps for as long as they need. A worker that dies closes its connections,
// which fails the server's wait at once; one that freezes is found by the other workers (their
// collectives time out), and their exit closes the server's connections too.
//
// sync.compression: pushes carry the gradient as 16-bit values or top-k with error feedback
// (ShardCodec, compression.h); the worker keeps the top-k residual per server; pulls stay
// float32. With ASP/SSP the residual's entries reach the server when they grow large enough,
// as with all-reduce.
//
// Not yet: pushes overlapped with backward, gradient clipping (global norm across shards).
// OSP builds on this: osp.h; ps-diloco (outer steps on the servers) too: diloco_servers.h.
//
// Threading: trainer thread (worker) / the server's main thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "core/torch_fwd.h"
#include "sync/compression.h"
#include "sync/optimizer_state.h"
#include "sync/ps_message.h"
#include "sync/strategy.h"
#include "sync/sync_mode.h"

namespace caravan {

inline constexpr std::chrono::milliseconds kServerWait = std::chrono::hours(24);

enum class PsConsistency { kBsp, kAsp, kSsp };

struct PsOptions {
  PsConsistency consistency = PsConsistency::kBsp;
  int64_t staleness = 3;  // ps-ssp: s, the clocks a worker may run ahead of the slowest
  // How pushes carry gradients (compression.h, ShardCodec); pulls stay float32.
  Compression compression = Compression::kNone;
  double topkRatio = 0.01;
  bool asynchronous() const { return consistency != PsConsistency::kBsp; }
  // The largest clock gap a reply may leave at (BSP: 0; ASP: unbounded).
  int64_t bound() const;
};
// The options of SyncMode::kPsBsp / kPsAsp / kPsSsp (with sync.staleness).
PsOptions psOptions(SyncMode mode, int64_t staleness);

// Which elements of the flat parameter vector server s owns: [begin(s), end(s)).
struct ShardLayout {
  int64_t total = 0;
  int servers = 1;
  int64_t begin(int s) const { return total * s / servers; }
  int64_t end(int s) const { return total * (s + 1) / servers; }
  int64_t size(int s) const { return end(s) - begin(s); }
};

// Rank 0 of `workers` sends each server (world ranks W..W+S-1) the parameter count, its shard
// of `flat` and its shard of `state` (the optimizer state rank 0 holds for the flat vector:
// none at the start, the checkpoint's when resuming); the others do nothing. Point to point.
void seedServers(Communicator& world, const Communicator& workers, const at::Tensor& flat,
                 const FlatOptimizerState& state, const ShardLayout& layout);
// What seedServers sends: the state rank 0's `optimizer` holds for `params` (a checkpoint's,
// when resuming; none on the other workers). Every worker's optimizer drops its copy: the
// servers keep the state from here on.
FlatOptimizerState takeStateForServers(torch::optim::Optimizer* optimizer,
                                       const std::vector<at::Tensor>& params, bool firstWorker);
// A server's side of seedServers: its shard (float32), the layout and its shard's optimizer
// state.
at::Tensor receiveShard(Communicator& world, int numWorkers, ShardLayout* layout,
                        FlatOptimizerState* state);

// Worker 0's side of a checkpoint's state request: each server's optimizer state for its
// shard (sent on `tag`), put together into `optimizer`'s state for `params` (the flat vector).
void receiveServerStates(Communicator& world, const ShardLayout& layout, int tag,
                         torch::optim::Optimizer& optimizer,
                         const std::vector<at::Tensor>& params);

class PsWorkerStrategy : public Strategy {
 public:
  // `world`: every rank (workers then servers); `workers`: the workers' own group.
  PsWorkerStrategy(std::shared_ptr<Communicator> world, std::shared_ptr<Communicator> workers,
                   int numServers, PsOptions options = {});
  std::string name() const override;
  void attachModel(torch::nn::Module& model) override;
  void setLearningRate(double lr) override { lr_ = lr; }
  void finishGradients() override;
  bool updatesParameters() const override { return true; }
  bool lockstep() const override { return !options_.asynchronous(); }
  double consolidate() override;
  std::map<std::string, double> takeMetrics() override;
  void finish() override;
  // The servers' optimizer state into rank 0's optimizer; every worker's top-k residual.
  std::map<std::string, at::Tensor> saveState() override;
  void restoreState(const std::map<std::string, at::Tensor>& state,
                    int64_t savedWorkers) override;

 private:
  ServerGroup servers() const { return ServerGroup(world_.get(), servers_); }
  // A push of `kind` to every server and the replies installed. `flatGradient` only for a
  // gradient.
  void exchange(const at::Tensor& flatGradient, PushKind kind);
  // Server s's push: the step's learning rate and the encoded gradient shard (zeros for any
  // other kind).
  at::Tensor pushMessage(int s, const at::Tensor& flatGradient, PushKind kind);

  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Communicator> workers_;
  int servers_;
  std::vector<at::Tensor> params_;
  ShardLayout layout_;
  PsOptions options_;
  std::vector<ShardCodec> codecs_;  // per server (top-k keeps its residual here)
  at::Tensor restoredResidual_;     // every worker's rows from a checkpoint, for attach()
  double lr_ = 0.0;
  bool finished_ = false;
  double finalDistance_ = 0.0;  // consensus distance finish() measured
  // Staleness of the replies since takeMetrics(): the sum and max over steps of the largest
  // over servers.
  double stalenessSum_ = 0.0, stalenessMax_ = 0.0;
  int64_t stalenessSteps_ = 0;
};

// Builds the optimizer a server runs over its shard (the trainer's optim.* settings).
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;
// Sets a server optimizer's learning rate (every parameter group) to the one a push carried.
// (The trainer's twin, train/setup.h setLearningRate, sits in a layer sync/ may not include.)
void setServerLearningRate(torch::optim::Optimizer& opt, double lr);

// A server rank's whole life: receives its shard from rank 0, then serves pushes until every
// worker said goodbye. `stepDone(n)` after the n-th update (BSP) or once the slowest worker's
// clock reached n (ASP/SSP), for the heartbeat.
void runParameterServer(Communicator& world, int numWorkers, const PsOptions& options,
                        const OptimizerFactory& optimizer,
                        const std::function<void(int64_t)>& stepDone = {});

}  // namespace caravan
