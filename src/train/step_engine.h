// StepEngine: how this rank trains one step, evaluates and holds the whole model for a file,
// whatever the parallelism. RunSetup::attach builds the run's engine; the trainer drives it
// without knowing which it is:
//   DataParallelStep (data_parallel_step.h): the whole model on each rank, a strategy
//     (sync.mode) between the ranks, optionally out-of-core weights; also one process alone;
//   PipelineStep (pipeline_step.h): one stage of a pipeline, its replicas' gradients averaged
//     by the bucketed all-reduce data parallelism uses; also gradient accumulation.
//
// A step (step()) is one order for every engine, written once here:
//   zero the gradients -> computeGradients (forward, backward, the exchange) ->
//   the non-finite skip (gradientsFinite) -> clipping (clipGradients) -> update -> afterUpdate.
// The engines say what each phase means for them; the order, the skip's bookkeeping and the
// result are this class's.
//
// Ownership: an engine refers to the setup's model and optimizer (and a strategy, out-of-core
// weights, communicators), which outlive it; a PipelineStep owns its stage and shares its
// replicas' communicator with the Distributed.
// Threading: the trainer's thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/torch_fwd.h"
#include "data/dataset.h"
#include "models/model.h"
#include "train/step.h"

namespace caravan {

class CheckpointDir;
class MemoryTracker;
class Timeline;
struct TrainingState;

// What every engine's step does besides the gradients.
struct StepOptions {
  double gradClip = 0.0;       // optim.grad_clip: the global L2 norm (0 = off)
  bool skipNonFinite = false;  // train.nonfinite_skips > 0: a non-finite step updates nothing
};

class StepEngine {
 public:
  using Clock = std::chrono::steady_clock;
  virtual ~StepEngine() = default;
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  // The learning rate of the next steps (the optimizer's, and a strategy's whose optimizer runs
  // elsewhere).
  void setLearningRate(double lr);
  // One training step on `batch`, the run's step `step` (0-based). skipNonFinite: when the
  // engine finds the step not finite (gradientsFinite: what every rank that updates together
  // sees alike) the gradients are dropped and nothing updates (result.skipped); the step's
  // other work (a strategy's afterStep) still runs.
  StepResult step(const Batch& batch, int64_t step);

  // Evaluation in eval mode over the first `maxBatches` batches (0 = all) of `dataset`, shared
  // out over the ranks (train/step.h's evaluate); every rank gets the result.
  virtual EvalResult evaluate(const Dataset& dataset, int64_t batchSize, int64_t maxBatches) = 0;
  // Makes replicas that drift (local SGD, gossip) one model before evaluation and checkpoints;
  // returns how far apart they were (0 for engines that keep them equal).
  virtual double consolidate() { return 0.0; }
  // Whether evaluations report that distance (data-parallel replicas under a strategy).
  virtual bool reportsConsensus() const { return false; }
  // The strategy's state for a checkpoint (after consolidate; a collective over the job).
  virtual std::map<std::string, at::Tensor> strategyState() { return {}; }
  // Runs `write` on rank 0 (it writes the checkpoint or model.pt) with the whole model's
  // parameters and optimizer state in the setup's model and optimizer, in their in-core form,
  // and puts back afterwards what this rank trains. Every rank calls it. (A sharded engine is
  // never asked: its checkpoints are per-rank sets and its model.pt streams, exportModel.)
  virtual void withWholeModel(const std::function<void()>& write) = 0;
  // Writes `model`'s parameters and buffers as model.pt at `path` on rank 0 (exportStateDict,
  // `rename`); every rank calls it. By default within withWholeModel; a sharded engine streams
  // it, each unit gathered in turn and written, so that no rank holds the whole model.
  virtual void exportModel(
      const std::string& path, torch::nn::Module& model,
      const std::function<std::vector<std::string>(const std::string&)>& rename);
  // Writes the checkpoint of `state` (its step) as a set of per-rank files and returns its
  // path (sharded engines: each rank its own slices, with no gather; every rank calls it);
  // nullopt where the checkpoint is the in-core file rank 0 writes within withWholeModel.
  virtual std::optional<std::string> writeShardedCheckpoint(const CheckpointDir& dir,
                                                            const TrainingState& state) {
    return std::nullopt;
  }
  // After the last step on every rank (a normal end or a stop).
  virtual void finish() {}
  // Sets `memory`'s weights, gradients and optimizer state to what this rank holds now (after
  // attach, after each step). Out-of-core weights and sharded units count their own as they
  // come and go.
  virtual void accountModelState(MemoryTracker& memory) = 0;
  // The tensors whose storages are this rank's model state: an op that saves one for backward
  // saves a weight, not an activation. A storage empty now that is gathered into again (sharded
  // parameters) counts too.
  virtual std::vector<at::Tensor> modelStateTensors() = 0;
  // Whether the ranks advance step by step together (the trainer's per-step agreement then
  // costs no extra wait); asynchronous strategies agree only on the record steps.
  virtual bool lockstep() const { return true; }
  // Numbers for the next train record (metrics.jsonl), since the last call.
  virtual std::map<std::string, double> takeMetrics() { return {}; }
  // Records of their own (docs/metrics.md) after the step that made `stepsDone` steps, which
  // began at `stepStart` and returned `r`: every rank calls it (a pipeline gathers its stages'
  // timeline once); rank 0 writes them. `seconds`: the run's training time so far.
  virtual std::vector<nlohmann::json> takeRecords(int64_t stepsDone, const StepResult& r,
                                                  Clock::time_point stepStart, double seconds) = 0;
  // The step's phases on the timeline (forward, backward or the pipeline's actions, waits, the
  // optimizer).
  virtual void addSpans(Timeline& timeline, const StepResult& r,
                        Clock::time_point stepStart) const = 0;
  // What else lowers this rank's memory, for a refused memory.budget under a fixed
  // memory.policy ("; or set memory.policy = auto to ...").
  virtual std::string memoryAdvice() const;
  // The config keys whose rates move the parameters, for the advice after a non-finite loss
  // ("optim.lr"; DiLoCo's outer step: "sync.outer_lr or optim.lr").
  virtual std::string rateKeys() const { return "optim.lr"; }
  // How the step runs, for the start banner: " per worker x 2 workers (gloo, allreduce)".
  virtual std::string describe() const = 0;

 protected:
  StepEngine(torch::optim::Optimizer& optimizer, StepOptions options)
      : optimizer_(optimizer), options_(options) {}

  // Forward, backward and the exchange after it; sets r's forwardEnd, backwardEnd, syncEnd, its
  // computeSeconds and syncWaitSeconds up to backwardEnd (step() adds the exchange's wait and
  // the update's time) and, where it is known by then, its loss and gradNorm.
  virtual void computeGradients(const Batch& batch, int64_t step, StepResult& r) = 0;
  // Forward, loss and backward of the whole model on `batch` (the engines that hold it, whatever
  // the exchange around them): sets r's forwardEnd, backwardEnd and computeSeconds from `start`
  // (which may precede it: a strategy's beforeForward); returns the loss.
  static at::Tensor forwardBackward(BlockModel& model, const Batch& batch, StepResult& r,
                                    Clock::time_point start);
  // The phases of such a step on the timeline: forward, backward, the optimizer and, where the
  // ranks exchange (`exchanges`), the waits for the gradients and after the update.
  static void addWholeModelSpans(Timeline& timeline, const StepResult& r,
                                 Clock::time_point stepStart, bool exchanges);
  // Whether the step may update (skipNonFinite): every rank that updates together decides
  // alike.
  virtual bool gradientsFinite(const StepResult& r) = 0;
  // Scales the gradients to a global L2 norm of at most `maxNorm`; returns the norm before.
  virtual double clipGradients(double maxNorm, const StepResult& r) = 0;
  // The parameters this rank updates (a skipped step drops their gradients).
  virtual std::vector<at::Tensor> trainedParameters() = 0;
  // Applies the gradients (the optimizer, or what stands in for it).
  virtual void update() = 0;
  // After the update: a strategy's parameter exchange; the loss where it was not known before.
  virtual void afterUpdate(int64_t step, StepResult& r) {}
  // The strategy's share of setLearningRate.
  virtual void strategyLearningRate(double lr) {}

  torch::optim::Optimizer& optimizer_;
  const StepOptions options_;
};

}  // namespace caravan
