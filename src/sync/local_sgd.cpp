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
  if (options_.compression != Compression::kNone) {
    DilocoOptions d;
    d.period = options_.period;
    d.outerLr = 1.0;  // the mean of the replicas
    d.outerMomentum = 0.0;
    d.compression = options_.compression;
    d.firstStep = options_.postLocalAfter;
    quantized_ = std::make_unique<DilocoStrategy>(comm_, d);
    AttachContext outer;
    outer.sink = sink_;
    if (!restored_.empty()) outer.restoredState = &restored_;  // its rows say how many wrote it
    quantized_->attach(model, std::move(outer));
    restored_.clear();
  }
}

void LocalSgdStrategy::restoreState(const std::map<std::string, at::Tensor>& state,
                                    int64_t /*savedWorkers: rowForRank sees the rows*/) {
  restored_ = state;  // for the quantized averaging, made in attachModel()
}

std::map<std::string, at::Tensor> LocalSgdStrategy::saveState() {
  return quantized_ ? quantized_->saveState() : std::map<std::string, at::Tensor>{};
}

void LocalSgdStrategy::beforeForward(int64_t step) {
  bsp_->setEnabled(bspPhase(step));
  bsp_->beforeForward(step);
}

void LocalSgdStrategy::finishGradients() { bsp_->finishGradients(); }

void LocalSgdStrategy::afterStep(int64_t step) {
  if (bspPhase(step)) {
    // The replicas are equal after the last BSP step: the quantized averaging starts there.
    if (quantized_ && step + 1 == options_.postLocalAfter) quantized_->rebase();
    return;
  }
  if (quantized_) {
    quantized_->afterStep(step);
    return;
  }
  if ((step + 1 - options_.postLocalAfter) % options_.period != 0) return;
  const auto start = Clock::now();
  averageModel(*comm_, *model_);
  if (sink_) sink_("average parameters", start, Clock::now());
}

double LocalSgdStrategy::consolidate() {
  if (quantized_) return quantized_->consolidate();
  return averageReplicas(*comm_, *model_);  // parameters and floating-point buffers
}

}  // namespace caravan
