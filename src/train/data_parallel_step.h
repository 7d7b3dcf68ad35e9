// DataParallelStep: the step engine (step_engine.h) of a rank that holds the whole model: one
// process alone, or a worker of a data-parallel job whose strategy (sync.mode) keeps the
// replicas together; the blocks' weights in memory or out of core (memory.weights = offload).
//
// Its step: the strategy's beforeForward, forward, loss, backward, the strategy's
// finishGradients (the gradient exchange), then the common skip and clipping (libtorch's
// clip_grad_norm_ over the model's parameters, equal on every rank after an all-reduce), the
// optimizer (out-of-core weights' finishStep in its place; nothing where servers update), and
// the strategy's afterStep. The non-finite skip rests on the exchanged gradients alone when
// there is a strategy (equal on every rank of an all-reduce; a rank's own loss is not).
#pragma once

#include "train/step_engine.h"

namespace caravan {

class Communicator;
class OutOfCoreWeights;
class Strategy;

// What a worker of a job adds to the model and its optimizer; each may be null (one process;
// weights in core). They must outlive the engine.
struct DataParallelParts {
  Strategy* strategy = nullptr;         // the job's sync.mode
  Communicator* workers = nullptr;      // the data-parallel workers (evaluation's shards)
  OutOfCoreWeights* weights = nullptr;  // memory.weights = offload
};

class DataParallelStep : public StepEngine {
 public:
  using Parts = DataParallelParts;
  DataParallelStep(BlockModel model, torch::optim::Optimizer& optimizer, StepOptions options,
                   Parts parts = {});

  EvalResult evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) override;
  double consolidate() override;
  bool reportsConsensus() const override { return parts_.strategy != nullptr; }
  std::map<std::string, at::Tensor> strategyState() override;
  void withWholeModel(const std::function<void()>& write) override;
  void finish() override;
  void accountModelState(MemoryTracker& memory) override;
  std::vector<at::Tensor> modelStateTensors() override;
  bool lockstep() const override;
  std::map<std::string, double> takeMetrics() override;
  std::vector<nlohmann::json> takeRecords(int64_t stepsDone, const StepResult& r,
                                          Clock::time_point stepStart, double seconds) override;
  void addSpans(Timeline& timeline, const StepResult& r,
                Clock::time_point stepStart) const override;
  std::string describe() const override;
  std::string rateKeys() const override;
  std::string memoryAdvice() const override;

 private:
  void computeGradients(const Batch& batch, int64_t step, StepResult& r) override;
  bool gradientsFinite(const StepResult& r) override;
  double clipGradients(double maxNorm, const StepResult& r) override;
  std::vector<at::Tensor> trainedParameters() override;
  void update() override;
  void afterUpdate(int64_t step, StepResult& r) override;
  void strategyLearningRate(double lr) override;

  BlockModel model_;
  Parts parts_;
  at::Tensor loss_;  // this step's, until afterUpdate reads it
};

}  // namespace caravan
