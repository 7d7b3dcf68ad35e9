// Training step and evaluation (see step.h).
#include "train/step.h"

#include <torch/torch.h>

#include "core/errors.h"
#include "data/loader.h"

namespace caravan {

at::Tensor taskLoss(TaskKind task, const at::Tensor& output, const at::Tensor& target) {
  if (task == TaskKind::kLanguageModel) {
    // output [B, T, V] -> [B*T, V]; target [B, T] -> [B*T]
    return at::cross_entropy_loss(output.reshape({-1, output.size(-1)}), target.reshape({-1}));
  }
  return at::cross_entropy_loss(output, target);
}

StepResult trainStep(BlockModel& model, torch::optim::Optimizer& optimizer, const Batch& batch,
                     double gradClip) {
  optimizer.zero_grad();
  at::Tensor output = model->forward(batch.input);
  at::Tensor loss = taskLoss(model->task(), output, batch.target);
  loss.backward();
  StepResult result;
  if (gradClip > 0.0) {
    result.gradNorm = torch::nn::utils::clip_grad_norm_(model->parameters(), gradClip);
  }
  optimizer.step();
  result.loss = loss.item<double>();
  return result;
}

EvalResult evaluate(BlockModel& model, const Dataset& dataset, int64_t batchSize,
                    int64_t maxBatches) {
  const bool wasTraining = model->is_training();
  model->eval();
  torch::NoGradGuard noGrad;
  EvalResult r;
  double lossSum = 0.0;
  int64_t correct = 0;
  int64_t counted = 0;  // examples, or tokens for language models
  int64_t done = 0;
  for (const auto& indices : sequentialBatches(dataset.size(), batchSize)) {
    if (maxBatches > 0 && done++ >= maxBatches) break;
    Batch b = dataset.get(indices);
    at::Tensor out = model->forward(b.input);
    at::Tensor loss = taskLoss(model->task(), out, b.target);
    int64_t n = b.target.numel();
    lossSum += loss.item<double>() * static_cast<double>(n);
    correct += out.argmax(-1).eq(b.target).sum().item<int64_t>();
    counted += n;
    r.examples += b.size();
  }
  if (wasTraining) model->train();
  CARAVAN_CHECK(counted > 0, "empty evaluation set");
  r.loss = lossSum / static_cast<double>(counted);
  r.accuracy = static_cast<double>(correct) / static_cast<double>(counted);
  return r;
}

}  // namespace caravan
