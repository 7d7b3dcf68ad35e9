// PipelineStep: the step engine (step_engine.h) of one pipeline stage (pipeline/stage.h): the
// stage's program over the batch's micro-batches, then its replicas' gradients averaged by the
// same bucketed all-reduce data parallelism uses (AllReduceStrategy::attachGradients, launched
// once the program's last backward is done: a stage accumulates over micro-batches), a tied
// weight's gradients summed over its stages, and one reduction over the stages (the loss and
// the squared gradient norm, so every stage logs the same loss, skips alike and clips with
// the global norm). Also one worker accumulating M micro-batches (one stage, no communicator):
// the pipeline's reference.
//
// Checkpoints: rank 0's model and optimizer get every stage's parameters and optimizer state
// for the file (withWholeModel), and each stage then holds its own blocks' again.
#pragma once

#include <memory>

#include "pipeline/stage.h"
#include "sync/allreduce.h"
#include "train/step_engine.h"

namespace caravan {

class Communicator;

class PipelineStep : public StepEngine {
 public:
  // What the setup made besides the stage. Communicators outlive the engine.
  struct Parts {
    Communicator* comm = nullptr;            // the stages' world (null: one process)
    std::shared_ptr<Communicator> replicas;  // this stage's replicas in other pipelines, or null
    // The replica average's buckets (sync.bucket_mb, sync.first_bucket_mb); uncompressed.
    AllReduceOptions buckets;
    // The step after which every stage's timeline is gathered into metrics.jsonl (every rank
    // passes the same: the third step this process runs, or the run's last).
    int64_t timelineStep = -1;
  };
  // `stage`: built on the run's model and optimizer, holding its own blocks only.
  PipelineStep(std::unique_ptr<PipelineStage> stage, torch::optim::Optimizer& optimizer,
               StepOptions options, Parts parts);
  ~PipelineStep() override;

  const PipelineStage& stage() const { return *stage_; }

  EvalResult evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) override;
  void withWholeModel(const std::function<void()>& write) override;
  void accountModelState(MemoryTracker& memory) override;
  std::vector<at::Tensor> modelStateTensors() override;
  std::vector<nlohmann::json> takeRecords(int64_t stepsDone, const StepResult& r,
                                          Clock::time_point stepStart, double seconds) override;
  void addSpans(Timeline& timeline, const StepResult& r,
                Clock::time_point stepStart) const override;
  std::string describe() const override;

 private:
  void computeGradients(const Batch& batch, int64_t step, StepResult& r) override;
  bool gradientsFinite(const StepResult& r) override;
  double clipGradients(double maxNorm, const StepResult& r) override;
  std::vector<at::Tensor> trainedParameters() override;
  void update() override;

  std::unique_ptr<PipelineStage> stage_;
  Parts parts_;
  std::unique_ptr<AllReduceStrategy> replicaAverage_;  // null without replicas
};

}  // namespace caravan
