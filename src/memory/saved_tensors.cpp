// Saved-tensor hooks through a custom autograd engine (see saved_tensors.h).
#include "memory/saved_tensors.h"

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include "core/errors.h"

namespace caravan {

struct SavedTensorScope::State {
  MemoryTracker* tracker = nullptr;
  // The parameters' storages: a saved parameter, or a view of one (linear saves weight.t()),
  // is a weight, not an activation.
  std::unordered_set<const c10::StorageImpl*> parameters;
  std::mutex mutex;
  // Saved tensors per storage: a storage's bytes count while any saved tensor holds it.
  std::unordered_map<const c10::StorageImpl*, int64_t> holders;

  void hold(const at::Tensor& t) {
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    std::lock_guard<std::mutex> lock(mutex);
    if (holders[s]++ == 0) {
      tracker->add(MemoryCategory::kActivations, static_cast<int64_t>(t.storage().nbytes()));
    }
  }
  void release(const at::Tensor& t) {
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    std::lock_guard<std::mutex> lock(mutex);
    auto it = holders.find(s);
    CARAVAN_CHECK(it != holders.end(), "saved tensor released twice");
    if (--it->second == 0) {
      holders.erase(it);
      tracker->add(MemoryCategory::kActivations, -static_cast<int64_t>(t.storage().nbytes()));
    }
  }
};

namespace {

thread_local std::shared_ptr<SavedTensorScope::State> tActive;
std::atomic<bool> gInstalled{false};

// One saved variable: holds the tensor (policy `keep`) and accounts for it until released.
class Hooks final : public torch::autograd::SavedVariableHooks {
 public:
  explicit Hooks(std::shared_ptr<SavedTensorScope::State> state) : state_(std::move(state)) {}
  ~Hooks() override {
    if (counted_) state_->release(tensor_);
  }

  void call_pack_hook(const at::Tensor& tensor) override {
    tensor_ = tensor;
    if (!tensor.defined() || !tensor.has_storage()) return;
    if (state_->parameters.count(tensor.storage().unsafeGetStorageImpl()) != 0) return;
    state_->hold(tensor);
    counted_ = true;
  }
  at::Tensor call_unpack_hook() override { return tensor_; }

 private:
  std::shared_ptr<SavedTensorScope::State> state_;
  at::Tensor tensor_;
  bool counted_ = false;
};

struct CaravanEngine final : torch::autograd::Engine {
  CaravanEngine() = default;
  ~CaravanEngine() override { stop(); }
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks()
      override {
    if (!tActive) return nullptr;
    return std::make_unique<Hooks>(tActive);
  }
};

torch::autograd::Engine& caravanEngine() {
  static CaravanEngine engine;
  return engine;
}

}  // namespace

void installSavedTensorEngine() {
  if (gInstalled.exchange(true)) return;
  torch::autograd::set_default_engine_stub(&caravanEngine);
}

bool savedTensorEngineInstalled() { return gInstalled.load(); }

SavedTensorScope::SavedTensorScope(MemoryTracker& tracker,
                                   const std::vector<at::Tensor>& parameters)
    : state_(std::make_shared<State>()), previous_(tActive) {
  CARAVAN_CHECK(gInstalled.load(),
                "SavedTensorScope without installSavedTensorEngine(): saves would bypass it");
  state_->tracker = &tracker;
  for (const auto& p : parameters) {
    state_->parameters.insert(p.storage().unsafeGetStorageImpl());
  }
  tActive = state_;
}

SavedTensorScope::~SavedTensorScope() { tActive = previous_; }

}  // namespace caravan
