// The step engine of one pipeline stage (see pipeline_step.h).
#include "train/pipeline_step.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "core/errors.h"
#include "memory/accounting.h"
#include "memory/tracker.h"
#include "sync/allreduce.h"
#include "sync/sharding.h"
#include "train/setup.h"
#include "train/timeline.h"

namespace caravan {

PipelineStep::PipelineStep(std::unique_ptr<PipelineStage> stage, torch::optim::Optimizer& optimizer,
                           StepOptions options, Parts parts)
    : StepEngine(optimizer, options), stage_(std::move(stage)), parts_(std::move(parts)) {
  CARAVAN_CHECK(
      (parts_.replicas == nullptr ? 1 : parts_.replicas->size()) == stage_->layout().replicas,
      "{} replicas of each stage, a replica group of {}", stage_->layout().replicas,
      parts_.replicas == nullptr ? 1 : parts_.replicas->size());
  CARAVAN_CHECK((parts_.shards == nullptr) == (parts_.sliced == nullptr),
                "sharded stage units without their optimizer, or the converse");
  if (parts_.shards) {
    // The whole state a resumed run loaded is sliced; the setup's optimizer keeps none of it.
    parts_.shards->sliceOptimizerState(optimizer_, *parts_.sliced);
    optimizer_.state().clear();
  } else if (parts_.replicas != nullptr) {
    replicaAverage_ = std::make_unique<AllReduceStrategy>(parts_.replicas, parts_.buckets);
    replicaAverage_->attachGradients(stage_->parameters());
  }
}

PipelineStep::~PipelineStep() = default;

void PipelineStep::computeGradients(const Batch& batch, int64_t step, StepResult& r) {
  ShardedParameters* shards = parts_.shards.get();
  if (replicaAverage_) replicaAverage_->beforeForward(step);
  if (shards) shards->gatherAll();  // the last update's gathers; parameters: every unit
  StageStepStats stats = stage_->runStep(batch);
  r.forwardEnd = r.backwardEnd = Clock::now();  // forwards and backwards interleave
  if (replicaAverage_) replicaAverage_->finishGradients();
  if (shards) shards->finishGradients();  // parameters: each unit freed once launched
  PipelineStage::GradientSlice slice;
  if (shards) slice = [shards](const at::Tensor& p) { return shards->gradientSlice(p); };
  stage_->sumTiedGradients(slice);
  r.computeSeconds = stats.computeSeconds;  // the step adds the update and the exchanges
  r.syncWaitSeconds = stats.waitSeconds;
  r.stageSpans = std::move(stats.spans);
  const std::vector<at::Tensor> counted = stage_->normParameters();
  double normSquared = 0.0;
  if (shards) {
    // A tied parameter counts on the first of its stages only.
    std::vector<at::Tensor> elsewhere;
    for (const auto& p : stage_->parameters()) {
      if (p.requires_grad() && std::none_of(counted.begin(), counted.end(),
                                            [&](const at::Tensor& q) { return q.is_same(p); }))
        elsewhere.push_back(p);
    }
    normSquared = shards->localGradientNormSquared(elsewhere);
  } else {
    for (const auto& p : counted) {
      if (p.grad().defined()) normSquared += p.grad().norm().pow(2).item<double>();
    }
  }
  const PipelineStage::Totals totals =
      stage_->reduce(normSquared, stats.loss, /*slicedNorm=*/shards != nullptr);
  r.syncEnd = Clock::now();
  r.loss = totals.loss;
  r.gradNorm = std::sqrt(totals.gradNormSquared);
}

bool PipelineStep::gradientsFinite(const StepResult& r) {
  return std::isfinite(r.loss) && std::isfinite(r.gradNorm);  // alike on every stage
}

double PipelineStep::clipGradients(double maxNorm, const StepResult& r) {
  // As clip_grad_norm_ does, with the norm over every stage.
  const double coef = std::min(1.0, maxNorm / (r.gradNorm + 1e-6));
  if (parts_.shards) {
    parts_.shards->scaleGradients(coef);
    return r.gradNorm;
  }
  for (auto& p : stage_->parameters()) {
    if (p.grad().defined()) p.grad().mul_(coef);
  }
  return r.gradNorm;
}

std::vector<at::Tensor> PipelineStep::trainedParameters() {
  return parts_.shards ? parts_.shards->shards() : stage_->parameters();
}

void PipelineStep::update() { (parts_.sliced ? *parts_.sliced : optimizer_).step(); }

void PipelineStep::afterUpdate(int64_t, StepResult&) {
  if (parts_.shards) parts_.shards->afterUpdate();  // the updated slices' gathers issued
}

void PipelineStep::strategyLearningRate(double lr) {
  if (parts_.sliced) caravan::setLearningRate(*parts_.sliced, lr);
}

EvalResult PipelineStep::evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) {
  if (parts_.shards) parts_.shards->gatherAll();
  const EvalResult r =
      caravan::evaluate(stage_->model(), dataset, batchSize, maxBatches, parts_.comm, stage_.get());
  if (parts_.shards) parts_.shards->releaseGathered();  // parameters: the slices only again
  return r;
}

void PipelineStep::finish() {
  if (parts_.shards) parts_.shards->settle();
}

void PipelineStep::accountModelState(MemoryTracker& memory) {
  if (parts_.shards) {
    // The units count their weights and gradients as they come and go (ZeRO's accounting).
    memory.set(MemoryCategory::kOptimizerState, optimizerStateBytes(*parts_.sliced));
    return;
  }
  setModelStateBytes(memory, stage_->parameters(), optimizer_);  // this stage's blocks
}

std::vector<at::Tensor> PipelineStep::modelStateTensors() { return stage_->parameters(); }

void PipelineStep::withWholeModel(const std::function<void()>& write) {
  // Rank 0 writes every stage's parameters and optimizer state. A sharded stage's first
  // replica (which the stages' gathers read) gets its weights whole and its slices' state.
  if (parts_.shards) {
    parts_.shards->gatherAll();
    parts_.shards->gatherOptimizerState(*parts_.sliced, optimizer_, /*onRank=*/0);
  }
  stage_->gatherParameters();
  stage_->collectOptimizerState(optimizer_);
  const bool root = parts_.comm == nullptr || parts_.comm->rank() == 0;
  if (root) write();
  // The other stages' parameters and optimizer state came to rank 0 for the file only.
  stage_->holdOwnStageOnly(optimizer_);
  if (parts_.shards) {
    optimizer_.state().clear();  // the slices' optimizer holds this stage's
    parts_.shards->releaseGathered();
  }
  if (root) releaseFreeHeap();
}

// One step of every stage of pipeline 0, for caravan report's timeline (docs/metrics.md).
std::vector<nlohmann::json> PipelineStep::takeRecords(int64_t stepsDone, const StepResult& r,
                                                      Clock::time_point stepStart, double) {
  if (stepsDone != parts_.timelineStep) return {};
  const auto stages = stage_->gatherTimeline(r.stageSpans, stepStart);
  if (stages.empty()) return {};  // not rank 0
  nlohmann::json rec = {{"kind", "pipeline_timeline"},
                        {"step", stepsDone},
                        {"schedule", pipelineScheduleName(stage_->schedule())},
                        {"micro_batches", stage_->microBatches()},
                        {"stages", nlohmann::json::array()}};
  for (const auto& stage : stages) {
    nlohmann::json row = nlohmann::json::array();
    for (const auto& span : stage) {
      row.push_back({actionName(span.kind), span.microBatch, span.start, span.end});
    }
    rec["stages"].push_back(std::move(row));
  }
  return {std::move(rec)};
}

void PipelineStep::addSpans(Timeline& timeline, const StepResult& r,
                            Clock::time_point stepStart) const {
  if (timeline.enabled()) {  // each action of this stage's program: receives on track 1
    for (const auto& span : r.stageSpans) {
      timeline.complete(fmt::format("{} {}", actionName(span.kind), span.microBatch), span.start,
                        span.end, isReceive(span.kind) ? 1 : 0);
    }
  }
  timeline.complete("pipeline program", stepStart, r.backwardEnd);
  timeline.complete("stage reduction", r.backwardEnd, r.syncEnd);
  timeline.complete("optimizer", r.syncEnd, r.optimizerEnd);
}

// " per pipeline of 2 stages (blocks 0-2 on this one) x 1 pipeline, 1f1b in 8 micro-batches
// (gloo)"
std::string PipelineStep::describe() const {
  const PipelineLayout& l = stage_->layout();
  const std::string shard =
      parts_.shards ? fmt::format(", sync.shard = {}", shardLevelName(parts_.shards->level())) : "";
  if (l.stages == 1) {
    return fmt::format(" in {} micro-batches (gradient accumulation){}", stage_->microBatches(),
                       l.replicas > 1 ? fmt::format(" x {} workers ({}{})", l.replicas,
                                                    parts_.comm->backend(), shard)
                                      : "");
  }
  return fmt::format(
      " per pipeline of {} stages (blocks {}-{} on this one) x {} pipeline{}, {} in {} "
      "micro-batches ({}{})",
      l.stages, stage_->firstBlock(), stage_->endBlock() - 1, l.replicas, l.replicas > 1 ? "s" : "",
      pipelineScheduleName(stage_->schedule()), stage_->microBatches(), parts_.comm->backend(),
      shard);
}

}  // namespace caravan
