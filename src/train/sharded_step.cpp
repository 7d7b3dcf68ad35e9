// The step engine of sharded data parallelism (see sharded_step.h).
#include "train/sharded_step.h"

#include <cmath>
#include <map>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "core/errors.h"
#include "memory/accounting.h"
#include "memory/tracker.h"
#include "sync/optimizer_state.h"
#include "train/checkpoint.h"
#include "train/setup.h"
#include "train/timeline.h"

namespace caravan {

ShardedStep::ShardedStep(BlockModel model, torch::optim::Optimizer& optimizer, StepOptions options,
                         std::unique_ptr<ShardedParameters> shards,
                         std::unique_ptr<torch::optim::Optimizer> sliced,
                         std::shared_ptr<const ShardedSlices> resumed,
                         const std::string& resumedFrom, Tier* offloadTier)
    : StepEngine(optimizer, options),
      model_(std::move(model)),
      shards_(std::move(shards)),
      sliced_(std::move(sliced)) {
  if (resumed) {
    install(*resumed, resumedFrom);
  } else {
    shards_->sliceOptimizerState(optimizer_, *sliced_);
  }
  optimizer_.state().clear();
  if (offloadTier != nullptr) shards_->offloadTo(*offloadTier, *sliced_);
}

ShardedLayout ShardedStep::layout() const {
  // A parameter's name is its first in the model (a tied one has several).
  std::map<const c10::TensorImpl*, std::string> names;
  for (const auto& p : model_->named_parameters()) {
    names.emplace(p.value().unsafeGetTensorImpl(), p.key());
  }
  ShardedLayout l;
  l.worldSize = shards_->comm().size();
  l.level = shardLevelName(shards_->level());
  for (size_t i = 0; i < shards_->shards().size(); ++i) {
    const ShardedParameters::UnitLayout u = shards_->unitLayout(i);
    ShardedLayout::Unit unit;
    unit.numel = u.numel;
    unit.padded = u.padded;
    for (size_t g = 0; g < u.groups.size(); ++g) {
      unit.groups.push_back({u.groups[g].numel, u.groups[g].padded,
                             u.dtypes[g] == at::kBFloat16 ? "bfloat16" : "float32"});
    }
    for (size_t k = 0; k < u.params.size(); ++k) {
      unit.params.push_back(
          {names.at(u.params[k].unsafeGetTensorImpl()), u.params[k].sizes().vec(), u.offsets[k]});
    }
    l.units.push_back(std::move(unit));
  }
  return l;
}

void ShardedStep::install(const ShardedSlices& resumed, const std::string& path) {
  const ShardedLayout mine = layout();
  if (!resumed.layout.sameUnits(mine)) {
    throw CheckpointError(fmt::format(
        "checkpoint {} lays this model's parameters out in other units than this build does "
        "({} units, {} here; sync.shard = {} there, {} here, whose bf16 gathers split a unit in "
        "two); resume it under the sync.shard that wrote it, on another number of workers, or "
        "with the caravan that wrote it",
        path, resumed.layout.units.size(), mine.units.size(), resumed.layout.level, mine.level));
  }
  torch::NoGradGuard noGrad;
  const std::vector<at::Tensor>& shards = shards_->shards();
  for (size_t i = 0; i < shards.size(); ++i) {
    at::Tensor(shards[i]).copy_(resumed.weights[i]);
    scatterOptimizerState(*sliced_, {shards[i]}, resumed.optimizer[i]);
  }
  // The resident units' whole weights from every rank's slices (the next forward waits).
  shards_->afterUpdate();
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

void ShardedStep::withWholeModel(const std::function<void()>&) {
  CARAVAN_CHECK(false,
                "a sharded engine never holds the whole model: its checkpoints are per-rank sets "
                "and its model.pt streams (exportModel)");
}

void ShardedStep::exportModel(
    const std::string& path, torch::nn::Module& model,
    const std::function<std::vector<std::string>(const std::string&)>& rename) {
  shards_->settle();
  if (shards_->comm().rank() != 0) return shards_->forEachUnitGathered({});
  // Rank 0 writes each unit's parameters while it is gathered, in the model's order (the
  // bytes of the in-core model's model.pt): the units come in that order, and so do their
  // parameters (a unit with a bf16 group lays that group's out first).
  bool streamed = false;
  try {
    exportStateDict(path, model, rename, [&](const std::function<void(const at::Tensor&)>& write) {
      streamed = true;
      shards_->forEachUnitGathered([&](size_t unit) {
        for (const at::Tensor& p : shards_->unitParametersInModelOrder(unit)) write(p);
      });
    });
  } catch (...) {
    if (!streamed) shards_->forEachUnitGathered({});  // the others' gathers need this rank
    throw;
  }
}

std::optional<std::string> ShardedStep::writeShardedCheckpoint(const CheckpointDir& dir,
                                                               const TrainingState& state) {
  // The slices are the optimizer's, updated at the last step; the gathers in flight only read
  // them, but a checkpoint is written with nothing in flight.
  shards_->settle();
  // A unit at a time: out of core, each unit's slice and state read back, written, let go.
  return saveShardedCheckpoint(
      dir, shards_->comm(), layout(),
      [&](const SliceWriter& write) {
        shards_->forEachSlice([&](size_t unit) {
          const at::Tensor& slice = shards_->shards()[unit];
          write(unit, slice, gatherOptimizerState(*sliced_, {slice}));
        });
      },
      *model_, state);
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
