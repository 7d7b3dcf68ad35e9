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

#include "core/align.h"
#include "core/clock.h"
#include "core/errors.h"
#include "core/scope_guard.h"
#include "memory/accounting.h"
#include "memory/host_allocator.h"
#include "optim/fused.h"

namespace caravan {

using Clock = std::chrono::steady_clock;

namespace {

at::Tensor viewOf(const at::Storage& s, int64_t offsetBytes, at::ScalarType dtype,
                  const std::vector<int64_t>& sizes) {
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(s, offsetBytes / elem, sizes);
}

}  // namespace

struct OutOfCoreWeights::Piece {
  struct Member {
    at::Tensor tensor;  // the parameter or state tensor itself (set_data moves it)
    std::vector<int64_t> sizes;
    at::ScalarType dtype = at::kFloat;
    int64_t offset = 0;  // bytes into the blob
  };
  // Where the piece's bytes are. kOnTier -> kReading -> kClean (read in); kClean -> kOnTier
  // (evicted when nothing pins it); an update makes it kDirty -> kWriting -> kClean. A piece
  // without members (state before the first step) stays kDirty and is never written.
  enum class Copy {
    kOnTier,   // not in memory; the tier copy is current
    kReading,  // a read is in flight
    kDirty,    // in memory; the tier copy is stale (or there is none yet)
    kWriting,  // in memory; a write of this blob is in flight
    kClean,    // in memory; the tier copy equals it
  };

  Block* block = nullptr;
  bool weights = false;            // the block's parameters; else the optimizer state of `params`
  std::vector<at::Tensor> params;  // state: its parameters
  std::unique_ptr<torch::optim::Optimizer> optimizer;  // state: steps `params`
  std::vector<Member> members;
  int64_t bytes = 0;      // the blob's (members aligned)
  int64_t dataBytes = 0;  // the members' own, as the tracker counts them
  at::Storage blob;       // defined while in memory (kDirty, kWriting, kClean) with members
  int64_t slot = -1;
  Copy copy = Copy::kDirty;
  int pins = 0;          // forward, updates, withAllResident
  bool counted = false;  // the blob in memory is counted in the tracker

  bool inMemory() const {
    return copy == Copy::kDirty || copy == Copy::kWriting || copy == Copy::kClean;
  }
  MemoryCategory category() const {
    return weights ? MemoryCategory::kWeights : MemoryCategory::kOptimizerState;
  }
};

struct OutOfCoreWeights::Block {
  // This step's update. kAwaitingGradients -> kQueued (every gradient in, or finishStep) ->
  // kDone; a block without parameters is kDone from the start of the step.
  enum class Update { kAwaitingGradients, kQueued, kDone };

  size_t index = 0;
  std::vector<at::Tensor> params;
  Piece weights;
  std::vector<std::unique_ptr<Piece>> state;
  Update update = Update::kDone;
  bool keep = false;         // block 0: always in memory
  bool backwardPin = false;  // the weights, from acquire() until the update
  int64_t gradsPending = 0;  // this step
  int64_t gradBytes = 0;     // counted in the tracker
  // The blocks whose weights it reads too (a tied weight's owner).
  std::vector<size_t> alsoReads;
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

std::vector<std::vector<size_t>> statePieces(const std::vector<at::Tensor>& params,
                                             const WeightOptions& options) {
  std::vector<std::vector<size_t>> pieces;
  int64_t bytes = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const int64_t b = tensorBytes({params[k]}) * options.stateFactor;
    if (pieces.empty() || bytes + b > options.stateChunkBytes) {
      pieces.emplace_back();
      bytes = 0;
    }
    pieces.back().push_back(k);
    bytes += b;
  }
  return pieces;
}

std::vector<int64_t> statePieceBytes(const std::vector<at::Tensor>& params,
                                     const WeightOptions& options) {
  std::vector<int64_t> out;
  for (const auto& piece : statePieces(params, options)) {
    int64_t bytes = 0;
    for (size_t k : piece) bytes += tensorBytes({params[k]}) * options.stateFactor;
    out.push_back(bytes);
  }
  return out;
}

WeightWindow OutOfCoreWeights::window(BlockModel& model, const WeightOptions& options) {
  WeightWindow out;
  const std::vector<std::vector<at::Tensor>> blocks = blockParameters(model);
  if (blocks.empty()) return out;
  int64_t weights = 0, state = 0;  // the largest of blocks 1..
  std::vector<int64_t> grads;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t w = tensorBytes(blocks[i]);
    grads.push_back(w);
    if (i == 0) continue;
    weights = std::max(weights, w);
    for (int64_t s : statePieceBytes(blocks[i], options)) state = std::max(state, s);
  }
  const int64_t backlog = std::max(options.updateBacklog, 0);
  const int64_t writes = options.maxWritesInFlight;
  // Block 0 stays; the block in use, its prefetches and the blocks waiting for or in their
  // update hold their weights; the update holds the piece it steps and the next, each queued
  // block its first; and any of them may be among the pieces being written.
  out.weights = grads[0] + (2 + options.prefetch + backlog + writes) * weights;
  out.state = grads[0] * options.stateFactor + (2 + backlog + writes) * state;
  std::sort(grads.rbegin(), grads.rend());
  const size_t withGradients =
      options.overlapUpdates ? static_cast<size_t>(2 + backlog) : grads.size();
  for (size_t k = 0; k < grads.size() && k < withGradients; ++k) out.gradients += grads[k];
  // At most `writes` pieces in flight in all: the larger kind counted.
  out.total = out.weights + out.state + out.gradients - writes * std::min(weights, state);
  return out;
}

int64_t OutOfCoreWeights::windowBytes(BlockModel& model, const WeightOptions& options) {
  return window(model, options).total;
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
    for (const auto& use : model_->sharedUses()) {
      const bool parameter = model_->named_parameters().contains(use.name);
      if (use.user == i && use.owner != i && parameter &&
          std::find(b->alsoReads.begin(), b->alsoReads.end(), use.owner) == b->alsoReads.end()) {
        b->alsoReads.push_back(use.owner);
      }
    }
    b->weights.block = b.get();
    b->weights.weights = true;
    if (!b->params.empty()) {
      for (const auto& indices : statePieces(b->params, options_)) {
        auto piece = std::make_unique<Piece>();
        piece->block = b.get();
        for (size_t k : indices) piece->params.push_back(b->params[k]);
        piece->optimizer = make(piece->params);
        for (const auto& p : piece->params) {
          auto it = optimizer_.state().find(optimizerStateKey(p));
          if (it != optimizer_.state().end()) {
            piece->optimizer->state()[it->first] = std::move(it->second);
            optimizer_.state().erase(it);
          }
        }
        b->state.push_back(std::move(piece));
      }
    }
    blocks_.push_back(std::move(b));
  }
  for (auto& b : blocks_) {
    if (b->params.empty()) continue;
    buildLayout(b->weights);
    for (auto& piece : b->state) buildLayout(*piece);
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
      if (b->params.empty() || b->keep) continue;
      writeLocked(b->weights, lock);
      for (auto& piece : b->state) writeLocked(*piece, lock);
    }
  } catch (...) {
    // A write failed (disk full, file size limit): the queued jobs refer to this store.
    lock.unlock();
    tier_.drain();
    for (auto& b : blocks_) {
      if (b->weights.slot >= 0) tier_.free(b->weights.slot);
      for (auto& piece : b->state) {
        if (piece->slot >= 0) tier_.free(piece->slot);
      }
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
    if (b->weights.slot >= 0) tier_.free(b->weights.slot);
    for (auto& piece : b->state) {
      if (piece->slot >= 0) tier_.free(piece->slot);
    }
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

void OutOfCoreWeights::buildLayout(Piece& p) {
  // The members in memory: the block's parameters, or each of the piece's parameters' state.
  std::vector<Piece::Member> members;
  if (p.weights) {
    for (const auto& t : p.block->params) members.push_back(Piece::Member{t, {}, at::kFloat, 0});
  } else {
    for (const auto& param : p.params) {
      for (const auto& t : optimizerStateTensors(*p.optimizer, param)) {
        members.push_back(Piece::Member{t, {}, at::kFloat, 0});
      }
    }
  }
  if (p.blob) {
    blobOwner_.erase(p.blob.unsafeGetStorageImpl());
    uncount(p);
    p.blob = at::Storage();
  }
  p.copy = Piece::Copy::kDirty;
  if (members.empty()) {
    p.members.clear();
    return;
  }
  int64_t offset = 0, dataBytes = 0;
  for (auto& m : members) {
    m.sizes = m.tensor.sizes().vec();
    m.dtype = m.tensor.scalar_type();
    m.offset = offset;
    const int64_t n = tensorBytes({m.tensor});
    offset = alignUp(offset + n, kTensorAlign);
    dataBytes += n;
  }
  const int64_t bytes = std::max<int64_t>(offset, kTensorAlign);
  at::DataPtr data = tier_.allocateHost(bytes);
  at::Storage blob(at::Storage::use_byte_size_t(), static_cast<size_t>(bytes), std::move(data),
                   /*allocator=*/nullptr, /*resizable=*/false);
  {
    at::NoGradGuard noGrad;
    for (const auto& m : members) viewOf(blob, m.offset, m.dtype, m.sizes).copy_(m.tensor);
  }
  if (p.slot >= 0 && bytes != p.bytes) {
    tier_.free(p.slot);
    p.slot = -1;
  }
  p.members = std::move(members);
  p.bytes = bytes;
  p.dataBytes = dataBytes;
  attachViews(p, blob);
}

void OutOfCoreWeights::attachViews(Piece& p, const at::Storage& blob) {
  for (auto& m : p.members) m.tensor.set_data(viewOf(blob, m.offset, m.dtype, m.sizes));
  p.blob = blob;
  if (p.weights) blobOwner_[blob.unsafeGetStorageImpl()] = p.block->index;
  // Pieces read in for a checkpoint are not training's memory (weights.h).
  if (tracker_ != nullptr && !gathering_) {
    tracker_->add(p.category(), p.dataBytes);
    p.counted = true;
  }
}

void OutOfCoreWeights::uncount(Piece& p) {
  if (tracker_ != nullptr && p.counted) tracker_->add(p.category(), -p.dataBytes);
  p.counted = false;
}

void OutOfCoreWeights::evictLocked(Piece& p) {
  for (auto& m : p.members) {
    m.tensor.set_data(at::empty({0}, at::TensorOptions().dtype(m.dtype)));
  }
  if (p.weights) blobOwner_.erase(p.blob.unsafeGetStorageImpl());
  p.blob = at::Storage();
  uncount(p);
  p.copy = Piece::Copy::kOnTier;
}

void OutOfCoreWeights::unpinLocked(Piece& p) {
  if (p.pins > 0) --p.pins;
  evictIfUnusedLocked(p);
}

void OutOfCoreWeights::evictIfUnusedLocked(Piece& p) {
  if (p.pins == 0 && !(p.weights && p.block->backwardPin) && !p.block->keep &&
      p.copy == Piece::Copy::kClean) {
    evictLocked(p);
  }
}

void OutOfCoreWeights::startReadLocked(size_t i) {
  if (i < blocks_.size()) startReadLocked(blocks_[i]->weights);
}

void OutOfCoreWeights::startReadLocked(Piece& p) {
  if (p.members.empty() || p.copy != Piece::Copy::kOnTier) return;
  CARAVAN_CHECK(p.slot >= 0, "block {}'s {} are neither in memory nor on the tier", p.block->index,
                p.weights ? "weights" : "optimizer state");
  p.copy = Piece::Copy::kReading;
  Piece* piece = &p;
  const int64_t slot = p.slot, bytes = p.bytes;
  tier_.submitRead([this, piece, slot, bytes] {
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
    piece->copy = Piece::Copy::kOnTier;
    try {
      if (!err.empty()) throw IoError(err);
      stats_.bytesRead += bytes;
      attachViews(*piece, s);
      piece->copy = Piece::Copy::kClean;
    } catch (const std::exception& e) {
      tier_.fail(e.what());  // waiters wake on it
    }
    cv_.notify_all();
  });
}

double OutOfCoreWeights::fetchLocked(Piece& p, std::unique_lock<std::mutex>& lock) {
  ++p.pins;
  if (p.members.empty() || p.inMemory()) return 0.0;
  startReadLocked(p);
  const auto t0 = Clock::now();
  try {
    cv_.wait(lock, [&] { return p.inMemory() || error_ || tier_.failed(); });
    checkLocked();
  } catch (...) {
    --p.pins;
    throw;
  }
  return secondsSince(t0);
}

void OutOfCoreWeights::prefetch(size_t i) {
  std::lock_guard<std::mutex> lock(mutex_);
  startReadLocked(i);
}

const std::vector<size_t>& OutOfCoreWeights::alsoReads(size_t block) const {
  return blocks_.at(block)->alsoReads;
}

at::Storage OutOfCoreWeights::acquire(size_t i) {
  std::unique_lock<std::mutex> lock(mutex_);
  Block& b = *blocks_.at(i);
  if (b.params.empty()) return at::Storage();
  if (b.backwardPin && b.weights.inMemory()) return b.weights.blob;
  const auto t0 = Clock::now();
  if (options_.overlapUpdates) {
    // Gradient backpressure: backward moves on to block i once at most updateBacklog blocks
    // wait for or are in their update. Only while every block above has all its gradients: a
    // block waiting for one that never comes (an unused parameter) holds back the exchange of
    // the blocks below until finishStep.
    auto settled = [&] {
      int awaiting = 0;
      for (size_t k = i + 1; k < blocks_.size(); ++k) {
        const Block& above = *blocks_[k];
        if (above.gradsPending > 0) return true;
        awaiting += above.update == Block::Update::kQueued ? 1 : 0;
      }
      return awaiting <= std::max(options_.updateBacklog, 0);
    };
    cv_.wait(lock, [&] { return settled() || error_ || tier_.failed() || stop_; });
    checkLocked();
  }
  fetchLocked(b.weights, lock);
  stats_.stallSeconds += secondsSince(t0);  // backpressure and the read
  b.backwardPin = true;
  unpinLocked(b.weights);
  for (int k = 1; k <= options_.prefetch && static_cast<size_t>(k) <= i; ++k) {
    startReadLocked(i - k);
  }
  return b.weights.blob;
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
    // A tied weight's owner is held while a block that reads it runs.
    size_t pinned = 0;
    try {
      for (size_t owner : blocks_[index]->alsoReads) {
        stats_.stallSeconds += fetchLocked(blocks_[owner]->weights, lock);
        ++pinned;
      }
      stats_.stallSeconds += fetchLocked(blocks_[index]->weights, lock);
    } catch (...) {
      for (size_t k = 0; k < pinned; ++k)
        unpinLocked(blocks_[blocks_[index]->alsoReads[k]]->weights);
      throw;
    }
    for (int k = 1; k <= options_.prefetch && index + k < n; ++k) startReadLocked(index + k);
  }
  torch::Tensor y;
  try {
    y = inner_ != nullptr ? inner_->run(index, block, std::move(x)) : block.forward(std::move(x));
  } catch (...) {
    std::lock_guard<std::mutex> lock(mutex_);
    unpinLocked(blocks_[index]->weights);
    for (size_t owner : blocks_[index]->alsoReads) unpinLocked(blocks_[owner]->weights);
    throw;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Block& b = *blocks_[index];
  for (size_t owner : b.alsoReads) unpinLocked(blocks_[owner]->weights);
  if (training && index + 1 == n) {
    // Backward starts here: keep this block, fetch the ones below it.
    if (!b.params.empty()) b.backwardPin = true;
    for (int k = 1; k <= options_.prefetch && static_cast<size_t>(k) <= index; ++k) {
      startReadLocked(index - k);
    }
  }
  unpinLocked(b.weights);
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
    // The update waits for finishStep() (clipping): the clean weights need not wait in memory.
    b.backwardPin = false;
    evictIfUnusedLocked(b.weights);
  }
}

void OutOfCoreWeights::queueUpdateLocked(size_t i) {
  Block& b = *blocks_[i];
  b.update = Block::Update::kQueued;
  // What the update reads first, while it waits (with clipping every block queues at once:
  // the update reads it then).
  // Only within the backlog: finishStep() may queue many blocks at once.
  if (options_.overlapUpdates && !b.state.empty() &&
      updates_.size() + updatesRunning_ <=
          static_cast<size_t>(std::max(options_.updateBacklog, 0))) {
    startReadLocked(*b.state.front());
  }
  updates_.push_back(i);
  cv_.notify_all();
}

void OutOfCoreWeights::writeLocked(Piece& p, std::unique_lock<std::mutex>& lock) {
  if (p.members.empty()) return;
  cv_.wait(lock, [&] {
    return writesInFlight_ < options_.maxWritesInFlight || error_ || tier_.failed();
  });
  checkLocked();
  if (p.slot < 0) p.slot = tier_.allocate(p.bytes);
  p.copy = Piece::Copy::kWriting;
  ++writesInFlight_;
  Piece* piece = &p;
  const at::Storage blob = p.blob;
  const int64_t slot = p.slot, bytes = p.bytes;
  tier_.submitWrite([this, piece, blob, slot, bytes] {
    std::string err;
    try {
      tier_.store(slot, blob.data(), bytes);
    } catch (const std::exception& e) {
      err = e.what();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --writesInFlight_;
    // Nothing replaces a blob while it is written: an update waits for the write.
    const bool unchanged = piece->copy == Piece::Copy::kWriting &&
                           piece->blob.unsafeGetStorageImpl() == blob.unsafeGetStorageImpl();
    piece->copy = Piece::Copy::kDirty;
    try {
      CARAVAN_CHECK(unchanged, "block {}'s {} changed while they were written", piece->block->index,
                    piece->weights ? "weights" : "optimizer state");
      if (!err.empty()) throw IoError(err);
      stats_.bytesWritten += bytes;
      piece->copy = Piece::Copy::kClean;
      evictIfUnusedLocked(*piece);
    } catch (const std::exception& e) {
      tier_.fail(e.what());  // waiters wake on it
    }
    cv_.notify_all();
  });
}

void OutOfCoreWeights::update(size_t i) {
  Block& b = *blocks_[i];
  // Waits until `p` is in memory (pinned) and no write of it is in flight.
  auto bring = [&](Piece& p) {
    std::unique_lock<std::mutex> lock(mutex_);
    fetchLocked(p, lock);
    cv_.wait(lock, [&] { return p.copy != Piece::Copy::kWriting || error_ || tier_.failed(); });
    checkLocked();
  };
  if (!b.state.empty()) {
    std::lock_guard<std::mutex> lock(mutex_);
    startReadLocked(*b.state.front());
  }
  bring(b.weights);
  // The averaged gradients in .grad (the parameters have their shapes again).
  if (exchange_ != nullptr) exchange_->finishGroup(i);
  const double lr = optimizer_.param_groups().front().options().get_lr();
  double seconds = 0.0;
  for (size_t k = 0; k < b.state.size(); ++k) {
    Piece& piece = *b.state[k];
    bring(piece);
    if (k + 1 < b.state.size()) {
      std::lock_guard<std::mutex> lock(mutex_);
      startReadLocked(*b.state[k + 1]);
    }
    const auto t0 = Clock::now();
    {
      at::NoGradGuard noGrad;
      for (auto& g : piece.optimizer->param_groups()) g.options().set_lr(lr);
      piece.optimizer->step();
    }
    seconds += secondsSince(t0);
    std::unique_lock<std::mutex> lock(mutex_);
    // The first step creates the optimizer state: the piece grows to hold it.
    size_t expected = 0;
    for (const auto& p : piece.params)
      expected += optimizerStateTensors(*piece.optimizer, p).size();
    if (expected != piece.members.size()) buildLayout(piece);
    piece.copy = Piece::Copy::kDirty;
    if (!b.keep) writeLocked(piece, lock);
    unpinLocked(piece);
  }
  for (auto& p : b.params) p.mutable_grad() = at::Tensor();
  std::unique_lock<std::mutex> lock(mutex_);
  if (tracker_ != nullptr) tracker_->add(MemoryCategory::kGradients, -b.gradBytes);
  b.gradBytes = 0;
  b.weights.copy = Piece::Copy::kDirty;
  b.backwardPin = false;
  b.update = Block::Update::kDone;
  cv_.notify_all();  // backward may be waiting for this (acquire's backpressure)
  stats_.updateSeconds += seconds;
  if (!b.keep) writeLocked(b.weights, lock);
  unpinLocked(b.weights);
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
  std::vector<Piece*> pinned;
  const auto release = onScopeExit([this, &pinned] {
    std::lock_guard<std::mutex> lock(mutex_);
    optimizer_.state().clear();
    for (Piece* p : pinned) unpinLocked(*p);
  });
  // The whole model comes in: first give back what the allocator keeps for reuse.
  if (HostAllocator::installed()) HostAllocator::instance().emptyCache();
  {
    std::unique_lock<std::mutex> lock(mutex_);
    gathering_ = true;
    const auto done = onScopeExit([this] { gathering_ = false; });
    std::vector<Piece*> all;
    for (auto& b : blocks_) {
      all.push_back(&b->weights);
      for (auto& piece : b->state) all.push_back(piece.get());
    }
    for (Piece* p : all) startReadLocked(*p);
    for (Piece* p : all) {
      fetchLocked(*p, lock);
      pinned.push_back(p);
    }
    for (auto& b : blocks_) {
      for (auto& piece : b->state) {
        for (const auto& p : piece->params) {
          auto it = piece->optimizer->state().find(optimizerStateKey(p));
          if (it != piece->optimizer->state().end()) {
            optimizer_.state()[it->first] = it->second->clone();
          }
        }
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
