// Deterministic epoch permutations (independent of the standard library and LibTorch), and a
// loader that prefetches batches on one background thread in exactly the sampler's order.
#include <algorithm>
#include <random>
#include <utility>

#include "core/errors.h"
#include "data/loader.h"

namespace caravan {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Uniform in [0, bound) by rejection; std::uniform_int_distribution differs between libraries.
uint64_t uniformBelow(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x;
  do {
    x = rng();
  } while (x >= limit);
  return x % bound;
}

int64_t shardSize(const SamplerOptions& o) { return o.datasetSize / o.worldSize; }

int64_t countBatches(const SamplerOptions& o) {
  const int64_t n = shardSize(o);
  return o.dropLast ? n / o.batchSize : (n + o.batchSize - 1) / o.batchSize;
}

// Checks the options and maps worldSize 0 to 1.
SamplerOptions normalized(SamplerOptions o) {
  if (o.worldSize <= 1) o.worldSize = 1;
  if (o.datasetSize < 1) throw ConfigError("the dataset is empty; check data.path");
  if (o.batchSize < 1) {
    throw ConfigError(fmt::format("batch size must be at least 1, got {}", o.batchSize));
  }
  if (o.rank < 0 || o.rank >= o.worldSize) {
    throw ConfigError(fmt::format("rank {} is outside 0..{}", o.rank, o.worldSize - 1));
  }
  if (countBatches(o) < 1) {
    if (o.worldSize > 1) {
      throw ConfigError(fmt::format(
          "batch size {} is larger than a rank's share of the dataset ({} examples / {} ranks = "
          "{}); lower data.batch_size",
          o.batchSize, o.datasetSize, o.worldSize, shardSize(o)));
    }
    throw ConfigError(fmt::format(
        "batch size {} is larger than the dataset ({} examples); lower data.batch_size",
        o.batchSize, o.datasetSize));
  }
  return o;
}

}  // namespace

SamplerPosition reshardPosition(SamplerPosition saved, int64_t savedGlobal, int64_t global,
                                int64_t batchesPerEpoch) {
  CARAVAN_CHECK(savedGlobal > 0 && global > 0 && batchesPerEpoch > 0, "reshard {} -> {}",
                savedGlobal, global);
  const int64_t samples = saved.batchInEpoch * savedGlobal;
  SamplerPosition p{saved.epoch, (samples + global - 1) / global};
  if (p.batchInEpoch >= batchesPerEpoch) p = SamplerPosition{saved.epoch + 1, 0};
  return p;
}

Sampler::Sampler(SamplerOptions options) : options_(normalized(options)) {}

int64_t Sampler::batchesPerEpoch() const { return countBatches(options_); }

void Sampler::setPosition(SamplerPosition position) {
  const int64_t batches = batchesPerEpoch();
  if (position.epoch < 0 || position.batchInEpoch < 0 || position.batchInEpoch >= batches) {
    throw ConfigError(fmt::format(
        "data position epoch {} batch {} is outside an epoch of {} batches (did the batch size, "
        "dataset or number of ranks change since the checkpoint?)",
        position.epoch, position.batchInEpoch, batches));
  }
  position_ = position;
}

void Sampler::buildOrder() {
  const int64_t n = options_.datasetSize;
  std::vector<int64_t> permutation(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) permutation[i] = i;
  if (options_.shuffle) {
    std::mt19937_64 rng(
        splitmix64(splitmix64(options_.seed) ^ static_cast<uint64_t>(position_.epoch)));
    for (int64_t i = n - 1; i > 0; --i) {
      const auto j = static_cast<int64_t>(uniformBelow(rng, static_cast<uint64_t>(i + 1)));
      std::swap(permutation[i], permutation[j]);
    }
  }
  // Rank r takes permutation[r], permutation[r + W], ...: disjoint shards of equal length.
  const int64_t shard = shardSize(options_);
  const int64_t stride = options_.worldSize;
  order_.resize(static_cast<size_t>(shard));
  for (int64_t j = 0; j < shard; ++j) order_[j] = permutation[j * stride + options_.rank];
  orderEpoch_ = position_.epoch;
}

std::vector<int64_t> Sampler::next() {
  if (orderEpoch_ != position_.epoch) buildOrder();
  const int64_t shard = static_cast<int64_t>(order_.size());
  const int64_t begin = position_.batchInEpoch * options_.batchSize;
  const int64_t end = std::min(begin + options_.batchSize, shard);
  std::vector<int64_t> indices(order_.begin() + begin, order_.begin() + end);
  if (++position_.batchInEpoch == batchesPerEpoch()) {
    ++position_.epoch;
    position_.batchInEpoch = 0;
  }
  return indices;
}

Loader::Loader(std::shared_ptr<const Dataset> dataset, SamplerOptions options, int64_t prefetch)
    : dataset_(std::move(dataset)), options_(options), prefetch_(prefetch), batchesPerEpoch_(0) {
  CARAVAN_CHECK(dataset_ != nullptr, "loader needs a dataset");
  if (options_.datasetSize == 0) options_.datasetSize = dataset_->size();
  CARAVAN_CHECK_EQ(options_.datasetSize, dataset_->size(), "sampler size vs dataset size");
  if (prefetch_ < 1) {
    throw ConfigError(fmt::format("data.prefetch must be at least 1 batch, got {}", prefetch_));
  }
  batchesPerEpoch_ = Sampler(options_).batchesPerEpoch();
  start(SamplerPosition{});
}

Loader::~Loader() { stop(); }

LoadedBatch Loader::next() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [this] { return !queue_.empty() || error_ != nullptr; });
  // Batches made before a failure are still delivered, so the order stays deterministic.
  if (!queue_.empty()) {
    LoadedBatch loaded = std::move(queue_.front());
    queue_.pop_front();
    cv_.notify_all();
    return loaded;
  }
  std::rethrow_exception(error_);
}

void Loader::seek(SamplerPosition position) {
  Sampler(options_).setPosition(position);  // validate first: a bad position keeps the old stream
  stop();
  start(position);
}

void Loader::start(SamplerPosition position) {
  sampler_ = std::make_unique<Sampler>(options_);
  sampler_->setPosition(position);
  thread_ = std::thread(&Loader::run, this);
}

void Loader::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.clear();
  error_ = nullptr;
  stopping_ = false;
}

void Loader::run() {
  try {
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] {
          return stopping_ || static_cast<int64_t>(queue_.size()) < prefetch_;
        });
        if (stopping_) return;
      }
      // Only this thread touches sampler_ while it runs.
      LoadedBatch loaded;
      loaded.position = sampler_->position();
      loaded.indices = sampler_->next();
      loaded.batch = dataset_->getForEpoch(loaded.indices, loaded.position.epoch);
      std::lock_guard<std::mutex> lock(mutex_);
      if (stopping_) return;
      queue_.push_back(std::move(loaded));
      cv_.notify_all();
    }
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

std::vector<std::vector<int64_t>> sequentialBatches(int64_t datasetSize, int64_t batchSize) {
  if (batchSize < 1) {
    throw ConfigError(fmt::format("batch size must be at least 1, got {}", batchSize));
  }
  std::vector<std::vector<int64_t>> batches;
  for (int64_t begin = 0; begin < datasetSize; begin += batchSize) {
    std::vector<int64_t> batch;
    for (int64_t i = begin; i < std::min(begin + batchSize, datasetSize); ++i) batch.push_back(i);
    batches.push_back(std::move(batch));
  }
  return batches;
}

}  // namespace caravan
