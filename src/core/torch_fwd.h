// Forward declarations of the LibTorch classes that headers name by reference or pointer
// only, so a header need not include <torch/torch.h> (~20 s per translation unit). The one
// place such declarations live.
#pragma once

namespace c10 {
struct IValue;
}  // namespace c10

namespace torch {
namespace nn {
class Module;
}  // namespace nn
namespace optim {
class Optimizer;
class OptimizerParamState;
}  // namespace optim
namespace autograd {
struct Node;
struct SavedVariableHooks;
}  // namespace autograd
}  // namespace torch
