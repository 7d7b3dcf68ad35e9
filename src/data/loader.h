// Deterministic shuffling sampler and a loader that assembles the next batch on a
// background thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "data/dataset.h"

namespace caravan {

struct SamplerOptions {
  int64_t datasetSize = 0;
  int64_t batchSize = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  bool dropLast = true;  // drop the incomplete last batch of an epoch
  int64_t rank = 0;      // data-parallel shard (later issues); 0/1 = the whole dataset
  int64_t worldSize = 1;
};

// Where a sampler is: the epoch and the number of batches already taken in it. This is the
// whole sampler state: it goes into checkpoints and restores the exact data order.
struct SamplerPosition {
  int64_t epoch = 0;
  int64_t batchInEpoch = 0;
  bool operator==(const SamplerPosition& o) const {
    return epoch == o.epoch && batchInEpoch == o.batchInEpoch;
  }
};

// Resuming on another number of workers or batch size (resharding). A step of W workers with
// batch b takes the permutation's next W*b entries (rank r takes every W-th), so a position is
// a count of samples into the epoch. Returns the position of a job taking `global` samples per
// step whose first batch holds no sample taken before `saved` (a job taking `savedGlobal` per
// step): the same epoch, batch ceil(samples / global), or the next epoch's start when that
// is past `batchesPerEpoch`. Up to global - 1 samples of the epoch are skipped when the counts
// do not divide.
SamplerPosition reshardPosition(SamplerPosition saved, int64_t savedGlobal, int64_t global,
                                int64_t batchesPerEpoch);

// Epoch e's order is a permutation drawn from a generator seeded with (seed, e), independent
// of any global RNG and of LibTorch's version. Not thread-safe: one owner.
class Sampler {
 public:
  explicit Sampler(SamplerOptions options);
  int64_t batchesPerEpoch() const;
  SamplerPosition position() const { return position_; }
  void setPosition(SamplerPosition position);
  // Indices of the next batch; advances the position (rolling over to the next epoch).
  std::vector<int64_t> next();

 private:
  void buildOrder();
  SamplerOptions options_;
  SamplerPosition position_;
  std::vector<int64_t> order_;  // this epoch's (shard's) order
  int64_t orderEpoch_ = -1;
};

struct LoadedBatch {
  Batch batch;
  SamplerPosition position;      // the sampler position *before* this batch was drawn
  std::vector<int64_t> indices;  // the dataset's examples in the batch
};

// Owns a Sampler; a background thread keeps up to `prefetch` batches ready. `next()` is called
// from one thread (the trainer). Exceptions in the background thread are rethrown by next().
class Loader {
 public:
  Loader(std::shared_ptr<const Dataset> dataset, SamplerOptions options, int64_t prefetch = 2);
  ~Loader();
  Loader(const Loader&) = delete;
  Loader& operator=(const Loader&) = delete;

  LoadedBatch next();
  int64_t batchesPerEpoch() const { return batchesPerEpoch_; }
  // Restarts the background thread from `position` (discarding prefetched batches).
  void seek(SamplerPosition position);

 private:
  void start(SamplerPosition position);
  void stop();
  void run();

  std::shared_ptr<const Dataset> dataset_;
  SamplerOptions options_;
  int64_t prefetch_;
  int64_t batchesPerEpoch_;
  std::unique_ptr<Sampler> sampler_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<LoadedBatch> queue_;
  std::exception_ptr error_;
  bool stopping_ = false;
};

// Iterates a dataset once in order (no shuffle, keeps the last partial batch); for evaluation.
std::vector<std::vector<int64_t>> sequentialBatches(int64_t datasetSize, int64_t batchSize);

}  // namespace caravan
