// What a training step returns (StepResult; the step engines of step_engine.h make it), and
// evaluation, shared by the engines, the benchmarks and the oracle tests, so that what is
// measured and tested is what `caravan train` runs.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>

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
  // The step's time computing (forward, backward, the optimizer; a pipeline stage: its own
  // actions) and blocked on synchronization (the exchanges; a stage: also its waits for its
  // neighbours, bubbles and transfers), for the metrics' compute/synchronization split.
  double computeSeconds = 0.0, syncWaitSeconds = 0.0;
  std::vector<StageStepStats::Span> stageSpans;  // each compute action and receive, in order
};

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
// `idleForward` (with a communicator): called once for each round of W batches in which this
// rank has none while a lower rank has one, so every rank makes as many forwards (sharded
// parameters gather the blocks' weights collectively in each; sync/sharding.h).
EvalResult evaluate(BlockModel& model, const Dataset& dataset, int64_t batchSize,
                    int64_t maxBatches, Communicator* comm = nullptr,
                    PipelineStage* pipeline = nullptr,
                    const std::function<void()>& idleForward = nullptr);

}  // namespace caravan
