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
// What each rank holds (float32, Psi parameters, AdamW):
//   optimizer   the whole `full` (4 Psi), the local gradients (4 Psi, autograd's .grad kept
//               in a flat buffer per unit), the optimizer state of its slices (8 Psi / W);
//   gradients   `full` (4 Psi), the averaged gradient of its slices (4 Psi / W), the state
//               (8 Psi / W); a unit's flat local gradients exist from its launch until a later
//               launch waits for its reduce-scatter (sync.bucket_mb's worth or two units', the
//               larger; parameters: one unit's);
//   parameters  its slices (4 Psi / W), their gradients and state (12 Psi / W); a unit's
//               `full` holds bytes only while a block that reads it runs forward or backward
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
// Threading: the trainer's thread, and autograd's (the hooks); the communicator's ops are
// issued from one of them at a time (backward runs on the trainer's thread for CPU tensors).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
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
#include "sync/sync_mode.h"

namespace caravan {

// The trainable parameters several blocks read (BlockModel::sharedUses, or registered in more
// than one block): the shared unit's. Every other trainable parameter is its block's unit's.
std::set<const c10::TensorImpl*> sharedParameters(BlockModel& model);

class ShardedParameters final : public BlockRunner {
 public:
  // Flattens `model`'s trainable parameters into units (every rank passes the same model: same
  // shapes, and the same values, since they are built from seed.init or loaded from one
  // checkpoint; rank 0's are broadcast). `level` is not kNone. Installs itself as the model's
  // runner around the current one (the activation executor) until destroyed. `tracker` (may be
  // null) counts the weights and gradients held as they come and go.
  // `inFlightBytes` (gradients; sync.bucket_mb): the units' local gradients whose
  // reduce-scatters may be in flight at once, at least two units'; parameters keeps one unit's.
  ShardedParameters(BlockModel model, std::shared_ptr<Communicator> comm, ShardLevel level,
                    MemoryTracker* tracker, int64_t inFlightBytes);
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
  // parameters first name them. Every rank calls it and takes part in each gather; `fn` may be
  // empty (a rank that only takes part). When `fn` throws, the remaining units are still
  // gathered (without `fn`) and the exception is rethrown after the last.
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

  // Unit `unit` (shards()[unit]'s) as a sharded checkpoint records it: its parameters (the
  // model's), where each starts in the flat buffer, its elements and padded size.
  struct UnitLayout {
    std::vector<at::Tensor> params;
    std::vector<int64_t> offsets;
    int64_t numel = 0, padded = 0;
  };
  UnitLayout unitLayout(size_t unit) const;

  ShardLevel level() const { return level_; }
  Communicator& comm() const { return *comm_; }

  struct Unit;

 private:
  void layUnits();
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

  BlockModel model_;
  std::shared_ptr<Communicator> comm_;
  ShardLevel level_;
  MemoryTracker* tracker_;
  BlockRunner* inner_;
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
