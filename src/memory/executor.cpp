// The activation executor (see executor.h).
#include "memory/executor.h"

#include <chrono>
#include <sstream>

#include <torch/csrc/autograd/saved_variable_hooks.h>
#include <torch/nn/modules/container/any.h>

#include "core/clock.h"
#include "core/errors.h"
#include "core/scope_guard.h"
#include "memory/saved_tensors.h"
#include "memory/weights.h"

namespace caravan {

const char* policyName(BlockPolicy p) {
  switch (p) {
    case BlockPolicy::kKeep: return "keep";
    case BlockPolicy::kRecompute: return "recompute";
    case BlockPolicy::kSwap: return "swap";
    case BlockPolicy::kSwapInput: return "swap-input";
  }
  return "?";
}

std::vector<BlockPolicy> parsePolicies(const std::string& text, size_t blocks,
                                       const std::string& key) {
  std::vector<BlockPolicy> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(' '));
    item.erase(item.find_last_not_of(' ') + 1);
    bool found = false;
    for (int p = 0; p < kBlockPolicies; ++p) {
      if (item == policyName(static_cast<BlockPolicy>(p))) {
        out.push_back(static_cast<BlockPolicy>(p));
        found = true;
      }
    }
    if (!found) {
      throw ConfigError(fmt::format(
          "{} = '{}': '{}' is not a policy; use keep, recompute, swap, swap-input or auto, or a "
          "comma-separated list with one per block",
          key, text, item));
    }
  }
  if (out.size() == 1) out.assign(blocks, out[0]);
  if (out.size() != blocks) {
    throw ConfigError(fmt::format("{} = '{}' lists {} policies but the model has {} blocks; "
                                  "give one policy for all or one per block",
                                  key, text, out.size(), blocks));
  }
  return out;
}

std::string formatPolicies(const std::vector<BlockPolicy>& policies) {
  std::string s;
  for (size_t i = 0; i < policies.size(); ++i) {
    if (i > 0) s += ",";
    s += policyName(policies[i]);
  }
  return s;
}

bool needsTier(const std::vector<BlockPolicy>& policies) {
  for (BlockPolicy p : policies) {
    if (p == BlockPolicy::kSwap || p == BlockPolicy::kSwapInput) return true;
  }
  return false;
}

namespace {

using Clock = std::chrono::steady_clock;

// How a saved tensor sits on its storage, to rebuild it on a storage read back from a tier.
struct TensorMeta {
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;

  explicit TensorMeta(const at::Tensor& t)
      : sizes(t.sizes().vec()),
        strides(t.strides().vec()),
        offset(t.storage_offset()),
        dtype(t.scalar_type()) {}
  at::Tensor rebuild(const at::Storage& s) const {
    return at::empty({0}, at::TensorOptions().dtype(dtype)).set_(s, offset, sizes, strides);
  }
};

}  // namespace

struct ActivationExecutor::Frame {
  ActivationExecutor* exec = nullptr;
  size_t index = 0;
  BlockPolicy policy = BlockPolicy::kKeep;
  std::shared_ptr<SavedTensorAccounting> acct;  // nullptr outside a SavedTensorScope
  torch::nn::AnyModule* block = nullptr;

  std::mutex mutex;
  std::atomic<bool> touched{false};
  int64_t saves = 0;  // tensors saved by the block's forward, in order

  // recompute / swap-input
  at::Tensor input;                     // recompute: held until recomputed
  std::shared_ptr<Offload> inputOffload;  // swap-input
  std::unique_ptr<TensorMeta> inputMeta;
  bool inputRequiresGrad = false;
  SavedVersion inputVersion;
  BlockModelImpl::Context context;  // what the block's forward saw (BlockModel::context)
  at::Tensor rng;  // the CPU generator's state before the block ran
  bool materialized = false;
  std::vector<at::Tensor> recomputed;  // by save index (undefined: a parameter, or dropped)

  // swap: one Offload per storage. The weak reference keeps a storage that died (written and
  // dropped) from being mistaken for a new one allocated at the same address.
  struct Swapped {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage{c10::intrusive_ptr<c10::StorageImpl>()};
    std::shared_ptr<Offload> offload;
    TierDtype dtype = TierDtype::kAsIs;
  };
  std::unordered_map<const c10::StorageImpl*, Swapped> offloads;

  ~Frame() {
    if (input.defined()) release(input.storage());
    for (auto& t : recomputed) {
      if (t.defined()) release(t.storage());
    }
  }

  bool isParameter(const at::Tensor& t) const {
    return !t.defined() || !t.has_storage() || exec->isParameter(t);
  }
  void hold(const at::Storage& s) {
    if (acct) acct->hold(s);
  }
  void release(const at::Storage& s) {
    if (acct) acct->release(s);
  }
  Offload::ResidentFn residentFn() {
    std::shared_ptr<SavedTensorAccounting> a = acct;
    if (!a) return nullptr;
    return [a](const at::Storage& s, int delta) {
      if (delta > 0) {
        a->hold(s);
      } else {
        a->release(s);
      }
    };
  }

  // Backward reached this block: its own reads first (unless prefetched already, they would
  // otherwise queue behind the lower blocks'), then the blocks below.
  void touch() {
    if (touched.exchange(true)) return;
    if (OutOfCoreWeights* w = exec->weights()) {
      w->acquire(index);  // and prefetches below
      // A recomputation reads a tied weight's owner too: held from here to the owner's update.
      for (size_t owner : w->alsoReads(index)) w->acquire(owner);
    }
    prefetch();
    exec->reached(index);
  }

  void prefetch() {
    std::lock_guard<std::mutex> lock(mutex);
    if (inputOffload) inputOffload->prefetch();
    for (auto& [impl, swapped] : offloads) swapped.offload->prefetch();
  }

  // The storage's first saved tensor decides how it is stored (ActivationExecutor::tierDtypeFor).
  std::shared_ptr<Offload> offloadFor(const at::Tensor& t) {
    const at::Storage& s = t.storage();
    std::lock_guard<std::mutex> lock(mutex);
    Swapped& entry = offloads[s.unsafeGetStorageImpl()];
    if (!entry.offload || entry.storage.expired()) {
      entry.storage = s.getWeakStorageImpl();
      entry.dtype = exec->tierDtypeFor(t);
      entry.offload = Offload::start(*exec->tier(), s, residentFn(), entry.dtype);
      exec->addOffloaded(entry.offload->storedBytes());
    } else {
      // A storage goes to the tier once, as its first saved tensor decided: a later view of it
      // as another type would be widened float32 (only a view(dtype) makes one).
      CARAVAN_CHECK(entry.dtype != TierDtype::kBf16 || t.scalar_type() == at::kFloat,
                    "memory.tier_dtype = bf16: a storage was saved as float32 and as {}; set "
                    "memory.tier_dtype = float32 for this model",
                    c10::toString(t.scalar_type()));
    }
    return entry.offload;
  }

  at::Tensor recomputedAt(int64_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!materialized) materialize();
    CARAVAN_CHECK(i < static_cast<int64_t>(recomputed.size()) && recomputed[i].defined(),
                  "recomputed saved tensor used twice or missing");
    return recomputed[i];
  }

  void dropRecomputed(int64_t i) {
    std::lock_guard<std::mutex> lock(mutex);
    if (i < static_cast<int64_t>(recomputed.size()) && recomputed[i].defined()) {
      release(recomputed[i].storage());
      recomputed[i] = at::Tensor();
    }
  }

  void materialize();  // under mutex
};

namespace {

using Frame = ActivationExecutor::Frame;

// Captures what a block's forward saves while it is recomputed (the graph it builds is thrown
// away; only the saved tensors are kept, in order).
class CaptureHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit CaptureHooks(Frame* frame) : frame_(frame) {}
  void call_pack_hook(const at::Tensor& tensor) override {
    if (frame_->isParameter(tensor)) {
      frame_->recomputed.emplace_back();  // parameters are held by the original hooks
      return;
    }
    frame_->hold(tensor.storage());
    frame_->recomputed.push_back(tensor.detach());
  }
  at::Tensor call_unpack_hook() override {
    CARAVAN_CHECK(false, "a recomputation's own graph was used for backward");
    return {};
  }

 private:
  Frame* frame_;
};

class CapturePlacement final : public SavedTensorPlacement {
 public:
  explicit CapturePlacement(Frame* frame) : frame_(frame) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> makeHooks() override {
    return std::make_unique<CaptureHooks>(frame_);
  }

 private:
  Frame* frame_;
};

// One tensor saved by a block's forward, placed by the block's policy.
class BlockHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit BlockHooks(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  ~BlockHooks() override {
    switch (mode_) {
      case Mode::kKept: frame_->release(held_.storage()); break;
      case Mode::kRecomputed: frame_->dropRecomputed(index_); break;
      default: break;
    }
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    index_ = frame_->saves++;
    OutOfCoreWeights* weights = frame_->exec->weights();
    if (weights != nullptr && tensor.defined() && tensor.has_storage()) {
      const int owner = weights->blockOf(tensor.storage().unsafeGetStorageImpl());
      if (owner >= 0) {
        // A view of an out-of-core weight: its place in the blob, rebuilt in backward on the
        // blob fetched back (holding it would keep the blob in memory). The version check
        // catches an update of the weights before backward used them.
        weightBlock_ = static_cast<size_t>(owner);
        meta_ = std::make_unique<TensorMeta>(tensor);
        version_ = SavedVersion(tensor);
        mode_ = Mode::kWeightView;
        return;
      }
    }
    if (frame_->isParameter(tensor)) {
      // A weight or buffer (or nothing): held as it is, not an activation. Detached, as in keep
      // (see KeepHooks in saved_tensors.cpp: no tensor -> grad_fn -> hooks cycle). No version
      // check: recomputing a batch-norm block updates and restores its running statistics,
      // which its backward (training mode) does not read.
      held_ = tensor.defined() ? tensor.detach() : tensor;
      mode_ = Mode::kParameter;
      return;
    }
    version_ = SavedVersion(tensor);
    switch (frame_->policy) {
      case BlockPolicy::kKeep:
        held_ = tensor.detach();
        frame_->hold(tensor.storage());
        mode_ = Mode::kKept;
        break;
      case BlockPolicy::kRecompute:
      case BlockPolicy::kSwapInput:
        mode_ = Mode::kRecomputed;  // dropped now, recomputed in backward
        break;
      case BlockPolicy::kSwap:
        offload_ = frame_->offloadFor(tensor);
        meta_ = std::make_unique<TensorMeta>(tensor);
        mode_ = Mode::kSwapped;
        break;
    }
  }

  at::Tensor call_unpack_hook() override {
    version_.check();
    frame_->touch();
    switch (mode_) {
      case Mode::kParameter:
      case Mode::kKept: return held_;
      case Mode::kRecomputed: return frame_->recomputedAt(index_);
      case Mode::kWeightView:
        return meta_->rebuild(frame_->exec->weights()->acquire(weightBlock_));
      case Mode::kSwapped: {
        const auto t0 = Clock::now();
        at::Storage s = offload_->get();
        frame_->exec->addStall(secondsSince(t0));
        return meta_->rebuild(s);
      }
    }
    return {};
  }

 private:
  enum class Mode { kParameter, kKept, kRecomputed, kSwapped, kWeightView };
  std::shared_ptr<Frame> frame_;
  Mode mode_ = Mode::kParameter;
  int64_t index_ = 0;
  size_t weightBlock_ = 0;
  at::Tensor held_;
  std::shared_ptr<Offload> offload_;
  std::unique_ptr<TensorMeta> meta_;
  SavedVersion version_;
};

class BlockPlacement final : public SavedTensorPlacement {
 public:
  explicit BlockPlacement(std::shared_ptr<Frame> frame) : frame_(std::move(frame)) {}
  std::unique_ptr<torch::autograd::SavedVariableHooks> makeHooks() override {
    return std::make_unique<BlockHooks>(frame_);
  }

 private:
  std::shared_ptr<Frame> frame_;
};

}  // namespace

void Frame::materialize() {
  const auto t0 = Clock::now();
  inputVersion.check();  // recomputing from an input changed in place would be silently wrong
  at::Tensor x;
  if (inputOffload) {
    x = inputMeta->rebuild(inputOffload->get());
    exec->addStall(secondsSince(t0));
  } else {
    x = input;
  }
  const auto t1 = Clock::now();
  x = x.detach();
  if (inputRequiresGrad) x.requires_grad_(true);

  // The forward must see what it saw the first time: the RNG state (dropout) and the buffers
  // (batch norm's running statistics, which it updates again); both are put back afterwards,
  // also when the forward throws.
  // A block's own buffers and those it reads of another block's (a shared BatchNorm).
  std::vector<at::Tensor> buffers = exec->model()->blockBuffers(index);
  std::vector<at::Tensor> saved;
  {
    at::NoGradGuard noGrad;
    for (const auto& b : buffers) saved.push_back(b.clone());
  }
  const auto restore = onScopeExit([rng = defaultRngState(), &buffers, &saved] {
    setDefaultRngState(rng);
    at::NoGradGuard noGrad;
    for (size_t i = 0; i < buffers.size(); ++i) buffers[i].copy_(saved[i]);
  });
  setDefaultRngState(rng);
  for (auto& t : recomputed) {  // a recomputation that threw half-way left some
    if (t.defined()) release(t.storage());
  }
  recomputed.clear();
  {
    CapturePlacement capture(this);
    PlacementGuard guard(&capture);
    at::AutoGradMode enable(true);
    BlockModelImpl::ContextScope scope(*exec->model(), context);
    block->forward(x);
  }
  CARAVAN_CHECK(static_cast<int64_t>(recomputed.size()) == saves,
                fmt::format("recomputing block {} saved {} tensors; its forward saved {}",
                            index, recomputed.size(), saves));
  materialized = true;
  if (input.defined()) {
    release(input.storage());
    input = at::Tensor();
  }
  inputOffload.reset();
  exec->addRecompute(secondsSince(t1));
}

ActivationExecutor::ActivationExecutor(BlockModel model, std::vector<BlockPolicy> policies,
                                       Tier* tier, int prefetchDepth, TierDtype tierDtype)
    : model_(std::move(model)),
      policies_(std::move(policies)),
      tier_(tier),
      prefetchDepth_(prefetchDepth),
      tierDtype_(tierDtype) {
  CARAVAN_CHECK(policies_.size() == model_->numBlocks(), "one policy per block");
  CARAVAN_CHECK(tier_ != nullptr || !needsTier(policies_), "swap policies need a tier");
  CARAVAN_CHECK(savedTensorEngineInstalled(),
                "ActivationExecutor without installSavedTensorEngine()");
  refreshParameters();
  model_->setRunner(this);
}

TierDtype ActivationExecutor::tierDtypeFor(const at::Tensor& t) const {
  return tierDtype_ == TierDtype::kBf16 && t.scalar_type() == at::kFloat &&
                 t.storage().nbytes() % sizeof(float) == 0
             ? TierDtype::kBf16
             : TierDtype::kAsIs;
}

ActivationExecutor::~ActivationExecutor() {
  if (model_->runner() == this) model_->setRunner(nullptr);
}

torch::Tensor ActivationExecutor::run(size_t index, torch::nn::AnyModule& block,
                                      torch::Tensor x) {
  if (!at::GradMode::is_enabled()) return block.forward(std::move(x));
  if (tier_ != nullptr) tier_->check();
  std::shared_ptr<SavedTensorAccounting> acct = activeAccounting();
  if (activationLimit_ > 0 && tier_ != nullptr && acct) {
    const int64_t next = index < savedBytes_.size() ? savedBytes_[index] : 0;
    if (acct->tracker().live(MemoryCategory::kActivations) + next > activationLimit_) {
      const auto t0 = Clock::now();
      tier_->drainWrites();
      tier_->check();
      addStall(secondsSince(t0));
    }
  }
  const size_t n = policies_.size();
  auto frame = std::make_shared<Frame>();
  frame->exec = this;
  frame->index = index;
  frame->policy = policies_.at(index);
  frame->acct = acct;
  frame->block = &block;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // A forward from the first block starts a step's frames; a pipeline stage's blocks start
    // further in (and with several micro-batches in flight, a block's latest frame is kept:
    // prefetching follows it, reads of the others happen when backward unpacks them).
    if (index == 0 || frames_.size() != n) frames_.assign(n, {});
    frames_.at(index) = frame;
  }
  if (frame->policy == BlockPolicy::kRecompute || frame->policy == BlockPolicy::kSwapInput) {
    frame->inputRequiresGrad = x.requires_grad();
    frame->inputVersion = SavedVersion(x);
    frame->rng = defaultRngState();
    if (model_->usesContext(index)) frame->context = model_->context();
    if (frame->policy == BlockPolicy::kRecompute) {
      frame->input = x;
      frame->hold(x.storage());
    } else {
      frame->inputMeta = std::make_unique<TensorMeta>(x);
      frame->inputOffload =
          Offload::start(*tier_, x.storage(), frame->residentFn(), tierDtypeFor(x));
      addOffloaded(frame->inputOffload->storedBytes());
    }
  }
  at::Tensor y;
  {
    BlockPlacement placement(frame);
    PlacementGuard guard(&placement);
    y = block.forward(std::move(x));
  }
  if (index + 1 == n) reached(n);  // backward starts next: fetch the last blocks
  return y;
}

void ActivationExecutor::setActivationLimit(int64_t limit, std::vector<int64_t> savedBytes) {
  activationLimit_ = limit;
  savedBytes_ = std::move(savedBytes);
}

bool ActivationExecutor::isParameter(const at::Tensor& t) const {
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  return parameterStorages_.count(s) != 0 || (weights_ != nullptr && weights_->blockOf(s) >= 0);
}

void ActivationExecutor::setWeights(OutOfCoreWeights* weights) {
  weights_ = weights;
  refreshParameters();
}

void ActivationExecutor::refreshParameters(const std::vector<at::Tensor>& gatheredLater) {
  // Out-of-core parameters move between storages (the store knows its blobs); buffers stay put.
  std::vector<at::Tensor> held = model_->buffers();
  if (weights_ == nullptr) {
    for (const auto& p : model_->parameters()) held.push_back(p);
  }
  parameterStorages_ = storagesOf(held);
  parameterStorages_.merge(storagesOf(gatheredLater, /*withEmpty=*/true));
}

void ActivationExecutor::reached(size_t block) {
  std::vector<std::shared_ptr<Frame>> next;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (size_t k = 1; k <= static_cast<size_t>(prefetchDepth_) && k <= block; ++k) {
      if (block - k >= frames_.size()) continue;
      if (auto f = frames_[block - k].lock()) next.push_back(std::move(f));
    }
  }
  for (auto& f : next) f->prefetch();
}

void ActivationExecutor::addStall(double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.stallSeconds += seconds;
}

void ActivationExecutor::addOffloaded(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytesOffloaded += bytes;
}

void ActivationExecutor::addRecompute(double seconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.recomputeSeconds += seconds;
}

ExecutorStats ActivationExecutor::takeStats() {
  std::lock_guard<std::mutex> lock(mutex_);
  ExecutorStats s = stats_;
  stats_ = {};
  return s;
}

}  // namespace caravan
