// Optimizer state laid end to end: the state of a list of parameters as rows over their flat
// vector (the parameter server's layout), so it can be cut into any number of shards and put
// back per parameter. This is how the servers' optimizer state reaches a checkpoint and comes
// back from one on any number of servers: rank 0's own optimizer holds it in the in-core form.
//
// Slots (rows): SGD with momentum: [momentum_buffer]; AdamW: [exp_avg, exp_avg_sq] and the step
// count (amsgrad is not configurable). An optimizer that has not stepped has no rows. Every
// parameter of the list must be in the same state (all stepped equally, or none): the servers
// and a data-parallel replica always are.
//
// Threading: none; the caller owns the optimizer.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "core/torch_fwd.h"

namespace caravan {

struct FlatOptimizerState {
  at::Tensor slots;  // [rows, n] float32; rows = 0: no state yet
  int64_t step = 0;  // AdamW's step count (0 for SGD)
  int64_t rows() const { return slots.defined() ? slots.size(0) : 0; }
  // Columns [begin, begin + n): one shard's state.
  FlatOptimizerState narrow(int64_t begin, int64_t n) const;
};

// The state of `params` (in this order; n = their total numel) in `optimizer`.
FlatOptimizerState gatherOptimizerState(torch::optim::Optimizer& optimizer,
                                        const std::vector<at::Tensor>& params);
// Installs `state` (n columns, n = the total numel of `params`) as the state of `params` in
// `optimizer`, replacing what was there; rows = 0 removes their state.
void scatterOptimizerState(torch::optim::Optimizer& optimizer,
                           const std::vector<at::Tensor>& params, const FlatOptimizerState& state);

// Point to point: [rows, step] then the rows. The receiver knows n.
void sendOptimizerState(Communicator& comm, const FlatOptimizerState& state, int dst, int tag);
FlatOptimizerState recvOptimizerState(Communicator& comm, int64_t n, int src, int tag,
                                      std::chrono::milliseconds timeout);

}  // namespace caravan
