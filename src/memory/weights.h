// Out-of-core weights, gradients and optimizer state (ALGORITHMS.md §2.3, memory.weights =
// offload): each block's parameters and optimizer state live on a tier and come into memory
// only while the block is used.
//
// Layout: each block's storage on the tier is in pieces, each one blob (64-byte aligned
// members, one read and one write move it): the weights piece holds the block's parameters; the
// state pieces hold the optimizer state (momentum, Adam's moments) of consecutive runs of its
// parameters, at most WeightOptions::stateChunkBytes each (a parameter whose state is larger
// is a piece of its own), and each has its own optimizer over those parameters. Forward and
// backward read only the weights; the update streams the state pieces through memory one after
// the other. While a blob is in memory every member is a view of it (a parameter keeps its
// identity and trades storages with set_data, so the optimizer, autograd's accumulators and
// the sync strategy still point at it); out of memory every member is an empty tensor and the
// blob's bytes are on the tier.
//
// Per step (a piece is in memory while it is pinned; unpinned, a clean piece is dropped):
//   forward   block i's weights are fetched (waiting for their prefetch), those of
//             i+1..i+prefetch are prefetched, the block runs, and its weights are dropped
//             (clean: the tier copy is current). The last block stays, backward starts there.
//   backward  block i's weights are fetched when backward reaches it (the activation
//             executor's first unpack, or at the latest the pre-hook of a parameter's gradient
//             accumulator, since accumulating into an evicted parameter would use its empty
//             shape), blocks below are prefetched; saved views of weights (a linear layer saves
//             weight.t()) are rebuilt on the blob fetched back (memory/executor.cpp).
//   update    when the last gradient of block i is accumulated, its first state piece is
//             prefetched and the block is queued; once (in data-parallel runs) its all-reduce
//             has finished (GroupExchange::finishGroup), the updater thread steps each state
//             piece's optimizer (same options as the run's) in turn, the next piece read while
//             one is stepped and each written back after it, then drops the gradients and
//             writes the weights; written, they leave memory. This overlaps the backward of
//             blocks i-1..0 (KARMA's host update, ZeRO-Offload's CPU optimizer).
//   end       finishStep() (in place of optimizer.step()) updates blocks whose gradients never
//             completed (parameters without a gradient) and waits for every update.
// The window (WeightOptions, chosen against memory.budget: train/memory_setup.h): backward
// enters block i only when at most updateBacklog blocks above wait for or are in their update
// (so gradients do not pile up when the updater lags), and written pieces wait for their write
// at most maxWritesInFlight at a time; windowBytes() is the most this keeps in memory. The
// exception: a block above whose gradients never all arrive (a parameter unused this step)
// turns the backpressure off until finishStep(), and under all-reduce holds back the exchange
// (and so the updates) of every block below it, which then wait in memory.
// Block 0 finishes last and is needed first: it stays in memory, state included (no read at the
// start of the next forward). A parameter several blocks read (a tied embedding and head,
// BlockModel::sharedUses) is its owner's: the owner's weights are fetched and held while a
// block that reads it runs, and in that block's backward (the executor rebuilds a saved view of
// it on the owner's blob; its gradient accumulator's pre-hook fetches the owner); its gradient
// completes, and the owner's update starts, when its last use's backward is done. With gradient
// clipping the global norm needs every gradient, so updates wait for finishStep() (no overlap;
// every gradient is in memory then, and each block's weights are read again for its update).
//
// Per-parameter optimizers (SGD, AdamW) give the same result whether one optimizer steps all
// parameters or one per piece steps each piece's: training is bitwise the in-core run's (tests).
// Checkpoints and exports call withAllResident(): every piece comes into memory for the save
// (not counted in the tracker, so not against memory.budget: the cgroup of a budgeted run must
// allow for it) and the state goes through the run's optimizer, so the checkpoint format is the
// in-core one.
//
// Memory accounting: the weights, the optimizer state and the gradients in memory are added to
// and taken from the tracker as they appear and go.
//
// Threading: run(), finishStep() and withAllResident() on the training thread; acquire() and
// the accumulator hooks on autograd's threads; updates on the updater thread; I/O on the tier's.
// The store must go before the tier stops its threads (jobs submitted then would run inline,
// under the store's lock).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ATen/ATen.h>

#include "core/torch_fwd.h"
#include "memory/group_exchange.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "models/model.h"

namespace caravan {

// Each block's trainable parameters, in registration order (a strategy's per-block groups).
std::vector<std::vector<at::Tensor>> blockParameters(BlockModel& model);

// The window: how much of the model the store may hold in memory at once (windowBytes()).
struct WeightOptions {
  int prefetch = 1;                 // blocks' weights fetched ahead (forward) / below (backward)
  bool overlapUpdates = true;       // update blocks during backward (false with clipping)
  int updateBacklog = 1;            // blocks above waiting for or in their update when backward
                                    // enters a block, at most (0: each update before the next
                                    // block's backward)
  int maxWritesInFlight = 2;        // pieces waiting for their write, at most
  int64_t stateChunkBytes = 8 << 20;  // a state piece's bytes, at most (but one parameter's)
  // Optimizer state per weight byte (AdamW 2, SGD with momentum 1), for windowBytes() and the
  // state pieces' sizes before the first step.
  int stateFactor = 0;
};

// What OutOfCoreWeights holds in memory at most, by tracker category: weights, optimizer
// state, gradients; `total` bounds their sum (fewer pieces are written at once than the
// categories' bounds allow together).
struct WeightWindow {
  int64_t weights = 0, state = 0, gradients = 0, total = 0;
};

// The state pieces of a block with these parameters: consecutive runs of parameter indices
// whose state (stateFactor bytes per weight byte) is at most stateChunkBytes, or one parameter.
std::vector<std::vector<size_t>> statePieces(const std::vector<at::Tensor>& params,
                                             const WeightOptions& options);
// Each of those pieces' state bytes (stateFactor bytes per weight byte).
std::vector<int64_t> statePieceBytes(const std::vector<at::Tensor>& params,
                                     const WeightOptions& options);

struct WeightStats {
  int64_t bytesRead = 0, bytesWritten = 0;
  double updateSeconds = 0.0;  // optimizer steps on the updater thread
  double stallSeconds = 0.0;   // the training/autograd thread waiting for a block's blob
};

class OutOfCoreWeights final : public BlockRunner {
 public:
  using OptimizerFactory =
      std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

  // Moves every block but block 0 to `tier` (written, then dropped). The optimizer state in
  // `optimizer` (a resumed run's) moves into per-block optimizers made by `make`; `optimizer`
  // keeps the learning rate (set it there each step) and is otherwise empty. Installs itself as
  // the model's runner around the current one (the activation executor), until destroyed.
  // `exchange` (nullptr: one process; in a job, the sync strategy) exchanges each block's
  // gradients before its update; its parameter groups must be blockParameters(model).
  OutOfCoreWeights(BlockModel model, torch::optim::Optimizer& optimizer,
                   const OptimizerFactory& make, Tier& tier, MemoryTracker* tracker,
                   GroupExchange* exchange, WeightOptions options);
  ~OutOfCoreWeights() override;
  OutOfCoreWeights(const OutOfCoreWeights&) = delete;
  OutOfCoreWeights& operator=(const OutOfCoreWeights&) = delete;

  torch::Tensor run(size_t index, torch::nn::AnyModule& block, torch::Tensor x) override;

  // The block whose blob `s` is (-1: none), for saved views of weights.
  int blockOf(const c10::StorageImpl* s) const;
  // Backward needs block i: fetched (waiting), kept in memory until its update; returns the
  // blob. Queues the prefetch of the blocks below.
  at::Storage acquire(size_t block);
  // The blocks whose weights block `block` reads besides its own (a tied weight's owner):
  // acquired with it in backward, where a recomputation runs its forward again.
  const std::vector<size_t>& alsoReads(size_t block) const;
  void prefetch(size_t block);
  // In place of optimizer.step(): updates what the gradients did not trigger, waits for every
  // update. Throws what an update or I/O threw.
  void finishStep();
  // Every block in memory and the optimizer state in the run's optimizer while `fn` runs.
  void withAllResident(const std::function<void()>& fn);

  size_t numBlocks() const { return blocks_.size(); }
  WeightStats takeStats();

  // What the weights need in memory at most, for the budget: before the store exists, from the
  // model and the options. Block 0 (weights and state), and of the largest other block: the
  // weights of the block in use, its prefetches and the blocks waiting for or in their update
  // (2 + prefetch + updateBacklog), the pieces being written (maxWritesInFlight), the state
  // pieces of the update and the queued ones (2 + updateBacklog); gradients of 2 + updateBacklog
  // blocks (all of them with clipping).
  static int64_t windowBytes(BlockModel& model, const WeightOptions& options);
  static WeightWindow window(BlockModel& model, const WeightOptions& options);

  struct Piece;
  struct Block;

 private:
  // All under mutex_.
  void buildLayout(Piece& p);  // the blob from the members in memory
  void attachViews(Piece& p, const at::Storage& blob);
  void evictLocked(Piece& p);
  void uncount(Piece& p);  // its blob leaves the tracker
  // Pins the piece and waits until it is in memory; returns the seconds waited.
  double fetchLocked(Piece& p, std::unique_lock<std::mutex>& lock);
  void startReadLocked(Piece& p);
  void startReadLocked(size_t block);  // the block's weights
  void unpinLocked(Piece& p);
  // Drops the blob when nothing needs it in memory and the tier copy is current.
  void evictIfUnusedLocked(Piece& p);
  void writeLocked(Piece& p, std::unique_lock<std::mutex>& lock);
  void update(size_t i);
  void updaterLoop();
  void queueUpdateLocked(size_t i);
  void onGradient(size_t block, int64_t bytes);
  void checkLocked() const;
  void beginStepLocked();

  BlockModel model_;
  torch::optim::Optimizer& optimizer_;
  Tier& tier_;
  MemoryTracker* tracker_;
  GroupExchange* exchange_;
  WeightOptions options_;
  BlockRunner* inner_;
  std::vector<std::unique_ptr<Block>> blocks_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::unordered_map<const c10::StorageImpl*, size_t> blobOwner_;
  std::deque<size_t> updates_;
  size_t updatesRunning_ = 0;
  int writesInFlight_ = 0;
  bool stop_ = false;
  bool gathering_ = false;  // withAllResident() is reading blocks in: not counted
  std::exception_ptr error_;
  WeightStats stats_;
  std::vector<c10::intrusive_ptr<torch::autograd::Node>> accumulators_;
  std::vector<uintptr_t> postKeys_;
  std::thread updater_;
};

}  // namespace caravan
