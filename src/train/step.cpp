// Evaluation (see step.h).
#include "train/step.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include <torch/torch.h>

#include "comm/communicator.h"
#include "core/errors.h"
#include "data/loader.h"
#include "memory/weights.h"
#include "pipeline/stage.h"
#include "sync/strategy.h"

namespace caravan {

EvalResult evaluate(BlockModel& model, const Dataset& dataset, int64_t batchSize,
                    int64_t maxBatches, Communicator* comm, PipelineStage* pipeline,
                    const std::function<void()>& idleForward) {
  const bool wasTraining = model->is_training();
  model->eval();
  torch::NoGradGuard noGrad;
  EvalResult r;
  double lossSum = 0.0;
  int64_t correct = 0;
  int64_t counted = 0;  // examples, or tokens for language models
  // The batches are shared out over the workers, or over the pipelines (each batch goes
  // through every stage of one; its last stage counts it).
  const int shard = pipeline != nullptr ? pipeline->layout().replica
                    : comm != nullptr   ? comm->rank()
                                        : 0;
  const int shards = pipeline != nullptr ? pipeline->layout().replicas
                     : comm != nullptr   ? comm->size()
                                         : 1;
  int64_t index = -1;
  // Accuracy counts the argmax of the last dimension against class targets; a module's own loss
  // may take outputs of other shapes (then there is no accuracy, as for regression).
  bool classes = dataset.shape().task != TaskKind::kRegression;
  for (const auto& indices : sequentialBatches(dataset.size(), batchSize)) {
    ++index;
    if (maxBatches > 0 && index >= maxBatches) break;
    if (index % shards != shard) continue;
    Batch b = dataset.get(indices);
    at::Tensor out = pipeline != nullptr ? pipeline->forwardOnly(b.input) : model->forward(b.input);
    if (!out.defined()) continue;  // a stage before the last
    at::Tensor loss = model->loss(out, b.target);
    int64_t n = b.target.numel();
    lossSum += loss.item<double>() * static_cast<double>(n);
    classes = classes && out.dim() == b.target.dim() + 1 &&
              out.sizes().slice(0, b.target.dim()) == b.target.sizes();
    if (classes) correct += out.argmax(-1).eq(b.target).sum().item<int64_t>();
    counted += n;
    r.examples += b.size();
  }
  if (idleForward && shards > 1) {
    // index + 1 batches were visited (or maxBatches); rank `shard` ran ceil((total - shard) /
    // shards) of the ceil(total / shards) rounds.
    const int64_t total = maxBatches > 0 ? std::min(index + 1, maxBatches) : index + 1;
    const int64_t rounds = (total + shards - 1) / shards;
    const int64_t mine = total > shard ? (total - shard + shards - 1) / shards : 0;
    for (int64_t i = mine; i < rounds; ++i) idleForward();
  }
  if (wasTraining) model->train();
  if (comm != nullptr) {
    // Outputs of another shape than the targets' classes on any rank that counted: no accuracy.
    const bool counts = pipeline == nullptr || pipeline->layout().last();
    at::Tensor sums = torch::tensor({lossSum}, at::kDouble);
    at::Tensor ints = torch::tensor(
        {correct, counted, r.examples, static_cast<int64_t>(counts && !classes)}, at::kLong);
    comm->allreduce(sums, ReduceOp::kSum)->wait(comm->timeout());
    comm->allreduce(ints, ReduceOp::kSum)->wait(comm->timeout());
    lossSum = sums[0].item<double>();
    correct = ints[0].item<int64_t>();
    counted = ints[1].item<int64_t>();
    r.examples = ints[2].item<int64_t>();
    classes = ints[3].item<int64_t>() == 0 && dataset.shape().task != TaskKind::kRegression;
  }
  CARAVAN_CHECK(counted > 0, "empty evaluation set");
  r.loss = lossSum / static_cast<double>(counted);
  r.accuracy = classes ? static_cast<double>(correct) / static_cast<double>(counted)
                       : std::numeric_limits<double>::quiet_NaN();
  return r;
}

std::string accuracyText(double accuracy, const std::string& label) {
  if (std::isnan(accuracy)) return "";
  return fmt::format(", {}accuracy {:.2f}%", label, 100.0 * accuracy);
}

}  // namespace caravan
