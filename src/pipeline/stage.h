// PipelineStage: one stage of a pipeline (blocks [begin, end) of a BlockModel) that runs its
// schedule's program (pipeline/schedule.h) for one training step: it splits the replica's batch
// into M micro-batches along dimension 0, forwards them through its blocks, exchanges
// activations and their gradients with the neighbouring stages over a Communicator, and
// accumulates its blocks' parameter gradients of loss / M per micro-batch — what one worker
// accumulating the same M micro-batches computes.
//
// Layout: in a world of K x D ranks, rank r is stage r % K of replica r / K; a step's
// activations and gradients go to ranks r - 1 and r + 1 only (the reductions, the tied
// weights' sum and the gathers for a file reach the other stages). Every rank of a replica passes
// the same batch (the first stage uses its inputs, the last its targets).
//
// Messages (tags per micro-batch m): an activation goes as a header (its dtype and shape, 8
// int64s: the receiver cannot know the shape a block produces) then its payload; the gradient
// of an activation goes as a payload of the shape the receiver sent. Sends are asynchronous; an
// activation's send is dropped when its gradient comes back, a gradient's once complete (looked
// at before each receive), and all are waited for before runStep returns.
//
// Memory: every rank builds (or loads) the whole model; holdOwnStageOnly then frees every other
// stage's parameters, so a stage holds its own blocks' weights, gradients and optimizer state
// and its micro-batches' activations. Rank 0 brings the whole model back for a file only.
//
// Tied weights: a parameter that blocks of several stages read is held by each (see
// sumTiedGradients).
//
// Errors: a lost or silent neighbour raises PeerError from the wait (the communicator's
// timeout); a schedule that fails checkSchedule is refused at construction
// (InternalError).
// Threading: one thread (the trainer's) per stage; the communicator is used by nothing else
// while runStep runs.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include "data/dataset.h"
#include "models/model.h"
#include "pipeline/schedule.h"

namespace caravan {

class Communicator;

struct PipelineLayout {
  int stages = 1;    // K
  int replicas = 1;  // D
  int stage = 0;     // this rank's: rank % K
  int replica = 0;   // rank / K
  // The layout of `rank` in a world of `worldSize` ranks cut into pipelines of `stages`.
  // ConfigError when worldSize is not a multiple of stages.
  static PipelineLayout of(int rank, int worldSize, int stages);
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

// What one stage did in a step, for metrics and the timeline.
struct StageStepStats {
  double loss = 0.0;            // last stage: the mean of its micro-batches' losses; else 0
  double computeSeconds = 0.0;  // forward and backward actions
  double waitSeconds = 0.0;     // blocked in a receive or in the step's final send waits
  int weightOnlyPasses = 0;     // zb-h1: Ws that computed only weight gradients (stage 0's and
                                // those of an output that ignores the input run a backward)
  struct Span {
    ActionKind kind;
    int microBatch;
    std::chrono::steady_clock::time_point start, end;
  };
  std::vector<Span> spans;  // each compute action and receive, in order
};

class PipelineStage {
 public:
  // `boundaries`: K + 1 block indices (stage s runs blocks [boundaries[s], boundaries[s+1])).
  // `comm` must outlive the stage; its world is layout.stages x layout.replicas. It may be null
  // for one stage in one process (gradient accumulation). Replicas of a stage (D > 1) average
  // their gradients outside it (train/pipeline_step.h).
  PipelineStage(BlockModel model, std::vector<size_t> boundaries, Communicator* comm,
                PipelineLayout layout, PipelineSchedule schedule, int microBatches);

  // Runs this stage's program for one step on `batch` (batch.size() must be a multiple of the
  // micro-batch count; ConfigError otherwise). Parameter gradients are added to (the caller
  // zeroes them first).
  StageStepStats runStep(const Batch& batch);

  // This stage's parameters (its blocks', and a tied one its blocks read: sumTiedGradients),
  // the ones it computes gradients for and updates.
  std::vector<at::Tensor> parameters();

  // A parameter that blocks of several stages read (a tied embedding and head; BlockModel::
  // sharedUses) is held, trained and updated by each of them, as Megatron keeps word
  // embeddings on the first and last stage: after runStep each gets the sum of their
  // gradients, added in stage order (the same bits on each, so their updates stay equal).
  // One message each way per pair of stages sharing some; nothing without ties across stages.
  // Every rank calls it, after its replicas averaged their gradients (so the sum is the last
  // arithmetic on it). `slice` (sharded stages, sync/sharding.h): where a tied parameter's
  // averaged gradient is instead of its .grad, this rank's slice of it (the same elements on
  // each of its stages); the sum is written into it.
  using GradientSlice = std::function<at::Tensor(const at::Tensor& param)>;
  void sumTiedGradients(const GradientSlice& slice = nullptr);
  // This stage's parameters as the global gradient norm counts them: a tied one on the first
  // of its stages only.
  std::vector<at::Tensor> normParameters();

  // The reductions of a step over the stages: the sum of the stages' squared gradient norms
  // and the last stages' mean loss, so every rank logs the same loss and clips with the global
  // norm (gradients averaged over replicas first). One all-reduce of two doubles over the
  // world; every rank calls it. `slicedNorm`: each replica's squared norm is that of its slices
  // of the stage's gradients (sync.shard), not of the whole of them, which every replica holds.
  struct Totals {
    double gradNormSquared = 0.0;
    double loss = 0.0;
  };
  Totals reduce(double localGradNormSquared, double localLoss, bool slicedNorm = false);

  // A stage holds its own blocks' parameters only: every other stage's become empty tensors
  // (their storage freed; shapes kept to bring them back) and their optimizer state is
  // dropped. Called once the stage is set up (every rank built or loaded the whole model), and
  // after rank 0 gathered the whole model for a file.
  void holdOwnStageOnly(torch::optim::Optimizer& optimizer);
  // Rank 0's model gets every stage's current parameters and float32 buffers (sent by the
  // rank that trains them), before it writes a checkpoint or model.pt; holdOwnStageOnly
  // drops them again. Other ranks' models are unchanged. Every rank calls it.
  void gatherParameters();
  // Rank 0's optimizer gets the state of every stage's parameters (sent by the rank that trains
  // them; sync/optimizer_state.h's flat layout), so rank 0's checkpoint holds all of it and
  // resumes on any number of stages. Other ranks' optimizers are unchanged. Every rank calls it.
  void collectOptimizerState(torch::optim::Optimizer& optimizer);
  // One step's spans of every stage of pipeline 0, on rank 0 (each stage's `spans` from its
  // runStep, as seconds from its own `stepStart`: a step starts after the previous one's
  // all-reduce, so the stages' origins agree within a message's latency); empty on the other
  // ranks. Every rank calls it.
  struct TimelineSpan {
    ActionKind kind;
    int microBatch;
    double start, end;
  };
  std::vector<std::vector<TimelineSpan>> gatherTimeline(
      const std::vector<StageStepStats::Span>& spans,
      std::chrono::steady_clock::time_point stepStart);
  // Evaluation through the pipeline: forwards one batch's `input` (first stage) or the
  // activation received from the previous stage through this stage's blocks without autograd
  // and sends it on, with the context (BlockModel::context). Every stage passes the batch's
  // input. Returns the model's output on the last stage, an undefined tensor on the
  // others. Every stage of a replica calls it once per evaluation batch, in the same order.
  at::Tensor forwardOnly(const at::Tensor& input);
  const PipelineLayout& layout() const { return layout_; }
  BlockModel& model() { return model_; }
  size_t firstBlock() const { return begin_; }
  size_t endBlock() const { return end_; }
  int microBatches() const { return microBatches_; }
  PipelineSchedule schedule() const { return schedule_; }
  const StageProgram& program() const { return program_; }

 private:
  struct InFlight;    // one micro-batch's tensors between its forward and its last backward
  struct WeightPass;  // zb-h1's W: the weight-only pass planned on a micro-batch's graph
  // Stage s's parameters that take gradients (the optimizer's), in block order.
  std::vector<at::Tensor> trainedParameters(int stage);
  // Stage s's parameters and float32 buffers, in a fixed order (for gatherParameters).
  std::vector<at::Tensor> stageTensors(int stage);
  // Stage s's parameters (every one, trained or not), in block order.
  std::vector<at::Tensor> stageParameters(int stage);
  // The tags of the exchanges between steps (rank `stage` to rank 0): slot 0 carries optimizer
  // state or a timeline's span count, slot 1 parameters or the spans. Never in flight together.
  int postStepTag(int slot, int stage) const;
  BlockModel model_;
  Communicator* comm_;
  PipelineLayout layout_;
  PipelineSchedule schedule_;
  size_t begin_, end_;
  int microBatches_;
  StageProgram program_;
  std::vector<size_t> boundaries_;
  // Every parameter's shape, per stage (stageParameters' order): other stages' are released.
  std::vector<std::vector<std::vector<int64_t>>> shapes_;
  int64_t forwardOnlyCalls_ = 0;  // forwardOnly's messages' tags
  // Parameters read by blocks of several stages: the stages (sorted; the first holds it in
  // its blocks, the others in tiedIn_).
  struct Tied {
    at::Tensor param;
    std::vector<int> stages;
  };
  std::vector<Tied> tied_;
  std::vector<std::vector<at::Tensor>> tiedIn_;  // by stage: tied parameters of others' blocks
};

}  // namespace caravan
