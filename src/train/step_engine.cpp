// The step every engine runs (see step_engine.h).
#include "train/step_engine.h"

#include <torch/torch.h>

#include "train/checkpoint.h"
#include "train/setup.h"
#include "train/timeline.h"

namespace caravan {

void StepEngine::setLearningRate(double lr) {
  caravan::setLearningRate(optimizer_, lr);
  strategyLearningRate(lr);
}

at::Tensor StepEngine::forwardBackward(BlockModel& model, const Batch& batch, StepResult& r,
                                       Clock::time_point start) {
  at::Tensor output = model->forward(batch.input);
  at::Tensor loss = model->loss(output, batch.target);
  r.forwardEnd = Clock::now();
  loss.backward();
  r.backwardEnd = Clock::now();
  r.computeSeconds = std::chrono::duration<double>(r.backwardEnd - start).count();
  return loss;
}

void StepEngine::addWholeModelSpans(Timeline& timeline, const StepResult& r,
                                    Clock::time_point stepStart, bool exchanges) {
  timeline.complete("forward", stepStart, r.forwardEnd);
  timeline.complete("backward", r.forwardEnd, r.backwardEnd);
  if (exchanges) timeline.complete("gradient sync wait", r.backwardEnd, r.syncEnd);
  timeline.complete("optimizer", r.syncEnd, r.optimizerEnd);
  if (exchanges) timeline.complete("after-step sync", r.optimizerEnd, r.stepEnd);
}

void StepEngine::exportModel(
    const std::string& path, torch::nn::Module& model,
    const std::function<std::vector<std::string>(const std::string&)>& rename) {
  withWholeModel([&] { exportStateDict(path, model, rename); });
}

std::string StepEngine::memoryAdvice() const {
  return "; or set memory.policy = auto to recompute or swap blocks within the budget (or "
         "sync.shard = parameters with several workers: each holds 1/W of the model state)";
}

StepResult StepEngine::step(const Batch& batch, int64_t step) {
  optimizer_.zero_grad();
  StepResult r;
  computeGradients(batch, step, r);
  if (options_.skipNonFinite && !gradientsFinite(r)) {
    for (auto p : trainedParameters()) p.mutable_grad() = at::Tensor();
    r.skipped = true;
  }
  if (!r.skipped) {
    if (options_.gradClip > 0.0) r.gradNorm = clipGradients(options_.gradClip, r);
    update();
  }
  r.optimizerEnd = Clock::now();
  afterUpdate(step, r);
  r.stepEnd = Clock::now();
  auto seconds = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  r.computeSeconds += seconds(r.syncEnd, r.optimizerEnd);
  r.syncWaitSeconds += seconds(r.backwardEnd, r.syncEnd) + seconds(r.optimizerEnd, r.stepEnd);
  return r;
}

}  // namespace caravan
