// PipelineStep: the step engine (step_engine.h) of one pipeline stage (pipeline/stage.h): the
// stage's program over the batch's micro-batches, then its replicas' gradients averaged by the
// same bucketed all-reduce data parallelism uses (AllReduceStrategy::attachGradients, launched
// once the program's last backward is done: a stage accumulates over micro-batches), a tied
// weight's gradients summed over its stages, and one reduction over the stages (the loss and
// the squared gradient norm, so every stage logs the same loss, skips alike and clips with
// the global norm). Also one worker accumulating M micro-batches (one stage, no communicator):
// the pipeline's reference.
//
// Under sync.shard (with replicas; sync/sharding.h's StageScope) each stage's trainable
// parameters are flat units over its replica group, each replica owning a slice: the program
// runs on the whole weights (gathered before it under parameters, freed after the
// reduce-scatter), the gradients accumulate in the whole local .grad over the micro-batches,
// then one reduce-scatter per unit replaces the replicas' all-reduce; tied parameters' slices
// are summed over their stages, the squared norm of the slices over the whole world, the run's
// optimizer steps this rank's slices (a second optimizer, as in ShardedStep) and the updated
// slices are all-gathered back (parameters: only the slices persist between steps).
//
// Checkpoints: rank 0's model and optimizer get every stage's parameters and optimizer state
// for the file (withWholeModel; a sharded stage's state first gathered from its replicas' slices
// to its first replica), and each stage then holds its own blocks' again (its slices' state).
#pragma once

#include <memory>

#include "pipeline/stage.h"
#include "sync/allreduce.h"
#include "train/step_engine.h"

namespace caravan {

class Communicator;
class ShardedParameters;

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
    // sync.shard: the stage's units over `replicas`, and the run's optimizer over their slices
    // (ShardedParameters::shards()); the setup's optimizer then keeps the learning rate only
    // (and a resumed run's whole state, which is sliced here). Null: unsharded.
    std::unique_ptr<ShardedParameters> shards;
    std::unique_ptr<torch::optim::Optimizer> sliced;
  };
  // `stage`: built on the run's model and optimizer, holding its own blocks only.
  PipelineStep(std::unique_ptr<PipelineStage> stage, torch::optim::Optimizer& optimizer,
               StepOptions options, Parts parts);
  ~PipelineStep() override;

  const PipelineStage& stage() const { return *stage_; }

  EvalResult evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) override;
  void withWholeModel(const std::function<void()>& write) override;
  void finish() override;
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
  void afterUpdate(int64_t step, StepResult& r) override;
  void strategyLearningRate(double lr) override;

  std::unique_ptr<PipelineStage> stage_;
  Parts parts_;
  std::unique_ptr<AllReduceStrategy> replicaAverage_;  // null without replicas, or sharded
};

}  // namespace caravan
