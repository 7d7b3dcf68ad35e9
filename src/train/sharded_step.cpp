// The step engine of sharded data parallelism (see sharded_step.h).
#include "train/sharded_step.h"

#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "memory/accounting.h"
#include "memory/tracker.h"
#include "train/setup.h"
#include "train/timeline.h"

namespace caravan {

ShardedStep::ShardedStep(BlockModel model, torch::optim::Optimizer& optimizer, StepOptions options,
                         std::unique_ptr<ShardedParameters> shards,
                         std::unique_ptr<torch::optim::Optimizer> sliced, Tier* offloadTier)
    : StepEngine(optimizer, options),
      model_(std::move(model)),
      shards_(std::move(shards)),
      sliced_(std::move(sliced)) {
  shards_->sliceOptimizerState(optimizer_, *sliced_);
  optimizer_.state().clear();
  if (offloadTier != nullptr) shards_->offloadTo(*offloadTier, *sliced_);
}

ShardedStep::~ShardedStep() = default;

void ShardedStep::computeGradients(const Batch& batch, int64_t, StepResult& r) {
  normKnown_ = false;
  loss_ = forwardBackward(model_, batch, r, Clock::now());
  shards_->finishGradients();
  r.syncEnd = Clock::now();
}

double ShardedStep::normSquared() {
  if (!normKnown_) normSquared_ = shards_->globalGradientNormSquared();
  normKnown_ = true;
  return normSquared_;
}

bool ShardedStep::gradientsFinite(const StepResult&) { return std::isfinite(normSquared()); }

double ShardedStep::clipGradients(double maxNorm, const StepResult&) {
  // As clip_grad_norm_: the coefficient max_norm / (norm + 1e-6), clamped at 1.
  const double norm = std::sqrt(normSquared());
  const double coefficient = std::min(1.0, maxNorm / (norm + 1e-6));
  shards_->scaleGradients(coefficient);
  return norm;
}

std::vector<at::Tensor> ShardedStep::trainedParameters() { return shards_->shards(); }

void ShardedStep::update() {
  if (shards_->offloaded()) {
    shards_->stepOffloaded(*sliced_);
  } else {
    sliced_->step();
  }
}

void ShardedStep::afterUpdate(int64_t, StepResult& r) {
  shards_->afterUpdate();
  r.loss = loss_.item<double>();
  loss_ = at::Tensor();
}

void ShardedStep::strategyLearningRate(double lr) { caravan::setLearningRate(*sliced_, lr); }

EvalResult ShardedStep::evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) {
  shards_->settle();
  const EvalResult r = caravan::evaluate(model_, dataset, batchSize, maxBatches, &shards_->comm(),
                                         nullptr, [this] { shards_->idleForward(); });
  shards_->releaseGathered();
  return r;
}

void ShardedStep::withWholeModel(const std::function<void()>& write) {
  shards_->settle();
  shards_->gatherOptimizerState(*sliced_, optimizer_);
  shards_->withFullParameters([&] {
    if (shards_->comm().rank() == 0) write();
  });
  optimizer_.state().clear();
}

void ShardedStep::finish() { shards_->settle(); }

void ShardedStep::accountModelState(MemoryTracker& memory) {
  // The weights and gradients are counted as they come and go (ShardedParameters), and so is
  // the optimizer state of offloaded slices.
  if (!shards_->offloaded()) {
    memory.set(MemoryCategory::kOptimizerState, optimizerStateBytes(*sliced_));
  }
}

// Every parameter, frozen ones too; the sharded ones are views of their units (empty while not
// gathered), which count as model state throughout.
std::vector<at::Tensor> ShardedStep::modelStateTensors() { return model_->parameters(); }

std::vector<nlohmann::json> ShardedStep::takeRecords(int64_t, const StepResult&, Clock::time_point,
                                                     double) {
  return {};
}

void ShardedStep::addSpans(Timeline& timeline, const StepResult& r,
                           Clock::time_point stepStart) const {
  addWholeModelSpans(timeline, r, stepStart, true);
}

std::string ShardedStep::memoryAdvice() const {
  return shards_->level() == ShardLevel::kParameters
             ? "; or set memory.policy = recompute, or train on more workers (each holds 1/W of "
               "the model state)"
             : "; or set sync.shard = parameters (each worker then holds 1/W of the weights "
               "too), memory.policy = recompute, or train on more workers";
}

std::string ShardedStep::describe() const {
  const Communicator& c = shards_->comm();
  return fmt::format(" per worker x {} workers ({}, allreduce, sync.shard = {}{})", c.size(),
                     c.backend(), shardLevelName(shards_->level()),
                     shards_->offloaded() ? ", slices offloaded" : "");
}

}  // namespace caravan
