// The step engine of one pipeline stage (see pipeline_step.h).
#include "train/pipeline_step.h"

#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "core/errors.h"
#include "memory/accounting.h"
#include "memory/tracker.h"
#include "sync/allreduce.h"
#include "train/timeline.h"

namespace caravan {

PipelineStep::PipelineStep(std::unique_ptr<PipelineStage> stage, torch::optim::Optimizer& optimizer,
                           StepOptions options, Parts parts)
    : StepEngine(optimizer, options), stage_(std::move(stage)), parts_(std::move(parts)) {
  CARAVAN_CHECK(
      (parts_.replicas == nullptr ? 1 : parts_.replicas->size()) == stage_->layout().replicas,
      "{} replicas of each stage, a replica group of {}", stage_->layout().replicas,
      parts_.replicas == nullptr ? 1 : parts_.replicas->size());
  if (parts_.replicas != nullptr) {
    replicaAverage_ = std::make_unique<AllReduceStrategy>(parts_.replicas, parts_.buckets);
    replicaAverage_->attachGradients(stage_->parameters());
  }
}

PipelineStep::~PipelineStep() = default;

void PipelineStep::computeGradients(const Batch& batch, int64_t step, StepResult& r) {
  if (replicaAverage_) replicaAverage_->beforeForward(step);
  StageStepStats stats = stage_->runStep(batch);
  r.forwardEnd = r.backwardEnd = Clock::now();  // forwards and backwards interleave
  if (replicaAverage_) replicaAverage_->finishGradients();
  stage_->sumTiedGradients();
  r.computeSeconds = stats.computeSeconds;  // the step adds the update and the exchanges
  r.syncWaitSeconds = stats.waitSeconds;
  r.stageSpans = std::move(stats.spans);
  double normSquared = 0.0;
  for (const auto& p : stage_->normParameters()) {
    if (p.grad().defined()) normSquared += p.grad().norm().pow(2).item<double>();
  }
  const PipelineStage::Totals totals = stage_->reduce(normSquared, stats.loss);
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
  for (auto& p : stage_->parameters()) {
    if (p.grad().defined()) p.grad().mul_(coef);
  }
  return r.gradNorm;
}

std::vector<at::Tensor> PipelineStep::trainedParameters() { return stage_->parameters(); }

void PipelineStep::update() { optimizer_.step(); }

EvalResult PipelineStep::evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) {
  return caravan::evaluate(stage_->model(), dataset, batchSize, maxBatches, parts_.comm,
                           stage_.get());
}

void PipelineStep::accountModelState(MemoryTracker& memory) {
  setModelStateBytes(memory, stage_->parameters(), optimizer_);  // this stage's blocks
}

std::vector<at::Tensor> PipelineStep::modelStateTensors() { return stage_->parameters(); }

void PipelineStep::withWholeModel(const std::function<void()>& write) {
  // Rank 0 writes every stage's parameters and optimizer state.
  stage_->gatherParameters();
  stage_->collectOptimizerState(optimizer_);
  const bool root = parts_.comm == nullptr || parts_.comm->rank() == 0;
  if (root) write();
  // The other stages' parameters and optimizer state came to rank 0 for the file only.
  stage_->holdOwnStageOnly(optimizer_);
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
  if (l.stages == 1) {
    return fmt::format(" in {} micro-batches (gradient accumulation)", stage_->microBatches());
  }
  return fmt::format(
      " per pipeline of {} stages (blocks {}-{} on this one) x {} pipeline{}, {} in {} "
      "micro-batches ({})",
      l.stages, stage_->firstBlock(), stage_->endBlock() - 1, l.replicas, l.replicas > 1 ? "s" : "",
      pipelineScheduleName(stage_->schedule()), stage_->microBatches(), parts_.comm->backend());
}

}  // namespace caravan
