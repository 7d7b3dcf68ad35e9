// Saved tensors under Caravan's control: every tensor autograd saves for backward passes
// through Caravan's hooks (pack when saved, unpack when backward needs it, release when the
// saved variable dies), so the engine can account for it and place it (memory/executor.h).
//
// How (LibTorch 1.13, pure C++): installSavedTensorEngine() replaces autograd's default engine
// with a subclass whose get_default_saved_variable_hooks() returns a fresh hooks object for
// every saved variable while a SavedTensorScope is active on the saving thread (nullptr
// otherwise, so autograd behaves exactly as stock). It must run before any autograd work in
// the process (main() and the test main call it first).
//
// Ops save parameters too (a linear layer saves its weight, as the view weight.t()): the scope
// knows the model's parameters, and a saved tensor on a parameter's storage is passed through
// without accounting (it is a weight, held anyway). Everything else is counted in the
// tracker's activations by storage (tracker.h).
//
// Threading: a scope is per thread (the trainer thread runs forward); release and unpack run
// on autograd's threads and synchronize through the scope's shared state.
#pragma once

#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/ATen.h>

#include "core/torch_fwd.h"
#include "memory/tracker.h"

namespace caravan {

// The accounting of one SavedTensorScope: which storages are parameters, and the activation
// bytes held in memory, counted once per storage however many holders it has.
// The storages of `tensors` that hold bytes, to recognise saves on them. An empty tensor's
// storage is left out: another pipeline stage's released parameter gets a new storage when it
// is gathered, and the freed StorageImpl's address can come back as an activation's.
// `withEmpty`: their storages even while empty (sharded units, gathered into again; the
// StorageImpl lives as long as the unit).
std::unordered_set<const c10::StorageImpl*> storagesOf(const std::vector<at::Tensor>& tensors,
                                                       bool withEmpty = false);

class SavedTensorAccounting {
 public:
  // `gatheredLater`: model state whose storages may be empty now and hold the weights again
  // later (sharded parameters, sync/sharding.h); counted as parameters even while empty.
  SavedTensorAccounting(MemoryTracker& tracker, const std::vector<at::Tensor>& parameters,
                        const std::vector<at::Tensor>& gatheredLater = {});
  // True if `t` lives on a parameter's storage (a weight, held anyway).
  bool isParameter(const at::Tensor& t) const;
  // A holder of `s` appears / goes away; the storage's bytes count while it has holders.
  // `float32`: the first holder's tensor is float32 (what memory.tier_dtype = bf16 halves).
  // Only the keep hooks pass it (what profileModel counts); the executor's holds do not, so
  // liveFloat32Bytes() is meaningful in a scope without an executor.
  void hold(const at::Storage& s, bool float32 = false);
  void release(const at::Storage& s);
  MemoryTracker& tracker() { return *tracker_; }
  // The bytes counted now whose storages were first held by a float32 tensor.
  int64_t liveFloat32Bytes() const;

 private:
  MemoryTracker* tracker_;
  std::unordered_set<const c10::StorageImpl*> parameters_;
  mutable std::mutex mutex_;
  struct Holders {
    int64_t count = 0;
    bool float32 = false;
  };
  std::unordered_map<const c10::StorageImpl*, Holders> holders_;
  int64_t float32Bytes_ = 0;
};

// The version a saved tensor had when it was saved. Autograd does not check that a tensor
// saved through hooks was left alone (it cannot see through them), so the hooks check it on
// unpack: an in-place change after saving fails as it would without hooks.
class SavedVersion {
 public:
  SavedVersion() = default;
  explicit SavedVersion(const at::Tensor& t);
  // Throws c10::Error (autograd's message) if the tensor was modified in place since.
  void check() const;

 private:
  c10::VariableVersion counter_{c10::VariableVersion::DISABLED};
  uint32_t version_ = 0;
  std::vector<int64_t> sizes_;
  bool tracked_ = false;
};

// The accounting of the scope active on this thread (nullptr outside any scope).
std::shared_ptr<SavedTensorAccounting> activeAccounting();

// Decides what happens to tensors saved while it is current on a thread (the executor's
// per-block policies, memory/executor.h). Without one, saves are kept and accounted.
class SavedTensorPlacement {
 public:
  virtual ~SavedTensorPlacement() = default;
  virtual std::unique_ptr<torch::autograd::SavedVariableHooks> makeHooks() = 0;
};

// Makes `placement` current on this thread while alive (nullptr: back to plain keep).
class PlacementGuard {
 public:
  explicit PlacementGuard(SavedTensorPlacement* placement);
  ~PlacementGuard();
  PlacementGuard(const PlacementGuard&) = delete;
  PlacementGuard& operator=(const PlacementGuard&) = delete;

 private:
  SavedTensorPlacement* previous_;
};

// Installs the engine; idempotent. Call it before any autograd work (backward calls already
// running keep the engine they started with).
void installSavedTensorEngine();
// True once installSavedTensorEngine() ran.
bool savedTensorEngineInstalled();

class SavedTensorScope {
 public:
  // While alive, tensors saved on this thread are accounted in `tracker`; saves on the storage
  // of any tensor in `parameters` are not (pass the model's parameters and buffers: weights and
  // running statistics, held anyway).
  // `gatheredLater`: as SavedTensorAccounting's.
  SavedTensorScope(MemoryTracker& tracker, const std::vector<at::Tensor>& parameters,
                   const std::vector<at::Tensor>& gatheredLater = {});
  ~SavedTensorScope();
  SavedTensorScope(const SavedTensorScope&) = delete;
  SavedTensorScope& operator=(const SavedTensorScope&) = delete;

 private:
  std::shared_ptr<SavedTensorAccounting> state_;
  std::shared_ptr<SavedTensorAccounting> previous_;
};

}  // namespace caravan
