// ShardedStep: the step engine (step_engine.h) of a data-parallel worker under sync.shard
// (ZeRO stages 1-3; sync/sharding.h holds the flat units and their collectives). Its step:
// forward (each block waiting for its unit's gather), backward (each unit's gradients
// reduce-scattered as backward completes it), the slices' averaged gradients checked and
// clipped with the global norm (one all-reduce of the squared norm), the run's optimizer on
// this rank's slices only (a second optimizer, same options, over ShardedParameters::shards()),
// then the updated slices all-gathered (overlapping the next forward). Under memory.weights =
// offload (sync.shard = parameters: ZeRO-Infinity's composition) the slices and their optimizer
// state live on memory.tier and the update steps one unit's slice at a time, reading it back
// and writing it again (ShardedParameters::stepOffloaded).
//
// The setup's optimizer keeps the learning rate (and a resumed run's whole state until it is
// sliced). A checkpoint is a sharded set (train/sharded_checkpoint.h): each rank writes its own
// slices and their optimizer state, with no gather, a unit at a time (offloaded: each read back
// from the tier, written, let go). model.pt streams the same way on rank 0: each unit gathered,
// its parameters written, freed; no rank ever holds the whole model. A run resumed on
// as many workers installs its own slices from it; one on another number of workers, or from
// an in-core checkpoint, gets the whole state in the setup's optimizer and slices it anew.
#pragma once

#include <memory>

#include "sync/sharding.h"
#include "train/sharded_checkpoint.h"
#include "train/step_engine.h"

namespace caravan {

class ShardedStep : public StepEngine {
 public:
  // `sliced`: the run's optimizer over shards->shards(). The setup's `optimizer` holds a resumed
  // run's whole state, which moves into `sliced` here; or `resumed` holds this rank's slices
  // of a sharded checkpoint of as many workers (the weights and their optimizer state), which
  // are installed (CheckpointError if its units are not these). `offloadTier` (memory.weights =
  // offload; null: in memory): where the slices and their state live from then on
  // (ShardedParameters::offloadTo); it outlives the engine.
  ShardedStep(BlockModel model, torch::optim::Optimizer& optimizer, StepOptions options,
              std::unique_ptr<ShardedParameters> shards,
              std::unique_ptr<torch::optim::Optimizer> sliced,
              std::shared_ptr<const ShardedSlices> resumed = nullptr,
              const std::string& resumedFrom = "", Tier* offloadTier = nullptr);
  ~ShardedStep() override;

  EvalResult evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) override;
  void withWholeModel(const std::function<void()>& write) override;
  void exportModel(
      const std::string& path, torch::nn::Module& model,
      const std::function<std::vector<std::string>(const std::string&)>& rename) override;
  std::optional<std::string> writeShardedCheckpoint(const CheckpointDir& dir,
                                                    const TrainingState& state) override;
  void finish() override;
  void accountModelState(MemoryTracker& memory) override;
  std::vector<at::Tensor> modelStateTensors() override;
  std::vector<nlohmann::json> takeRecords(int64_t stepsDone, const StepResult& r,
                                          Clock::time_point stepStart, double seconds) override;
  void addSpans(Timeline& timeline, const StepResult& r,
                Clock::time_point stepStart) const override;
  std::string describe() const override;
  std::string memoryAdvice() const override;

 private:
  void computeGradients(const Batch& batch, int64_t step, StepResult& r) override;
  bool gradientsFinite(const StepResult& r) override;
  double clipGradients(double maxNorm, const StepResult& r) override;
  std::vector<at::Tensor> trainedParameters() override;
  void update() override;
  void afterUpdate(int64_t step, StepResult& r) override;
  void strategyLearningRate(double lr) override;
  // The global squared gradient norm of this step (one all-reduce, once per step).
  double normSquared();
  // The units as a checkpoint records them (the model's parameter names).
  ShardedLayout layout() const;
  // A sharded checkpoint's slices of this rank into the units and `sliced_`.
  void install(const ShardedSlices& resumed, const std::string& path);

  BlockModel model_;
  std::unique_ptr<ShardedParameters> shards_;
  std::unique_ptr<torch::optim::Optimizer> sliced_;
  at::Tensor loss_;
  double normSquared_ = 0.0;
  bool normKnown_ = false;  // normSquared_ is this step's
};

}  // namespace caravan
