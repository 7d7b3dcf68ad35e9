// The default CPU generator's state (dropout's draws), read and set under the generator's lock:
// recompute replays a block's draws (memory/executor.cpp), the planner's profile and a module's
// probe put the state back afterwards, checkpoints store it and resuming sets it.
// Threading: free functions; any thread (the generator's own mutex).
#pragma once

#include <ATen/core/Tensor.h>

namespace caravan {

at::Tensor defaultRngState();
void setDefaultRngState(const at::Tensor& state);

}  // namespace caravan
