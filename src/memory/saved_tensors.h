// Saved tensors under Caravan's control: every tensor autograd saves for backward passes
// through Caravan's hooks (pack when saved, unpack when backward needs it, release when the
// saved variable dies), so the engine can account for it and, later, place it on a tier.
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
#include <vector>

#include <ATen/ATen.h>

#include "memory/tracker.h"

namespace caravan {

// Installs the engine; idempotent. Call it before any autograd work (backward calls already
// running keep the engine they started with).
void installSavedTensorEngine();
// True once installSavedTensorEngine() ran.
bool savedTensorEngineInstalled();

class SavedTensorScope {
 public:
  // While alive, tensors saved on this thread are accounted in `tracker`; saves on the storage
  // of any tensor in `parameters` are not (they are weights).
  SavedTensorScope(MemoryTracker& tracker, const std::vector<at::Tensor>& parameters);
  ~SavedTensorScope();
  SavedTensorScope(const SavedTensorScope&) = delete;
  SavedTensorScope& operator=(const SavedTensorScope&) = delete;

  struct State;

 private:
  std::shared_ptr<State> state_;
  std::shared_ptr<State> previous_;
};

}  // namespace caravan
