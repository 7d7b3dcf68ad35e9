// Parameter server, BSP consistency (sync.mode = "ps-bsp"), ALGORITHMS.md §1.2.
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
// Messages (all through the Communicator, tags below): at start rank 0 sends each server the
// parameter count and its shard's initial values. A push is [gradient shard, lr, stop]; stop
// = 1 (with a zero gradient) is the worker's goodbye at the end of training; a server returns
// when every worker said goodbye.
//
// Servers wait for workers without a deadline of their own (kServerWait): workers evaluate and
// checkpoint between steps for as long as they need. A worker that dies closes its connections,
// which fails the server's wait at once; one that freezes is found by the other workers (their
// collectives time out), and their exit closes the server's connections too.
//
// Not yet (later steps of issue 4): ASP/SSP, pushes overlapped with backward, gradient clipping
// (global norm across shards), server state in checkpoints. OSP builds on this: osp.h.
//
// Threading: trainer thread (worker) / the server's main thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "sync/strategy.h"

namespace torch {
namespace optim {
class Optimizer;
}
}  // namespace torch

namespace caravan {

inline constexpr std::chrono::milliseconds kServerWait = std::chrono::hours(24);

// Which elements of the flat parameter vector server s owns: [begin(s), end(s)).
struct ShardLayout {
  int64_t total = 0;
  int servers = 1;
  int64_t begin(int s) const { return total * s / servers; }
  int64_t end(int s) const { return total * (s + 1) / servers; }
  int64_t size(int s) const { return end(s) - begin(s); }
};

// Rank 0 of `workers` sends each server (world ranks W..W+S-1) the parameter count and its
// shard of `flat`; the others do nothing. Collective-free (point to point).
void seedServers(Communicator& world, const Communicator& workers, const at::Tensor& flat,
                 const ShardLayout& layout);
// A server's side of seedServers: its shard (float32) and the layout.
at::Tensor receiveShard(Communicator& world, int numWorkers, ShardLayout* layout);

// One round of pushes (one per worker, rank order) carrying a stop flag at element `stopAt`:
// true when every worker said goodbye, false when none did; PeerError when they disagree.
bool allSaidGoodbye(const std::vector<at::Tensor>& pushes, int64_t stopAt, int serverRank,
                    int64_t step);
// The mean over workers of the pushes' first n elements, summed in rank order.
at::Tensor averagePushes(const std::vector<at::Tensor>& pushes, int64_t n);

class PsWorkerStrategy : public Strategy {
 public:
  // `world`: every rank (workers then servers); `workers`: the workers' own group.
  PsWorkerStrategy(std::shared_ptr<Communicator> world, std::shared_ptr<Communicator> workers,
                   int numServers);
  std::string name() const override { return "ps-bsp"; }
  void attach(torch::nn::Module& model) override;
  void setLearningRate(double lr) override { lr_ = lr; }
  void finishGradients() override;
  bool updatesParameters() const override { return true; }
  void finish() override;

 private:
  int serverRank(int s) const { return world_->size() - servers_ + s; }

  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Communicator> workers_;
  int servers_;
  std::vector<at::Tensor> params_;
  ShardLayout layout_;
  double lr_ = 0.0;
  bool finished_ = false;
};

// Builds the optimizer a server runs over its shard (the trainer's optim.* settings).
using OptimizerFactory =
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

// A server rank's whole life: receives its shard from rank 0, then serves pushes until every
// worker said goodbye. `stepDone(n)` after the n-th update (for the heartbeat).
void runParameterServer(Communicator& world, int numWorkers, const OptimizerFactory& optimizer,
                        const std::function<void(int64_t)>& stepDone = {});

}  // namespace caravan
