// Decentralized gossip SGD (sync.mode = "gossip", D-PSGD, Lian et al. 2017): no all-reduce of
// gradients; each worker mixes its parameters with its neighbours' and applies its own update:
//   x_i(t+1) = sum_j W_ij x_j(t) + Delta_i(t)
// where Delta_i(t) is what the local optimizer did to x_i(t) with worker i's gradient (plain
// SGD: -lr * g_i). W is uniform over {i} and i's neighbours:
//   ring:     the ranks i-1 and i+1 (1/3 each with i itself; a world of 2 mixes 1/2, 1/2);
//   complete: every rank (1/W each), i.e. exact parameter averaging — one all-reduce.
// The exchange of x(t) starts before step t's forward and overlaps its forward and backward;
// afterStep waits for it and mixes.
//
// Consistency: none global; replicas drift apart by at most what the mixing lets through
// (consolidate() reports the consensus distance and averages them).
//
// Threading: trainer thread.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "sync/strategy.h"
#include "sync/sync_mode.h"

namespace caravan {

struct GossipOptions {
  std::string topology = "ring";  // ring | complete
};

class GossipStrategy : public Strategy {
 public:
  GossipStrategy(std::shared_ptr<Communicator> comm, GossipOptions options);
  std::string name() const override { return syncModeName(SyncMode::kGossip); }
  void attachModel(torch::nn::Module& model) override;
  void beforeForward(int64_t step) override;
  void finishGradients() override {}  // the local gradient is the update
  void afterStep(int64_t step) override;
  double consolidate() override;

  const std::vector<int>& neighbours() const { return neighbours_; }

 private:
  std::shared_ptr<Communicator> comm_;
  GossipOptions options_;
  torch::nn::Module* model_ = nullptr;
  std::vector<at::Tensor> params_;
  std::vector<int> neighbours_;       // distinct, without this rank (ring only)
  at::Tensor sent_;                   // x(t), flat, as sent
  std::vector<at::Tensor> received_;  // x_j(t) per neighbour (ring) / sum over ranks (complete)
  std::vector<WorkPtr> work_;
  std::chrono::steady_clock::time_point launchedAt_;
};

}  // namespace caravan
