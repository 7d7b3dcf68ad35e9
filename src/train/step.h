// One training step and evaluation, shared by the trainer, the benchmarks and the oracle
// tests, so that what is measured and tested is what `caravan train` runs.
#pragma once

#include <chrono>
#include <cstdint>

#include <ATen/ATen.h>

#include "core/torch_fwd.h"
#include "data/dataset.h"
#include "models/loss.h"
#include "models/model.h"
#include "pipeline/stage.h"

namespace caravan {

struct StepResult {
  double loss = 0.0;      // the mini-batch loss before the update
  double gradNorm = 0.0;  // global L2 norm of the gradient (before clipping); 0 if not computed
  bool skipped = false;   // skipNonFinite: the loss or a gradient was not finite, no update
  // When each phase ended, for the timeline and the compute/synchronization split: forward,
  // backward, gradient synchronization, the optimizer, the strategy's afterStep.
  std::chrono::steady_clock::time_point forwardEnd, backwardEnd, syncEnd, optimizerEnd, stepEnd;
  // Pipeline steps (pipelined): this stage's forward and backward actions, and its waits for
  // its neighbours (bubbles and transfers) within the program.
  bool pipelined = false;
  double stageComputeSeconds = 0.0, stageWaitSeconds = 0.0;
  std::vector<StageStepStats::Span> stageSpans;  // each compute action and receive, in order
};

class Strategy;
class OutOfCoreWeights;

// zero_grad, forward, loss, backward, the strategy's gradient synchronization (if any),
// optional clipping (gradClip > 0), optimizer step, the strategy's afterStep. The learning
// rate must already be set. With out-of-core weights the blocks' own optimizers update (some
// during backward) and `weights->finishStep()` stands in for optimizer.step().
// `skipNonFinite`: when any gradient (after the strategy's exchange, so every rank of an
// all-reduce decides alike) or, in one process, the loss is not finite, the gradients are
// dropped and the optimizer does not run (result.skipped); the strategy's afterStep still runs.
StepResult trainStep(BlockModel& model, torch::optim::Optimizer& optimizer, const Batch& batch,
                     double gradClip, Strategy* strategy = nullptr, int64_t step = 0,
                     OutOfCoreWeights* weights = nullptr, bool skipNonFinite = false);

class PipelineStage;

// The step of one pipeline stage (pipeline/stage.h; also one worker accumulating M
// micro-batches): zero_grad, the stage's program over the batch's micro-batches, one reduction
// over the stages (the loss and the global gradient norm, so every stage clips alike and logs
// the same loss), clipping, the optimizer on this stage's parameters. skipNonFinite: when the
// loss or the global norm is not finite, no stage updates (result.skipped). forwardEnd and
// backwardEnd both mark the end of the program (its forwards and backwards interleave);
// stageComputeSeconds / stageWaitSeconds say how the program's time went.
StepResult pipelineTrainStep(PipelineStage& stage, torch::optim::Optimizer& optimizer,
                             const Batch& batch, double gradClip, bool skipNonFinite = false);

struct EvalResult {
  double loss = 0.0;      // mean per example (per token for language models)
  double accuracy = 0.0;  // fraction correct (per token for language models); NaN for
                          // regression (float targets: nothing to count; null in JSON)
  int64_t examples = 0;
};

// ", accuracy 91.20%" (with `label` before "accuracy"), or "" when there is none (regression).
std::string accuracyText(double accuracy, const std::string& label = "");

class Communicator;

// Evaluates in eval mode without gradients over the first `maxBatches` batches (0 = all) of
// `dataset` in order; restores the model's training mode. With a communicator, rank r takes
// batches r, r+W, ... and the totals are summed over ranks (every rank gets the result). With
// a pipeline stage, pipeline d takes batches d, d+D, ... through its stages
// (PipelineStage::forwardOnly: no rank needs the whole model) and its last stage counts them.
EvalResult evaluate(BlockModel& model, const Dataset& dataset, int64_t batchSize,
                    int64_t maxBatches, Communicator* comm = nullptr,
                    PipelineStage* pipeline = nullptr);

}  // namespace caravan
