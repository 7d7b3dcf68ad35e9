// The planner (KARMA's performance model, ALGORITHMS.md §2.2): from each block's measured
// forward and backward time and the bytes it saves, and the tier's measured bandwidths, it
// predicts a policy assignment's step time and activation peak, and picks the assignment with
// the smallest predicted time whose peak fits the budget.
//
// The model. Three engines run at once: compute, tier writes and tier reads (one queue each,
// FIFO). Forward: block i computes F_i; swap queues A_i bytes (what it saves) when it ends,
// swap-input queues X_i (its input) when it starts (as the tier stores them: memory.tier_dtype).
// Backward, last block first: when block i's backward starts, the reads of the `prefetch` blocks
// below it are queued (those of the last blocks when forward ends); a read starts when its write is
// done and the reader is free, and one queued before its write started cancels both (the bytes
// never left). Block i's backward starts when the previous one ended and its read (if any) is done,
// and takes B_i, plus F_i if it recomputes. Live activation bytes, in the tracker's terms (saved
// tensors, not transient outputs): after each block's forward, Σ of what earlier blocks hold (keep
// A, recompute X, swap/swap-input their bytes until written); during block i's backward, what
// blocks below i hold, plus A_i rematerialized, plus the reads already queued.
//
// The search: greedy from all-keep (change the block whose move frees the most peak bytes per
// second added until the plan fits), then hill-climbing over single-block changes from that
// plan and from each uniform plan that fits; the fastest plan found wins. Uniform plans are
// candidates, so the plan is never predicted slower than the best single policy.
//
// Threading: profileModel runs forward/backward on the calling thread; the rest is pure.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "data/dataset.h"
#include "memory/executor.h"
#include "memory/tier.h"
#include "models/model.h"

namespace caravan {

struct BlockProfile {
  std::string label;
  double forwardSeconds = 0.0;
  double backwardSeconds = 0.0;
  int64_t inputBytes = 0;  // X: the block's input storage
  int64_t savedBytes = 0;  // A: what its forward saves for backward (parameters excluded)
  // The parts of X and A in float32 storages: what memory.tier_dtype = bf16 stores at half.
  int64_t inputFloat32Bytes = 0;
  int64_t savedFloat32Bytes = 0;
};

struct ModelProfile {
  std::vector<BlockProfile> blocks;
  double lossSeconds = 0.0;  // the loss's forward and backward, outside the blocks
  // What the loss saves for backward (cross-entropy's log-probabilities): held from its
  // forward, after the last block's, to its backward, before the last block's.
  int64_t lossSavedBytes = 0;
  // How swapped activations are stored (memory.tier_dtype): the tier's reads and writes of a
  // swap or swap-input block move its float32 bytes at half as bf16; memory is unchanged.
  TierDtype activationsOnTier = TierDtype::kAsIs;
};

// Profiles each block in isolation on this batch: forward with grad on its (detached) input,
// backward from a random output gradient; medians over `repeats` after one warm-up (0: one
// pass, sizes only, every time 0). Runs
// without the model's runner; gradients it creates are removed, existing ones zeroed.
ModelProfile profileModel(BlockModel& model, const Batch& batch, int repeats);

// Out-of-core weights (memory.weights = offload, memory/weights.h) as the model sees them. Per
// block: the weights read before its forward and again before its backward (prefetched
// `prefetch` blocks ahead, on the reader the activations use; 0 bytes for a block kept in
// memory), and the update once its gradients are in: the optimizer state's pieces read one
// after the other (each while the previous is stepped), the optimizer's seconds shared out by
// bytes, each piece written after its step (on the writer the activations' swaps use; the
// updater waits while `writesInFlight` pieces are in flight), then the weights written.
// Updates run one at a time on their own thread. `overlap` (no clipping): updates run during
// backward, which enters block i only when the updates of blocks above i + updateBacklog are
// done; else every update runs after backward, the weights read again. `updaterSharesCore`:
// the updater has no core of its own (workers x threads >= cores), so the time its steps
// overlap backward's compute is added to the training thread's.
struct WeightTraffic {
  std::vector<int64_t> weightBytes;
  std::vector<std::vector<int64_t>> statePieces;  // bytes of each state piece
  std::vector<double> updateSeconds;
  int prefetch = 1;
  bool overlap = true;
  int updateBacklog = 1;
  int writesInFlight = 2;
  bool updaterSharesCore = false;
};

struct Prediction {
  double stepSeconds = 0.0;      // forward + loss + backward
  double forwardSeconds = 0.0;
  double updatesEndSeconds = 0.0;  // out-of-core weights: the last update's end (else 0)
  int64_t peakBytes = 0;         // activation bytes (tracked saved tensors)
};

// `weights`: nullptr when they stay in memory. `activationLimit` > 0: the executor's write
// backpressure (ActivationExecutor::setActivationLimit, which planned runs and fixed policies
// under memory.budget get): before block i's forward, when the activations held (offloaded
// bytes until their write ends) plus block i's saves exceed the limit, forward waits until
// every queued write has ended. A tier slower than forward then costs time instead of memory.
Prediction predict(const ModelProfile& profile, const std::vector<BlockPolicy>& policies,
                   const TierBandwidth& bandwidth, int prefetchDepth,
                   const WeightTraffic* weights = nullptr, int64_t activationLimit = 0);

// predict's model, in its phases (each testable alone). Times are seconds from the step's
// start, sizes bytes. predict runs runForward, runBackward and finish, once each and in that
// order; each phase reads the timeline the earlier ones left (the tier's writer and reader are
// shared, so their bookings must come in this order). The profile and weights must outlive it.
class StepPredictor {
 public:
  StepPredictor(const ModelProfile& profile, const std::vector<BlockPolicy>& policies,
                const TierBandwidth& bandwidth, int prefetchDepth,
                const WeightTraffic* weights = nullptr, int64_t activationLimit = 0);

  // Forward, block 0 first: block i waits for its weights (read `weights->prefetch` blocks
  // ahead) and, over the activation limit, for every queued write; computes F_i; queues its
  // write (swap: A_i as stored, when it ends; swap-input: X_i, when it starts). Returns when
  // the last block's forward ends.
  double runForward();
  // The activation peak during forward (after runForward): after each block's forward, what
  // it and the blocks before it hold (offloaded bytes until their write ends; a swap block its
  // whole saves), and after the last block's, the loss's saves as well.
  int64_t forwardPeakBytes() const;
  // Backward, last block first (after runForward), starting after the loss: each block starts
  // (startBackward), its live bytes join the backward peak (backwardLiveBytes), it computes B_i
  // (plus F_i if it recomputes or swaps its input), then, out-of-core with overlap, its update
  // runs (runUpdate). Returns when block 0's backward ends.
  double runBackward();
  // When block i's backward starts, its previous block's having ended at `previousEnd`: after
  // the updates above i + updateBacklog (overlapped), its weights' read and its activations'
  // read (queued now if not prefetched); then the reads of the `prefetchDepth` blocks below
  // are queued (one queued before its write started is cancelled: the bytes never left).
  double startBackward(size_t block, double previousEnd);
  // What is live while block i runs backward from `start`: its saves rematerialized (and its
  // input while it recomputes), what keep and recompute blocks below hold, and the offloaded
  // bytes below that are in memory again (read queued, cancelled) or not yet written.
  int64_t backwardLiveBytes(size_t block, double start) const;
  int64_t backwardPeakBytes() const { return backwardPeak_; }  // the largest of those so far
  // Out-of-core weights: block i's update, its gradients in at `ready` (see WeightTraffic).
  // Returns when the block's update is done (its last piece's write queued); the updater
  // moves on once the weights' write is queued too.
  double runUpdate(size_t block, double ready);
  // The updates that wait for the end of backward (no overlap: clipping), top block first.
  void runUpdatesAfterBackward();
  // The seconds the updater's steps overlap backward's compute: what it takes from the
  // training thread when it has no core of its own (updaterSharesCore), else 0.
  double updaterSharedSeconds() const;
  // The prediction (after runBackward): the updates left run, the shared seconds added.
  Prediction finish();

  // The timeline so far. A block without a write: writeStart +inf, writeEnd -inf; readEnd
  // -inf until its read is queued (a cancelled read: when it was queued); updateEnd -inf
  // until its update ran.
  double forwardEnd(size_t block) const { return forwardEnd_[block]; }
  double writeStart(size_t block) const { return writeStart_[block]; }
  double writeEnd(size_t block) const { return writeEnd_[block]; }
  double readEnd(size_t block) const { return readEnd_[block]; }
  bool readCancelled(size_t block) const { return cancelled_[block]; }
  double updateEnd(size_t block) const { return updateEnd_[block]; }

 private:
  int64_t offloaded(size_t block) const;     // bytes the block sends to the tier
  int64_t stored(size_t block) const;        // what the tier stores of them
  int64_t heldInMemory(size_t block) const;  // bytes a keep or recompute block holds
  bool recomputes(size_t block) const;       // recompute and swap-input rerun the forward
  int64_t residentAt(size_t block, double when) const;
  void queueWrite(size_t block, double start, double end);
  double bookRead(double issue, int64_t bytes);
  void readWeights(size_t block, double when);
  void prefetchWeightsForBackward();
  void issueReads(size_t above, double when);
  double writePiece(int64_t bytes, double when);

  const ModelProfile& profile_;
  const std::vector<BlockPolicy> policies_;
  const WeightTraffic* weights_;  // nullptr: the weights stay in memory
  const size_t blockCount_;
  const int prefetchDepth_;
  const int64_t activationLimit_;
  const double writeBytesPerSecond_;  // without a measured bandwidth 1e-9: a transfer never ends
  const double readBytesPerSecond_;
  const int weightPrefetch_;
  const bool overlap_;  // updates run during backward

  // The reader's booked intervals, in time order (bookRead).
  std::vector<std::pair<double, double>> readerBusy_;
  double writerFree_ = 0.0;  // when the writer has written everything queued
  std::vector<double> weightsRead_;
  std::vector<bool> weightsIssued_;
  std::vector<double> forwardEnd_, writeStart_, writeEnd_;
  double forwardSeconds_ = 0.0;
  std::vector<double> readEnd_;
  std::vector<bool> issued_, cancelled_;
  int64_t backwardPeak_ = 0;
  double backwardEnd_ = 0.0;
  std::vector<double> updateEnd_;
  double updaterFree_ = 0.0;
  // The end times of the state pieces and weights written, in order.
  std::vector<double> pieceWrites_;
  // The optimizer's steps and backward's compute, as intervals (updaterSharedSeconds).
  std::vector<std::pair<double, double>> steps_, computing_;
};

struct Plan {
  std::vector<BlockPolicy> policies;
  Prediction prediction;
  bool fits = false;  // prediction.peakBytes <= the activation budget
};

// `activationBudget` <= 0: no limit (all keep). Without a fitting plan, returns the plan with
// the smallest predicted peak (fits = false).
// `writeLimit` > 0: the activation limit the run's executor will apply (predict's
// `activationLimit`); the plans are predicted with it, and fit when their peak is at most
// `activationBudget` (which may be set below it, as a margin).
Plan planPolicies(const ModelProfile& profile, const TierBandwidth& bandwidth,
                  int64_t activationBudget, int prefetchDepth,
                  const WeightTraffic* weights = nullptr, int64_t writeLimit = 0);

// A planned run aims its activations at this share of what the budget leaves them (the model
// does not see threads scheduled late on a busy machine), and drains its writes there.
inline constexpr double kPlanMargin = 0.95;
// What the budget leaves a planned run's activations: kPlanMargin x (budget - persistent), at
// least one byte. And the smallest budget under which a plan of `peakBytes` fits beside
// `persistent` bytes (the inverse).
int64_t plannedActivationBudget(int64_t budget, int64_t persistent);
int64_t budgetForPlannedPeak(int64_t peakBytes, int64_t persistent);

// The per-block table `caravan plan` prints.
std::string formatPlan(const ModelProfile& profile, const Plan& plan,
                       const TierBandwidth& bandwidth, int prefetchDepth);

}  // namespace caravan
