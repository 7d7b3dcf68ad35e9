// Local SGD and post-local SGD (see local_sgd.h).
#include "sync/local_sgd.h"

#include "core/errors.h"
#include "sync/replicas.h"

namespace caravan {

using Clock = std::chrono::steady_clock;

LocalSgdStrategy::LocalSgdStrategy(std::shared_ptr<Communicator> comm, LocalSgdOptions options)
    : comm_(std::move(comm)), options_(options) {
  CARAVAN_CHECK(comm_ != nullptr, "local SGD needs a communicator");
  CARAVAN_CHECK(options_.period >= 1, "local SGD period {} < 1", options_.period);
}

void LocalSgdStrategy::attachModel(torch::nn::Module& model) {
  model_ = &model;
  bsp_ = std::make_unique<AllReduceStrategy>(comm_, options_.allreduce);
  AttachContext inner;
  inner.sink = sink_;
  bsp_->attach(model, std::move(inner));  // also broadcasts rank 0's parameters
}

void LocalSgdStrategy::beforeForward(int64_t step) {
  bsp_->setEnabled(bspPhase(step));
  bsp_->beforeForward(step);
}

void LocalSgdStrategy::finishGradients() { bsp_->finishGradients(); }

void LocalSgdStrategy::afterStep(int64_t step) {
  if (bspPhase(step)) return;
  if ((step + 1 - options_.postLocalAfter) % options_.period != 0) return;
  const auto start = Clock::now();
  averageModel(*comm_, *model_);
  if (sink_) sink_("average parameters", start, Clock::now());
}

double LocalSgdStrategy::consolidate() {
  const double distance = consensusDistance(*comm_, *model_);
  averageModel(*comm_, *model_);
  return distance;
}

}  // namespace caravan
