// Saved-tensor hooks through a custom autograd engine (see saved_tensors.h).
#include "memory/saved_tensors.h"

#include <atomic>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include "core/errors.h"

namespace caravan {

std::unordered_set<const c10::StorageImpl*> storagesOf(const std::vector<at::Tensor>& tensors,
                                                       bool withEmpty) {
  std::unordered_set<const c10::StorageImpl*> out;
  for (const auto& t : tensors) {
    if (t.defined() && t.has_storage() && (withEmpty || t.storage().nbytes() > 0))
      out.insert(t.storage().unsafeGetStorageImpl());
  }
  return out;
}

SavedTensorAccounting::SavedTensorAccounting(MemoryTracker& tracker,
                                             const std::vector<at::Tensor>& parameters,
                                             const std::vector<at::Tensor>& gatheredLater)
    : tracker_(&tracker), parameters_(storagesOf(parameters)) {
  parameters_.merge(storagesOf(gatheredLater, /*withEmpty=*/true));
}

bool SavedTensorAccounting::isParameter(const at::Tensor& t) const {
  return t.defined() && t.has_storage() &&
         parameters_.count(t.storage().unsafeGetStorageImpl()) != 0;
}

void SavedTensorAccounting::hold(const at::Storage& s, bool float32) {
  std::lock_guard<std::mutex> lock(mutex_);
  Holders& h = holders_[s.unsafeGetStorageImpl()];
  if (h.count++ == 0) {
    const auto bytes = static_cast<int64_t>(s.nbytes());
    tracker_->add(MemoryCategory::kActivations, bytes);
    h.float32 = float32;
    if (float32) float32Bytes_ += bytes;
  }
}

void SavedTensorAccounting::release(const at::Storage& s) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = holders_.find(s.unsafeGetStorageImpl());
  CARAVAN_CHECK(it != holders_.end(), "saved tensor released twice");
  if (--it->second.count == 0) {
    const auto bytes = static_cast<int64_t>(s.nbytes());
    if (it->second.float32) float32Bytes_ -= bytes;
    holders_.erase(it);
    tracker_->add(MemoryCategory::kActivations, -bytes);
  }
}

int64_t SavedTensorAccounting::liveFloat32Bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return float32Bytes_;
}

SavedVersion::SavedVersion(const at::Tensor& t) {
  if (!t.defined() || t.is_inference()) return;
  counter_ = torch::autograd::impl::version_counter(t);
  version_ = counter_.current_version();
  sizes_ = t.sizes().vec();
  tracked_ = true;
}

void SavedVersion::check() const {
  if (!tracked_) return;
  const uint32_t now = counter_.current_version();
  TORCH_CHECK(now == version_,
              "one of the variables needed for gradient computation has been modified by an "
              "inplace operation: a tensor of shape ",
              c10::IntArrayRef(sizes_), " is at version ", now, "; expected version ", version_,
              " instead (saved through Caravan's saved-tensor hooks)");
}

namespace {

thread_local std::shared_ptr<SavedTensorAccounting> tActive;
thread_local SavedTensorPlacement* tPlacement = nullptr;
std::atomic<bool> gEngineInstalled{false};

// One saved variable outside any placement: held in memory (policy `keep`) and accounted
// until released.
class KeepHooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit KeepHooks(std::shared_ptr<SavedTensorAccounting> state) : state_(std::move(state)) {}
  ~KeepHooks() override {
    if (counted_) state_->release(tensor_.storage());
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    // Detached: a saved output held with its grad_fn would make a cycle (tensor -> grad_fn ->
    // saved variable -> hooks -> tensor) that leaks a graph dropped without backward; unpack
    // rebuilds the autograd edge from the saved variable's metadata anyway.
    tensor_ = tensor.defined() ? tensor.detach() : tensor;
    version_ = SavedVersion(tensor);
    if (!tensor.defined() || !tensor.has_storage() || state_->isParameter(tensor)) return;
    state_->hold(tensor.storage(), tensor.scalar_type() == at::kFloat);
    counted_ = true;
  }
  at::Tensor call_unpack_hook() override {
    version_.check();
    return tensor_;
  }

 private:
  std::shared_ptr<SavedTensorAccounting> state_;
  at::Tensor tensor_;
  SavedVersion version_;
  bool counted_ = false;
};

struct CaravanEngine final : torch::autograd::Engine {
  CaravanEngine() = default;
  ~CaravanEngine() override { stop(); }
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks()
      override {
    if (tPlacement != nullptr) return tPlacement->makeHooks();
    if (!tActive) return nullptr;
    return std::make_unique<KeepHooks>(tActive);
  }
};

torch::autograd::Engine& caravanEngine() {
  static CaravanEngine engine;
  return engine;
}

}  // namespace

void installSavedTensorEngine() {
  if (gEngineInstalled.exchange(true)) return;
  torch::autograd::set_default_engine_stub(&caravanEngine);
}

bool savedTensorEngineInstalled() { return gEngineInstalled.load(); }

std::shared_ptr<SavedTensorAccounting> activeAccounting() { return tActive; }

PlacementGuard::PlacementGuard(SavedTensorPlacement* placement) : previous_(tPlacement) {
  CARAVAN_CHECK(placement == nullptr || gEngineInstalled.load(),
                "a saved-tensor placement without installSavedTensorEngine(): saves would "
                "bypass it");
  tPlacement = placement;
}

PlacementGuard::~PlacementGuard() { tPlacement = previous_; }

SavedTensorScope::SavedTensorScope(MemoryTracker& tracker,
                                   const std::vector<at::Tensor>& parameters,
                                   const std::vector<at::Tensor>& gatheredLater)
    : state_(std::make_shared<SavedTensorAccounting>(tracker, parameters, gatheredLater)),
      previous_(tActive) {
  CARAVAN_CHECK(gEngineInstalled.load(),
                "SavedTensorScope without installSavedTensorEngine(): saves would bypass it");
  tActive = state_;
}

SavedTensorScope::~SavedTensorScope() { tActive = previous_; }

}  // namespace caravan
