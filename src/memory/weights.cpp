// Out-of-core weights, gradients and optimizer state (see weights.h).
#include "memory/weights.h"

#include <algorithm>
#include <chrono>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/optim/optimizer.h>

#include "core/clock.h"
#include "core/errors.h"
#include "core/scope_guard.h"
#include "memory/accounting.h"
#include "memory/host_allocator.h"
#include "optim/fused.h"

namespace caravan {

using Clock = std::chrono::steady_clock;

namespace {

constexpr int64_t kAlign = 64;

int64_t alignUp(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// The optimizer state tensors of one parameter (none before its first step).
std::vector<at::Tensor> stateTensors(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto it = opt.state().find(optimizerStateKey(p));
  if (it == opt.state().end()) return {};
  return optimizerStateTensors(*it->second);
}

at::Tensor viewOf(const at::Storage& s, int64_t offsetBytes, at::ScalarType dtype,
                  const std::vector<int64_t>& sizes) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(s, offsetBytes / elem, sizes);
}

}  // namespace

struct OutOfCoreWeights::Block {
  struct Member {
    at::Tensor tensor;  // the parameter or state tensor itself (set_data moves it)
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::kFloat;
    int64_t offset = 0;  // bytes into the blob
    bool parameter = false;
  };
  size_t index = 0;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::vector<Member> members;
  int64_t bytes = 0, paramBytes = 0, stateBytes = 0;
  // Where the block's bytes are. kOnTier -> kReading -> kClean (read in); kClean -> kOnTier
  // (evicted when nothing pins it); an update makes it kDirty -> kWriting -> kClean.
  enum class Copy {
    kOnTier,   // not in memory; the tier copy is current
    kReading,  // a read is in flight
    kDirty,    // in memory; the tier copy is stale (or there is none yet)
    kWriting,  // in memory; a write of this blob is in flight
    kClean,    // in memory; the tier copy equals it
  };
  // This step's update. kAwaitingGradients -> kQueued (every gradient in, or finishStep) ->
  // kDone; a block without parameters is kDone from the start of the step.
  enum class Update { kAwaitingGradients, kQueued, kDone };

  at::Storage blob;  // defined while in memory (kDirty, kWriting, kClean)
  int64_t slot = -1;
  Copy copy = Copy::kDirty;
  Update update = Update::kDone;
  bool keep = false;         // block 0: always in memory
  int pins = 0;              // forward, updates, withAllResident
  bool backwardPin = false;  // from acquire() until the update
  int64_t gradsPending = 0;  // this step
  int64_t gradBytes = 0;     // counted in the tracker
  bool counted = false;      // the blob in memory is counted in the tracker

  bool inMemory() const {
    return copy == Copy::kDirty || copy == Copy::kWriting || copy == Copy::kClean;
  }
};

namespace {

// Makes sure a parameter's block is in memory before autograd accumulates into it.
class FetchBeforeAccumulate final : public torch::autograd::FunctionPreHook {
 public:
  FetchBeforeAccumulate(OutOfCoreWeights* store, size_t block) : store_(store), block_(block) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    store_->acquire(block_);
    return grads;
  }

 private:
  OutOfCoreWeights* store_;
  size_t block_;
};

}  // namespace

std::vector<std::vector<at::Tensor>> blockParameters(BlockModel& model) {
  std::vector<std::vector<at::Tensor>> groups;
  for (size_t i = 0; i < model->numBlocks(); ++i) {
    std::vector<at::Tensor> ps;
    for (const auto& p : model->block(i).ptr()->parameters()) {
      if (p.requires_grad()) ps.push_back(p);
    }
    groups.push_back(std::move(ps));
  }
  return groups;
}

int64_t OutOfCoreWeights::windowBytes(BlockModel& model, const WeightOptions& options) {
  std::vector<int64_t> blob, grads;
  for (const auto& ps : blockParameters(model)) {
    const int64_t w = tensorBytes(ps);
    blob.push_back(w * (1 + options.stateFactor));
    grads.push_back(w);
  }
  if (blob.empty()) return 0;
  int64_t total = blob[0];
  std::vector<int64_t> rest(blob.begin() + 1, blob.end());
  std::sort(rest.rbegin(), rest.rend());
  // In memory at once besides block 0: the block in use, its prefetches, one block waiting for
  // its update, the block being updated (waiting for a write slot) and the blobs being written;
  // gradients: the block in backward and at most
  // two waiting for or in their update (acquire()'s backpressure).
  const size_t inFlight = static_cast<size_t>(options.prefetch + 3 + options.maxWritesInFlight);
  for (size_t k = 0; k < rest.size() && k < inFlight; ++k) total += rest[k];
  std::sort(grads.rbegin(), grads.rend());
  if (!options.overlapUpdates) {
    for (int64_t g : grads) total += g;  // every gradient waits for finishStep()
  } else {
    for (size_t k = 0; k < grads.size() && k < 3; ++k) total += grads[k];
  }
  return total;
}

OutOfCoreWeights::OutOfCoreWeights(BlockModel model, torch::optim::Optimizer& optimizer,
                                   const OptimizerFactory& make, Tier& tier, MemoryTracker* tracker,
                                   GroupExchange* exchange, WeightOptions options)
    : model_(std::move(model)),
      optimizer_(optimizer),
      tier_(tier),
      tracker_(tracker),
      exchange_(exchange),
      options_(options),
      inner_(model_->runner()) {
  CARAVAN_CHECK(!optimizer_.param_groups().empty(), "the run's optimizer has no parameters");
  std::vector<std::vector<at::Tensor>> groups = blockParameters(model_);
  {
    size_t counted = 0;
    for (const auto& g : groups) counted += g.size();
    size_t total = 0;
    for (const auto& p : model_->parameters()) total += p.requires_grad() ? 1 : 0;
    CARAVAN_CHECK_EQ(counted, total,
                     "memory.weights = offload needs every parameter in exactly one block");
  }
  if (tracker_ != nullptr) {
    tracker_->set(MemoryCategory::kWeights, 0);
    tracker_->set(MemoryCategory::kGradients, 0);
    tracker_->set(MemoryCategory::kOptimizerState, 0);
  }
  std::unique_lock<std::mutex> lock(mutex_);
  for (size_t i = 0; i < groups.size(); ++i) {
    auto b = std::make_unique<Block>();
    b->index = i;
    b->params = std::move(groups[i]);
    b->keep = i == 0;
    if (!b->params.empty()) {
      b->optimizer = make(b->params);
      for (const auto& p : b->params) {
        auto it = optimizer_.state().find(optimizerStateKey(p));
        if (it != optimizer_.state().end()) {
          b->optimizer->state()[it->first] = std::move(it->second);
          optimizer_.state().erase(it);
        }
      }
    }
    blocks_.push_back(std::move(b));
  }
  for (auto& b : blocks_) {
    if (!b->params.empty()) buildLayout(*b);
  }
  // An accumulator records its parameter's shape when it is made: make (and hold) them while
  // every parameter has its own, before anything leaves memory.
  std::vector<size_t> accumulatorBlock;
  std::vector<int64_t> gradientBytes;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    for (const auto& p : blocks_[i]->params) {
      auto acc = torch::autograd::impl::grad_accumulator(p);
      CARAVAN_CHECK(acc != nullptr, "a parameter without a gradient accumulator");
      accumulators_.push_back(std::move(acc));
      accumulatorBlock.push_back(i);
      gradientBytes.push_back(tensorBytes({p}));
    }
  }
  try {
    for (auto& b : blocks_) {
      if (!b->params.empty() && !b->keep) writeLocked(b->index, lock);
    }
  } catch (...) {
    // A write failed (disk full, file size limit): the queued jobs refer to this store.
    lock.unlock();
    tier_.drain();
    for (auto& b : blocks_) {
      if (b->slot >= 0) tier_.free(b->slot);
    }
    throw;
  }
  // The hooks last: nothing below can fail, so a store that was never made leaves none.
  for (size_t k = 0; k < accumulators_.size(); ++k) {
    const size_t i = accumulatorBlock[k];
    auto& acc = accumulators_[k];
    acc->add_pre_hook(std::make_unique<FetchBeforeAccumulate>(this, i));
    const int64_t bytes = gradientBytes[k];
    postKeys_.push_back(acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, i, bytes](const torch::autograd::variable_list& outputs,
                         const torch::autograd::variable_list&) {
          onGradient(i, bytes);
          return outputs;
        })));
  }
  lock.unlock();
  updater_ = std::thread([this] { updaterLoop(); });
  model_->setRunner(this);
}

OutOfCoreWeights::~OutOfCoreWeights() {
  if (model_->runner() == this) model_->setRunner(inner_);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  cv_.notify_all();
  if (exchange_ != nullptr) exchange_->cancelGroupWaits();
  if (updater_.joinable()) updater_.join();
  tier_.drain();  // I/O jobs refer to this store
  for (size_t k = 0; k < accumulators_.size(); ++k) {
    auto& acc = accumulators_[k];
    acc->del_post_hook(postKeys_[k]);
    auto& pre = acc->pre_hooks();
    pre.erase(std::remove_if(pre.begin(), pre.end(),
                             [](const std::unique_ptr<torch::autograd::FunctionPreHook>& h) {
                               return dynamic_cast<FetchBeforeAccumulate*>(h.get()) != nullptr;
                             }),
              pre.end());
  }
  // Everything back in memory as plain tensors would need reads that may fail; the parameters
  // of a destroyed store are left as they are (empty where evicted).
  for (auto& b : blocks_) {
    if (b->slot >= 0) tier_.free(b->slot);
  }
}

int OutOfCoreWeights::blockOf(const c10::StorageImpl* s) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = blobOwner_.find(s);
  return it == blobOwner_.end() ? -1 : static_cast<int>(it->second);
}

void OutOfCoreWeights::checkLocked() const {
  if (error_) std::rethrow_exception(error_);
  tier_.check();
}

void OutOfCoreWeights::buildLayout(Block& b) {
  // The members in memory: the parameters, then each one's optimizer state.
  std::vector<Block::Member> members;
  for (const auto& p : b.params) {
    Block::Member m;
    m.tensor = p;
    m.parameter = true;
    members.push_back(m);
  }
  for (const auto& p : b.params) {
    for (const auto& t : stateTensors(*b.optimizer, p)) {
      Block::Member m;
      m.tensor = t;
      members.push_back(m);
    }
  }
  int64_t offset = 0, paramBytes = 0, stateBytes = 0;
  for (auto& m : members) {
    m.sizes = m.tensor.sizes().vec();
    m.dtype = m.tensor.scalar_type();
    m.offset = offset;
    const int64_t n = tensorBytes({m.tensor});
    offset = alignUp(offset + n);
    (m.parameter ? paramBytes : stateBytes) += n;
  }
  const int64_t bytes = std::max<int64_t>(offset, kAlign);
  at::DataPtr data = tier_.allocateHost(bytes);
  at::Storage blob(at::Storage::use_byte_size_t(), static_cast<size_t>(bytes), std::move(data),
                   /*allocator=*/nullptr, /*resizable=*/false);
  {
    at::NoGradGuard noGrad;
    for (const auto& m : members) viewOf(blob, m.offset, m.dtype, m.sizes).copy_(m.tensor);
  }
  if (b.blob) {
    blobOwner_.erase(b.blob.unsafeGetStorageImpl());
    uncount(b);
    b.blob = at::Storage();
  }
  if (b.slot >= 0 && bytes != b.bytes) {
    tier_.free(b.slot);
    b.slot = -1;
  }
  b.members = std::move(members);
  b.bytes = bytes;
  b.paramBytes = paramBytes;
  b.stateBytes = stateBytes;
  attachViews(b, blob);
  b.copy = Block::Copy::kDirty;
}

void OutOfCoreWeights::attachViews(Block& b, const at::Storage& blob) {
  for (auto& m : b.members) m.tensor.set_data(viewOf(blob, m.offset, m.dtype, m.sizes));
  b.blob = blob;
  blobOwner_[blob.unsafeGetStorageImpl()] = b.index;
  // Blocks read in for a checkpoint are not training's memory (weights.h).
  if (tracker_ != nullptr && !gathering_) {
    tracker_->add(MemoryCategory::kWeights, b.paramBytes);
    tracker_->add(MemoryCategory::kOptimizerState, b.stateBytes);
    b.counted = true;
  }
}

void OutOfCoreWeights::uncount(Block& b) {
  if (tracker_ != nullptr && b.counted) {
    tracker_->add(MemoryCategory::kWeights, -b.paramBytes);
    tracker_->add(MemoryCategory::kOptimizerState, -b.stateBytes);
  }
  b.counted = false;
}

void OutOfCoreWeights::evictLocked(Block& b) {
  for (auto& m : b.members) {
    m.tensor.set_data(at::empty({0}, at::TensorOptions().dtype(m.dtype)));
  }
  blobOwner_.erase(b.blob.unsafeGetStorageImpl());
  b.blob = at::Storage();
  uncount(b);
  b.copy = Block::Copy::kOnTier;
}

void OutOfCoreWeights::unpinLocked(size_t i) {
  Block& b = *blocks_[i];
  if (b.pins > 0) --b.pins;
  evictIfUnusedLocked(b);
}

void OutOfCoreWeights::evictIfUnusedLocked(Block& b) {
  if (b.pins == 0 && !b.backwardPin && !b.keep && b.copy == Block::Copy::kClean) {
    evictLocked(b);
  }
}

void OutOfCoreWeights::startReadLocked(size_t i) {
  Block& b = *blocks_[i];
  if (b.params.empty() || b.copy != Block::Copy::kOnTier) return;
  CARAVAN_CHECK(b.slot >= 0, "block {}'s weights are neither in memory nor on the tier", i);
  b.copy = Block::Copy::kReading;
  const int64_t slot = b.slot, bytes = b.bytes;
  tier_.submitRead([this, i, slot, bytes] {
    std::string err;
    at::Storage s;
    try {
      at::DataPtr data = tier_.allocateHost(bytes);
      tier_.load(slot, data.get(), bytes);
      s = at::Storage(at::Storage::use_byte_size_t(), static_cast<size_t>(bytes), std::move(data),
                      /*allocator=*/nullptr, /*resizable=*/false);
    } catch (const std::exception& e) {
      err = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    Block& blk = *blocks_[i];
    blk.copy = Block::Copy::kOnTier;
    try {
      if (!err.empty()) throw IoError(err);
      stats_.bytesRead += bytes;
      attachViews(blk, s);
      blk.copy = Block::Copy::kClean;
    } catch (const std::exception& e) {
      tier_.fail(e.what());  // waiters wake on it
    }
    cv_.notify_all();
  });
}

double OutOfCoreWeights::fetchLocked(size_t i, std::unique_lock<std::mutex>& lock) {
  Block& b = *blocks_[i];
  ++b.pins;
  if (b.params.empty() || b.inMemory()) return 0.0;
  startReadLocked(i);
  const auto t0 = Clock::now();
  try {
    cv_.wait(lock, [&] { return b.inMemory() || error_ || tier_.failed(); });
    checkLocked();
  } catch (...) {
    --b.pins;
    throw;
  }
  return secondsSince(t0);
}

void OutOfCoreWeights::prefetch(size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (i < blocks_.size()) startReadLocked(i);
}

at::Storage OutOfCoreWeights::acquire(size_t i) {
  std::unique_lock<std::mutex> lock(mutex_);
  Block& b = *blocks_.at(i);
  if (b.params.empty()) return at::Storage();
  if (b.backwardPin && b.inMemory()) return b.blob;
  const auto t0 = Clock::now();
  if (options_.overlapUpdates) {
    // Gradient backpressure: backward moves on to block i once at most one block waits for its
    // update, so gradients of at most three blocks are in memory when the updater lags. Only
    // while every block above has all its gradients: a block waiting for one that never comes
    // (an unused parameter) holds back the exchange of the blocks below until finishStep.
    auto settled = [&] {
      int awaiting = 0;
      for (size_t k = i + 1; k < blocks_.size(); ++k) {
        const Block& above = *blocks_[k];
        if (above.gradsPending > 0) return true;
        awaiting += above.update == Block::Update::kQueued ? 1 : 0;
      }
      return awaiting <= 1;
    };
    cv_.wait(lock, [&] { return settled() || error_ || tier_.failed() || stop_; });
    checkLocked();
  }
  fetchLocked(i, lock);
  stats_.stallSeconds += secondsSince(t0);  // backpressure and the read
  b.backwardPin = true;
  unpinLocked(i);
  for (int k = 1; k <= options_.prefetch && static_cast<size_t>(k) <= i; ++k) {
    startReadLocked(i - k);
  }
  return b.blob;
}

void OutOfCoreWeights::beginStepLocked() {
  for (auto& b : blocks_) {
    b->gradsPending = static_cast<int64_t>(b->params.size());
    b->update = b->params.empty() ? Block::Update::kDone : Block::Update::kAwaitingGradients;
  }
}

torch::Tensor OutOfCoreWeights::run(size_t index, torch::nn::AnyModule& block, torch::Tensor x) {
  const bool training = at::GradMode::is_enabled();
  const size_t n = blocks_.size();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    checkLocked();
    if (index == 0 && training) beginStepLocked();
    stats_.stallSeconds += fetchLocked(index, lock);
    for (int k = 1; k <= options_.prefetch && index + k < n; ++k) startReadLocked(index + k);
  }
  torch::Tensor y;
  try {
    y = inner_ != nullptr ? inner_->run(index, block, std::move(x)) : block.forward(std::move(x));
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    unpinLocked(index);
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Block& b = *blocks_[index];
  if (training && index + 1 == n) {
    // Backward starts here: keep this block, fetch the ones below it.
    if (!b.params.empty()) b.backwardPin = true;
    for (int k = 1; k <= options_.prefetch && static_cast<size_t>(k) <= index; ++k) {
      startReadLocked(index - k);
    }
  }
  unpinLocked(index);
  return y;
}

void OutOfCoreWeights::onGradient(size_t i, int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  Block& b = *blocks_[i];
  b.gradBytes += bytes;
  if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, bytes);
  if (--b.gradsPending > 0) return;
  if (options_.overlapUpdates) {
    if (b.update == Block::Update::kAwaitingGradients) queueUpdateLocked(i);
  } else {
    // The update waits for finishStep() (clipping): the clean blob need not wait in memory.
    b.backwardPin = false;
    evictIfUnusedLocked(b);
  }
}

void OutOfCoreWeights::queueUpdateLocked(size_t i) {
  blocks_[i]->update = Block::Update::kQueued;
  updates_.push_back(i);
  cv_.notify_all();
}

void OutOfCoreWeights::writeLocked(size_t i, std::unique_lock<std::mutex>& lock) {
  Block& b = *blocks_[i];
  cv_.wait(lock, [&] {
    return writesInFlight_ < options_.maxWritesInFlight || error_ || tier_.failed();
  });
  checkLocked();
  if (b.slot < 0) b.slot = tier_.allocate(b.bytes);
  b.copy = Block::Copy::kWriting;
  ++writesInFlight_;
  const at::Storage blob = b.blob;
  const int64_t slot = b.slot, bytes = b.bytes;
  tier_.submitWrite([this, i, blob, slot, bytes] {
    std::string err;
    try {
      tier_.store(slot, blob.data(), bytes);
    } catch (const std::exception& e) {
      err = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    Block& blk = *blocks_[i];
    --writesInFlight_;
    // Nothing replaces a blob while it is written: an update waits for the write.
    const bool unchanged = blk.copy == Block::Copy::kWriting &&
                           blk.blob.unsafeGetStorageImpl() == blob.unsafeGetStorageImpl();
    blk.copy = Block::Copy::kDirty;
    try {
      CARAVAN_CHECK(unchanged, "block {}'s blob changed while it was written", i);
      if (!err.empty()) throw IoError(err);
      stats_.bytesWritten += bytes;
      blk.copy = Block::Copy::kClean;
      evictIfUnusedLocked(blk);
    } catch (const std::exception& e) {
      tier_.fail(e.what());  // waiters wake on it
    }
    cv_.notify_all();
  });
}

void OutOfCoreWeights::update(size_t i) {
  Block& b = *blocks_[i];
  {
    std::unique_lock<std::mutex> lock(mutex_);
    fetchLocked(i, lock);
    cv_.wait(lock, [&] { return b.copy != Block::Copy::kWriting || error_ || tier_.failed(); });
    checkLocked();
  }
  // The averaged gradients in .grad (the parameters have their shapes again).
  if (exchange_ != nullptr) exchange_->finishGroup(i);
  const auto t0 = Clock::now();
  {
    at::NoGradGuard noGrad;
    const double lr = optimizer_.param_groups().front().options().get_lr();
    for (auto& g : b.optimizer->param_groups()) g.options().set_lr(lr);
    b.optimizer->step();
    for (auto& p : b.params) p.mutable_grad() = at::Tensor();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, -b.gradBytes);
  b.gradBytes = 0;
  // The first step creates the optimizer state: the blob grows to hold it.
  size_t expected = b.params.size();
  for (const auto& p : b.params) expected += stateTensors(*b.optimizer, p).size();
  if (expected != b.members.size()) {
    buildLayout(b);
  }
  b.copy = Block::Copy::kDirty;
  b.backwardPin = false;
  b.update = Block::Update::kDone;
  cv_.notify_all();  // backward may be waiting for this (acquire's backpressure)
  stats_.updateSeconds += secondsSince(t0);
  if (!b.keep) writeLocked(i, lock);
  unpinLocked(i);
}

void OutOfCoreWeights::updaterLoop() {
  at::init_num_threads();  // train.threads, as on the training thread
  for (;;) {
    size_t i = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stop_ || !updates_.empty(); });
      if (stop_) return;
      i = updates_.front();
      updates_.pop_front();
      ++updatesRunning_;
    }
    try {
      update(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!error_) error_ = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --updatesRunning_;
    cv_.notify_all();
  }
}

void OutOfCoreWeights::finishStep() {
  std::unique_lock<std::mutex> lock(mutex_);
  checkLocked();
  for (size_t k = blocks_.size(); k-- > 0;) {
    if (blocks_[k]->update == Block::Update::kAwaitingGradients) queueUpdateLocked(k);
  }
  cv_.wait(lock, [&] {
    return (updates_.empty() && updatesRunning_ == 0) || error_ || tier_.failed();
  });
  checkLocked();
}

void OutOfCoreWeights::withAllResident(const std::function<void()>& fn) {
  size_t pinned = 0;
  const auto release = onScopeExit([this, &pinned] {
    std::lock_guard<std::mutex> lock(mutex_);
    optimizer_.state().clear();
    for (size_t i = 0; i < pinned; ++i) unpinLocked(i);
  });
  // The whole model comes in: first give back what the allocator keeps for reuse.
  if (HostAllocator::installed()) HostAllocator::instance().emptyCache();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    gathering_ = true;
    const auto done = onScopeExit([this] { gathering_ = false; });
    for (size_t i = 0; i < blocks_.size(); ++i) startReadLocked(i);
    for (size_t i = 0; i < blocks_.size(); ++i) {
      fetchLocked(i, lock);
      ++pinned;
    }
    for (auto& b : blocks_) {
      if (!b->optimizer) continue;
      for (const auto& p : b->params) {
        auto it = b->optimizer->state().find(optimizerStateKey(p));
        if (it != b->optimizer->state().end()) optimizer_.state()[it->first] = it->second->clone();
      }
    }
  }
  fn();
}

WeightStats OutOfCoreWeights::takeStats() {
  std::lock_guard<std::mutex> lock(mutex_);
  WeightStats s = stats_;
  stats_ = {};
  return s;
}

}  // namespace caravan
