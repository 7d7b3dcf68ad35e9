// Sharded data parallelism (sync.shard; ZeRO stages 1-3, FSDP's flat parameters): the model
// state each data-parallel worker holds is split over the workers.
//
// Layout. The trainable parameters are held flat per *unit*: one unit per block (the block's
// own parameters, registration order), and one more for the parameters several blocks read (a
// tied embedding and head, BlockModel::sharedUses: one slice wherever it is used). A unit's
// flat buffer `full` has its parameters' elements back to back, padded with zeros to a multiple
// of the W workers; rank r owns the contiguous slice [r S, (r+1) S), S = padded / W. Every
// model parameter is a view of its unit's `full` (set_data: the parameter keeps its identity,
// so autograd's accumulators and the optimizer's keys stay).
//
// bf16 gathers (parameters, a block that runs in bf16: bf16GatheredParameters below). A unit
// then has two *groups*, each a flat buffer of its own padded to a multiple of W: the
// parameters gathered in bf16 (first), then the others (float32). Rank r's slice of the unit
// (shards()[unit], float32: the masters) is [its slice of the bf16 group | its slice of the
// float32 group]; the bf16 group's gather moves each rank's slice cast to bf16 (round to nearest
// even, autocast's cast), 2 bytes an element, and its parameters are bf16 views of the gathered
// bf16 buffer: autocast finds them in bf16 and computes with the bits it would have made. Their
// gradients arrive in bf16 and are copied (exactly) into the unit's float32 flat gradients,
// which are laid out rank-major ([rank 0's slice of each group][rank 1's]...), so one
// reduce-scatter gives each rank its slice. Without a bf16 group a unit is one float32 group:
// the layout above. The optimizer, the masters and their offload only see float32 slices.
//
// What each rank holds (float32, Psi parameters, AdamW):
//   optimizer   the whole `full` (4 Psi), the local gradients (4 Psi, autograd's .grad kept
//               in a flat buffer per unit), the optimizer state of its slices (8 Psi / W);
//   gradients   `full` (4 Psi), the averaged gradient of its slices (4 Psi / W), the state
//               (8 Psi / W); a unit's flat local gradients exist from its launch until a later
//               launch waits for its reduce-scatter (sync.bucket_mb's worth or two units', the
//               larger; parameters: one unit's);
//   parameters  its slices (4 Psi / W), their gradients and state (12 Psi / W); a unit's
//               `full` (2 bytes an element of a bf16 group) holds bytes only while a block
//               that reads it runs forward or backward
//               (gathered, then freed: its storage is emptied, so autograd's saved views of the
//               weights free their bytes too, and come back when it is gathered again). The
//               shared unit stays gathered.
//
// Per step:
//   forward     block i waits for its unit's gather (parameters: issued on demand, the next
//               block's prefetched), runs, and (parameters) frees the unit again unless it is
//               the last block's, which backward (or a model's own loss) needs first; the next
//               forward, or releaseGathered(), frees that one.
//   backward    a hook on block i's output runs before autograd enters the block: the units of
//               the blocks above are final by then (autograd finishes a later block's nodes and
//               accumulations first), so their reduce-scatters are launched there, in index
//               order: each unit's gradients copied into a flat buffer (zeros for a parameter
//               without one), the parameters' .grad dropped, a sum that finishGradients() scales
//               by 1/W, as the all-reduce of sync.shard = none does; (parameters) the unit's
//               `full` is freed. Then (parameters) block i's unit is gathered and the block
//               below's prefetched. What no hook launched (block 0's unit, the shared unit)
//               launches in finishGradients(). The launch points are the same on every rank
//               whatever gradients each rank's data gave.
//   update      the run's optimizer steps each slice with its averaged gradient (shards()).
//   after       (optimizer, gradients, and the shared unit) every updated slice is all-gathered
//               back into `full`, issued at once and waited for block by block by the next
//               forward, so the gather overlaps it.
//
// Equality with sync.shard = none: every element's gradient is the same sum over ranks scaled
// by the same 1/W where the backend sums every element in rank order (shm; gloo's ring sums
// chunk by chunk in ring order, so its rounding follows the layout), and the optimizers are
// elementwise, so the slices' updates are the whole tensors'. Gradient clipping sums the
// slices' squares and all-reduces the sum (rounding differs from clip_grad_norm_'s order).
//
// Collectives are issued in one order on every rank: gathers in forward order, the hooks'
// reduce-scatters and gathers in backward order, the after-update gathers in unit order. The
// blocks must be a chain for autograd (BlockModel's are: block i's output is block i+1's only
// input that carries a gradient); a gradient that arrives after its unit was launched is an
// internal error, never a silent loss. A
// forward outside training (evaluation) must run on every rank the same number of times: a
// rank without a batch calls idleForward() (the gathers a forward would make).
//
// Inside a pipeline stage (StageScope; train/pipeline_step.h) a step's program runs the forwards
// and backwards of several micro-batches interleaved, so there are no block boundaries to act
// at: the units are the stage's (its blocks', and one per parameter several blocks read, a tied
// one's slices then lining up on every stage that holds it), gathered all at once before the
// program (gatherAll) and held through it; the gradients accumulate in the parameters' .grad
// over the micro-batches, and finishGradients launches every unit's reduce-scatter after the
// program, averaging (ReduceOp::kAvg) as the replicas of an unsharded stage do. No runner, no
// hooks, no initial broadcast (every replica built or loaded the same model).
//
// Threading: the trainer's thread, and autograd's (the hooks); the communicator's ops are
// issued from one of them at a time (backward runs on the trainer's thread for CPU tensors).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "core/torch_fwd.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "models/model.h"
#include "sync/shard_groups.h"
#include "sync/sync_mode.h"

namespace caravan {

// The trainable parameters several blocks read (BlockModel::sharedUses, or registered in more
// than one block): the shared unit's. Every other trainable parameter is its block's unit's.
std::set<const c10::TensorImpl*> sharedParameters(BlockModel& model);

// The parameters sync.shard = parameters gathers in bf16: a trainable parameter of a bf16 block
// (model->bf16(i)), not shared, whose one use in a forward and loss of `sample` is autocast's
// cast to bf16 (in the autograd graph its accumulator's only consumer is a ToCopyBackward0 that
// makes bf16). One use: two casts' gradients are summed in float32 after their casts, which a
// bf16 parameter would sum in bf16. A parameter also read in float32 (a layer norm's weight, a
// bias of an op autocast leaves in float32) stays float32. Costs one forward of `sample` with
// autograd (its graph freed at once) when some block is bf16, none otherwise; the default
// generator and the buffers are as before it, and the model's runner is bypassed.
std::set<const c10::TensorImpl*> bf16GatheredParameters(BlockModel& model, const Batch& sample);
// The bytes a gather of `params` moves and holds (padding apart): 2 an element of those in
// `bf16Gathered`, 4 of the others. The memory plan and the simulator count gathers by it.
int64_t gatherBytes(const std::vector<at::Tensor>& params,
                    const std::set<const c10::TensorImpl*>& bf16Gathered);

class ShardedParameters final : public BlockRunner {
 public:
  // Flattens `model`'s trainable parameters into units (every rank passes the same model: same
  // shapes, and the same values, since they are built from seed.init or loaded from one
  // checkpoint; rank 0's are broadcast). `level` is not kNone. Installs itself as the model's
  // runner around the current one (the activation executor) until destroyed. `tracker` (may be
  // null) counts the weights and gradients held as they come and go.
  // `inFlightBytes` (gradients; sync.bucket_mb): the units' local gradients whose
  // reduce-scatters may be in flight at once, at least two units'; parameters keeps one unit's.
  // `bf16Gathered` (parameters only; bf16GatheredParameters): the parameters gathered in bf16.
  // `stage` (a pipeline stage's units; see the top): its blocks [begin, end) and the
  // parameters it trains (PipelineStage::parameters()); its units gather in float32 (a stage's
  // gradients accumulate over micro-batches in the parameters' own dtype).
  struct StageScope {
    size_t begin = 0, end = 0;
    std::vector<at::Tensor> params;
  };
  ShardedParameters(BlockModel model, std::shared_ptr<Communicator> comm, ShardLevel level,
                    MemoryTracker* tracker, int64_t inFlightBytes,
                    const std::set<const c10::TensorImpl*>& bf16Gathered = {},
                    std::optional<StageScope> stage = std::nullopt);
  ~ShardedParameters() override;
  ShardedParameters(const ShardedParameters&) = delete;
  ShardedParameters& operator=(const ShardedParameters&) = delete;

  torch::Tensor run(size_t index, torch::nn::AnyModule& block, torch::Tensor x) override;

  // This rank's slice of each unit (float32, contiguous), what the optimizer steps: after
  // finishGradients() each one's grad() is the slice's gradient averaged over the workers.
  const std::vector<at::Tensor>& shards() const { return shards_; }
  // Launches the units no block boundary launched (block 0's, the shared unit; a parameter
  // without a gradient contributes zeros), waits for every reduce-scatter and scales the
  // slices' gradients by 1/W.
  void finishGradients();
  // After the optimizer stepped the slices: the resident units' gathers are issued (the next
  // forward waits for them); a step whose update was skipped calls it too.
  void afterUpdate();
  // Forward with no batch (evaluation: this rank ran out while others have one): the gathers
  // and frees one forward makes, without computing.
  void idleForward();
  // Waits for every gather in flight (before anything reads the parameters outside a forward).
  void settle();
  // Frees what a forward kept gathered (its last block's unit) outside training (after an
  // evaluation). Local: no collective.
  void releaseGathered();
  // Each unit gathered into the model's parameters in turn while `fn(unit)` runs, then freed
  // again (parameters; the next unit's gather in flight meanwhile): no rank holds the whole
  // weights (model.pt, written a unit at a time). The units come in the order the model's
  // parameters first name them. The parameters gathered in bf16 are float32 while `fn` runs: a
  // unit with a bf16 group is gathered from the float32 masters (its slices). Every rank calls
  // it and takes part in each gather; `fn` may be empty (a rank that only takes part). When
  // `fn` throws, the remaining units are still gathered (without `fn`) and the exception is
  // rethrown after the last.
  void forEachUnitGathered(const std::function<void(size_t unit)>& fn);
  // This rank's slices of `whole`'s state installed in `sliced` (a resumed run's state, loaded
  // whole from the checkpoint, on any number of workers).
  void sliceOptimizerState(torch::optim::Optimizer& whole, torch::optim::Optimizer& sliced) const;

  // memory.weights = offload (ZeRO-Infinity; parameters only): from now on each gathered unit's
  // slice of the weights, its averaged gradient and its optimizer state in `sliced` (which steps
  // shards()) live on `tier` while not in use (memory/tier_piece.h): a slice is read back for
  // its unit's gathers (prefetched a unit ahead of the gather's own prefetch) and for its
  // update; the gradient is written once its reduce-scatter is done (scaled by 1/W and its
  // squared norm taken first) and read for the update; the state only for the update. The
  // shared unit's stay in memory. `tier` and `sliced` outlive this object.
  void offloadTo(Tier& tier, torch::optim::Optimizer& sliced);
  bool offloaded() const { return offloaded_; }
  // In place of sliced.step() when offloaded: each unit's slice stepped in turn (the last
  // block's first, so block 0's is still in memory when the next forward gathers it), with its
  // weights and state read back (the next unit's prefetched) and written again after its step.
  void stepOffloaded(torch::optim::Optimizer& sliced);
  // Multiplies this step's averaged gradients by `coefficient` (clipping): at once, or, for the
  // offloaded ones, when stepOffloaded has them in memory.
  void scaleGradients(double coefficient);
  // Each unit's slice (shards()[unit]) and its optimizer state in `sliced` in memory while
  // `fn(unit)` runs, one unit at a time in index order: offloaded, each read back from the tier
  // (the next unit's read ahead meanwhile) and let go unchanged after, so that no more than two
  // units' slices are in memory for it (a checkpoint's slice file). Local: no collective.
  void forEachSlice(const std::function<void(size_t unit)>& fn);

  // Sum over ranks of the slices' squared gradient norms (a collective): the global norm's
  // square. Non-finite gradients anywhere make it non-finite everywhere.
  double globalGradientNormSquared();

  // A pipeline stage's (StageScope) besides the above:
  // Every unit's weights whole in the model's parameters (gathers issued at once, then waited
  // for, the after-update gathers too): the program reads them all. Under parameters they stay
  // until finishGradients (or releaseGathered) frees them. Every rank calls it.
  void gatherAll();
  // This rank's share of the global squared gradient norm (no collective): its slices' squares,
  // leaving out those of `skip` (parameters that are units of their own: a stage's tied ones
  // that another stage counts).
  double localGradientNormSquared(const std::vector<at::Tensor>& skip);
  // This rank's slice of the averaged gradient of `param`, a unit of its own (a tied
  // parameter: the same elements on every stage that holds it), to be changed in place.
  at::Tensor gradientSlice(const at::Tensor& param) const;
  // The whole state of the slices (`sliced` steps shards()) in `whole` on rank `onRank` (whose
  // parameters are the model's), for a checkpoint: every other rank sends its slices' state
  // there (point to point, tags below the unit count). Every rank calls it.
  void gatherOptimizerState(torch::optim::Optimizer& sliced, torch::optim::Optimizer& whole,
                            int onRank) const;

  // Unit `unit` (shards()[unit]'s) as a sharded checkpoint records it: its parameters (the
  // model's, group after group), where each starts among the unit's elements (the groups back
  // to back, unpadded), its elements and padded size, and its groups (one: float32; two:
  // bf16-gathered, then float32) with what each one's gather moves.
  struct UnitLayout {
    std::vector<at::Tensor> params;
    std::vector<int64_t> offsets;
    int64_t numel = 0, padded = 0;
    std::vector<ShardGroup> groups;
    std::vector<at::ScalarType> dtypes;
  };
  UnitLayout unitLayout(size_t unit) const;
  // Unit `unit`'s parameters in the model's order (unitLayout's are in group order).
  std::vector<at::Tensor> unitParametersInModelOrder(size_t unit) const;

  ShardLevel level() const { return level_; }
  Communicator& comm() const { return *comm_; }

  struct Group;
  struct Unit;

 private:
  void layUnits(const std::set<const c10::TensorImpl*>& bf16Gathered);
  // Each parameter of unit `unit` a view of its group's `full` (set_data).
  void viewParameters(size_t unit);
  // The post hooks on the parameters' gradient accumulators (again after set_data to another
  // dtype, which gives a parameter a new accumulator).
  void hookAccumulators();
  // Unit `unit`'s float32 masters from every rank's slice, its elements back to back [numel]
  // (a collective).
  at::Tensor gatherMasters(size_t unit);
  // Bytes of unit `unit`'s gathered `full` buffers.
  int64_t gatheredBytes(size_t unit) const;
  void onGradReady(size_t unit);
  void launchReadyInOrder();
  // Waits for unit `unit`'s reduce-scatter (if in flight) and frees its local gradients.
  void finishReduce(size_t unit);
  void gather(size_t unit);  // issues its all-gather (allocating `full`) unless issued
  void waitGathered(size_t unit);
  void release(size_t unit);  // frees `full` (parameters; not the resident units)
  void beforeBackward(size_t block);
  // A forward's work around block `block` (and idleForward's without the block).
  void beginForward(size_t block);
  void endForward(size_t block);
  std::vector<at::Tensor> unitParameters(size_t unit) const;
  int64_t unitOfBlock(size_t block) const { return blockUnit_[block]; }
  // The nearest unit at or after (direction +1) / before (-1) block `block` that is not
  // resident, -1 if none.
  int64_t nextGatheredUnit(size_t block, int direction) const;
  size_t unitAlone(const at::Tensor& param) const;  // the unit that holds `param` alone

  BlockModel model_;
  std::shared_ptr<Communicator> comm_;
  ShardLevel level_;
  MemoryTracker* tracker_;
  std::optional<StageScope> stage_;
  BlockRunner* inner_ = nullptr;
  std::vector<std::unique_ptr<Unit>> units_;  // index order: the last block's first
  std::vector<int64_t> blockUnit_;            // -1: a block without its own trainable params
  int64_t sharedUnit_ = -1;
  std::vector<at::Tensor> params_;  // trainable, registration order
  std::vector<at::Tensor> shards_;
  size_t nextLaunch_ = 0;
  std::deque<size_t> inFlight_;  // launched units whose local gradients exist, oldest first
  int64_t inFlightBytes_ = 0, inFlightCap_ = 0;
  std::vector<size_t> unitsAbove_;  // per block: the units of the blocks above it (a prefix)
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> hookKeys_;
  // Offload (offloadTo): the tier, and the optimizer whose state the units' state pieces hold.
  Tier* tier_ = nullptr;
  torch::optim::Optimizer* sliced_ = nullptr;
  bool offloaded_ = false;
  double gradCoefficient_ = 1.0;     // scaleGradients' product this step, for offloaded gradients
  int64_t lastGradWrite_ = -1;       // the unit whose gradient was written last this step
  void prefetchSlice(int64_t unit);  // the tier read of a unit's slice (-1: none)
};

}  // namespace caravan
