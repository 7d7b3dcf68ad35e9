// RunSetup: a run put together once, in the one order every use of it needs, from its config
// and the worker's place in the job. `caravan train`, `caravan eval`, `caravan plan`, the
// benchmark and the tests all build their run through it.
//
// The order matters for the numbers: seed.init before the model is built; the loader, the
// checkpoint (its RNG state) or seed.dropout, then activation memory (whose profile runs
// forward and backward), all before the strategy attaches (so the profile starts no gradient
// exchange and the strategy broadcasts what the checkpoint loaded); out-of-core weights last
// (they move the blocks the strategy broadcast to the tier).
//
//   RunSetup setup(config, options, rank, workers);  // data, model, optimizer, sampler, steps
//   setup.prepareTraining(resumeFrom);               // loader, resume state, activation memory
//   auto engine = setup.attach(dist);                // the step engine: strategy or stage,
//                                                    // out-of-core weights
//
// Threading: built and used by one thread (the trainer's).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/torch_fwd.h"
#include "data/dataset.h"
#include "data/loader.h"
#include "memory/tracker.h"
#include "memory/weights.h"
#include "models/model.h"
#include "sync/strategy.h"
#include "train/checkpoint.h"
#include "train/memory_setup.h"
#include "train/precision.h"
#include "train/run_options.h"
#include "train/schedule.h"
#include "train/step_engine.h"

namespace caravan {

class Distributed;
class Communicator;
class StepEngine;

class RunSetup {
 public:
  // Datasets, the model (seeded with seed.init), its optimizer, and the training sampler of
  // worker `rank` of `workers` (parameter servers not counted) with the run's step count.
  // `options` is RunOptions::read(config), read once by the caller (which validated it).
  RunSetup(const Config& config, RunOptions options, int rank = 0, int workers = 1);
  // This process's share of a job (`dist`; null: one process): the stages of one pipeline
  // draw the same batches, so the data is sharded over the data-parallel replicas.
  RunSetup(const Config& config, RunOptions options, Distributed* dist);
  // One process: reads and validates the options itself.
  explicit RunSetup(const Config& config);

  // What `caravan eval` and `caravan plan` need of a run: the datasets and the model (seeded
  // with seed.init), nothing that trains (no optimizer, no sampler: a config they read need not
  // be one that can train, as before).
  static RunSetup forInspection(const Config& config);
  ~RunSetup();
  RunSetup(const RunSetup&) = delete;
  RunSetup& operator=(const RunSetup&) = delete;

  // The first data.batch_size training examples: a batch like the run's, for profiling.
  Batch sampleBatch() const;

  // For training: the loader; the checkpoint `resumeFrom` (model, optimizer, RNG, data
  // position, resharded when the number of workers or the batch changed) or seed.dropout for
  // a new run; the activation memory (planned under memory.budget for memory.policy = auto,
  // ConfigError when nothing fits).
  // `localProcesses`: the processes training on this host (their memory adds up; checked
  // against the machine's before anything large is allocated, checkTrainingFitsMachine).
  void prepareTraining(const std::optional<std::string>& resumeFrom, int localProcesses = 1);
  // After prepareTraining: the run's step engine (train/step_engine.h). A pipeline
  // (parallel.pipeline_stages > 1 or parallel.micro_batches > 1) gets this rank's stage, cut
  // where rank 0 planned; otherwise the strategy of `dist` (null in one process) attaches with
  // the run's optimizer, parameter groups and restored strategy state, then out-of-core
  // weights. The engine refers to this setup, which must outlive it.
  std::unique_ptr<StepEngine> attach(Distributed* dist);

  // The plans rank 0 writes into the run directory with its first step: {file name, text}
  // (memory_plan.txt under memory.policy = auto, pipeline_plan.txt when rank 0 cut stages).
  std::vector<std::pair<std::string, std::string>> planFiles() const;

  // The number of the model's parameters (counted when it was built: out-of-core weights
  // empty the parameters they moved to the tier).
  int64_t parameterCount() const { return parameterCount_; }

  const Config& config;  // the resolved config (config.toml), owned by the caller
  const RunOptions options;
  const int rank;     // among the workers
  const int workers;  // data-parallel workers (parameter servers not counted)

  DatasetSplits data;
  BlockModel model = nullptr;
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // none forInspection
  SamplerOptions sampler;
  int64_t batchesPerEpoch = 0;
  int64_t totalSteps = 0;
  ScheduleOptions schedule;  // with the run's totalSteps
  nlohmann::json identity;   // runIdentity: what a checkpoint of this run must match

  // prepareTraining:
  std::unique_ptr<Loader> loader;
  std::optional<std::string> resumedFrom;  // the checkpoint continued from
  TrainingState state;                     // the step and data position to continue at
  std::string reshardNote;                 // one line when the checkpoint was resharded
  PrecisionChoice precision;               // train.precision's blocks (state.bf16Blocks records it)
  ActivationMemory activations;

  // attach:
  MemoryTracker memory;  // tracked bytes by category (the out-of-core store's too)
  std::unique_ptr<OutOfCoreWeights> weights;  // memory.weights = offload

 private:
  // What every use needs: the datasets, the model (seeded with seed.init), the identity.
  struct ModelOnly {};
  RunSetup(const Config& config, RunOptions options, int rank, int workers, ModelOnly);
  int64_t parameterCount_ = 0;
  // The cut every rank of `comm` (null: one process) runs, from rank 0's plan: K + 1 block
  // boundaries and, per block, whether it recomputes (memory.policy = auto). Throws the refusal
  // when no cut fits memory.budget.
  struct PipelineCut {
    std::vector<size_t> boundaries;
    std::vector<bool> recompute;
  };
  PipelineCut pipelineCut(Communicator* comm);
  // Every worker of `comm` takes rank 0's bf16 blocks (train.precision = bf16 is timed, and
  // ranks timing at once would disagree): one broadcast, then state.bf16Blocks records it.
  void takeRankZeroPrecision(Communicator& comm);
  // attach's three kinds of engine.
  std::unique_ptr<StepEngine> attachPipeline(Distributed* dist);
  std::unique_ptr<StepEngine> attachDataParallel(Distributed* dist);
  std::unique_ptr<StepEngine> attachSharded(Distributed& dist);
  // Whether the workers shard the model state (sync.shard, in a job).
  bool sharded(const Distributed* dist) const;
  std::optional<PipelinePlan> pipelinePlan_;  // rank 0's (the others take its boundaries)
};

}  // namespace caravan
