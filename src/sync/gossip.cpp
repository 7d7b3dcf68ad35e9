// Gossip SGD on a ring or a complete graph (see gossip.h).
#include "sync/gossip.h"

#include <algorithm>

#include <torch/torch.h>

#include "core/errors.h"
#include "sync/replicas.h"

namespace caravan {

using Clock = std::chrono::steady_clock;

GossipStrategy::GossipStrategy(std::shared_ptr<Communicator> comm, GossipOptions options)
    : comm_(std::move(comm)), options_(std::move(options)) {
  CARAVAN_CHECK(comm_ != nullptr, "gossip needs a communicator");
  CARAVAN_CHECK(options_.topology == "ring" || options_.topology == "complete",
                "unknown gossip topology {}", options_.topology);
}

void GossipStrategy::attachModel(torch::nn::Module& model) {
  model_ = &model;
  broadcastModel(*comm_, model);
  params_ = syncedParameters(model);
  const int r = comm_->rank(), w = comm_->size();
  neighbours_.clear();
  if (options_.topology == "ring") {
    for (int n : {(r + w - 1) % w, (r + 1) % w}) {
      if (n != r && std::find(neighbours_.begin(), neighbours_.end(), n) == neighbours_.end()) {
        neighbours_.push_back(n);
      }
    }
  }
}

void GossipStrategy::beforeForward(int64_t step) {
  sent_ = flatten(params_);
  work_.clear();
  received_.clear();
  launchedAt_ = Clock::now();
  if (options_.topology == "complete") {
    received_.push_back(sent_.clone());
    work_.push_back(comm_->allreduce(received_.back(), ReduceOp::kSum));
    return;
  }
  // Tags alternate by step parity: a neighbour's message of step t+1 never matches a receive of
  // step t (each step's exchange completes within the step).
  const int tag = static_cast<int>(step % 2);
  for (int n : neighbours_) {
    received_.push_back(at::empty_like(sent_));
    work_.push_back(comm_->recv(received_.back(), n, tag));
  }
  for (int n : neighbours_) work_.push_back(comm_->send(sent_, n, tag));
}

void GossipStrategy::afterStep(int64_t step) {
  for (auto& w : work_) w->wait(comm_->timeout());
  if (sink_) sink_("gossip exchange", launchedAt_, Clock::now());
  at::Tensor mixed;
  if (options_.topology == "complete") {
    mixed = received_[0].div_(static_cast<double>(comm_->size()));
  } else {
    mixed = sent_.clone();
    for (const auto& x : received_) mixed.add_(x);
    mixed.div_(static_cast<double>(1 + received_.size()));
  }
  // x(t+1) = mix(x(t)) + (x_after_step - x(t))
  at::Tensor now = flatten(params_);
  now.add_(mixed).sub_(sent_);
  unflattenInto(now, params_);
  work_.clear();
  received_.clear();
}

double GossipStrategy::consolidate() {
  return averageReplicas(*comm_, *model_);  // parameters and floating-point buffers
}

}  // namespace caravan
