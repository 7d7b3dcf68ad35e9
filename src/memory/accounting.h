// Byte counts of what a training run holds, for the MemoryTracker's measured categories
// (weights, gradients, optimizer state) and the process's resident set.
//
// Threading: any thread; reads only.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "core/torch_fwd.h"

namespace caravan {

class MemoryTracker;

// Sum of numel * element size over defined tensors.
int64_t tensorBytes(const std::vector<at::Tensor>& tensors);
// Bytes of the .grad tensors of `params` that are defined.
int64_t gradientBytes(const std::vector<at::Tensor>& params);
// The defined tensors of one parameter's optimizer state (SGD's momentum buffer; Adam's and
// AdamW's moments): shallow handles, so set_data on them moves the optimizer's own tensors.
std::vector<at::Tensor> optimizerStateTensors(const torch::optim::OptimizerParamState& state);
// The state tensors of parameter `p` in `optimizer` (none before its first step).
std::vector<at::Tensor> optimizerStateTensors(torch::optim::Optimizer& optimizer,
                                              const at::Tensor& p);
// Bytes of an optimizer's per-parameter state (SGD momentum buffers; Adam/AdamW moments).
int64_t optimizerStateBytes(const torch::optim::Optimizer& optimizer);
// Sets `memory`'s weights, gradients and optimizer state to those of `params` held in memory
// (their bytes, their defined .grad, `optimizer`'s state): a step engine's in-core model state.
void setModelStateBytes(MemoryTracker& memory, const std::vector<at::Tensor>& params,
                        const torch::optim::Optimizer& optimizer);
// This process's resident set size (Linux /proc/self/statm; 0 when unreadable).
int64_t residentBytes();

// The C heap (glibc mallinfo2, all arenas): bytes handed out (mmapped chunks included) and
// bytes free but still held by the allocator. RSS minus these is code, data and the rest.
struct HeapBytes {
  int64_t inUse = 0;
  int64_t free = 0;
};
HeapBytes heapBytes();
// Returns the heap's free memory to the kernel (malloc_trim): setup (reading and tokenizing a
// dataset, profiling) leaves free heap mapped that no step needs.
void releaseFreeHeap();

// "2GiB", "512 MiB", "1.5G", "1000000" (bytes) -> bytes; "" -> 0 (no budget). ConfigError for
// anything else, naming `key`.
int64_t parseBytes(const std::string& text, const std::string& key);

}  // namespace caravan
