// Fused host optimizers: AdamW and SGD (momentum, Nesterov, weight decay) that update each
// float32 parameter in one vectorised pass over its contiguous buffer (parameter, gradient and
// state read once, written once), split across the intra-op threads where a buffer is large
// enough to pay (kParallelGrain elements a thread). torch::optim's AdamW makes about ten passes
// and three temporaries per parameter.
//
// They are torch::optim::AdamW and torch::optim::SGD: the same options, parameter groups and
// per-parameter state (AdamWParamState, SGDParamState), so checkpoints, the parameter servers'
// state exchange and the out-of-core weights treat them as the originals. A parameter that is
// not a dense, contiguous float32 CPU tensor (or AdamW with amsgrad) takes the original's step.
//
// Equality with torch::optim (tests/test_optim.cpp): each element is computed with the same
// float32 operations in the same order, with a fused multiply-add exactly where LibTorch's
// vectorised kernels use one (add_ with alpha, addcmul_, addcdiv_). Measured on this machine
// (LibTorch 1.13, CPU capability AVX2): bitwise equal after every step. LibTorch 2.13's float32
// sqrt is not correctly rounded (1 ulp apart in 15% of values, at every CPU capability), so
// AdamW's parameters now differ in some elements by a few float32 spacings of the update
// (FusedOptim.AdamWStaysWithinRoundingOfTorchOptimEachStep bounds it); SGD stays bitwise
// (FusedOptim.SgdStaysWithinRoundingOfTorchOptimEachStep).
//
// Threading: step() runs on the calling thread and at::parallel_for's pool.
#pragma once

#include <string>

#include <c10/util/C++17.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace caravan {

class FusedAdamW : public torch::optim::AdamW {
 public:
  using torch::optim::AdamW::AdamW;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

class FusedSgd : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  torch::Tensor step(LossClosure closure = nullptr) override;
};

// The key of `p`'s state in a torch::optim optimizer's state() (LibTorch 2.x: its TensorImpl's
// address; 1.13 keyed it by that address as text). Inline, so that code which only reads optimizer
// state (the parameter servers' state exchange, the fuzz targets) does not link the fused kernels.
inline void* optimizerStateKey(const at::Tensor& p) { return p.unsafeGetTensorImpl(); }

// The instruction set the fused loops run with on this CPU: "avx512f+fma", "avx2+fma" or
// "baseline" (from cpuid, once).
const char* fusedLoopInstructionSet();

// Elements a thread takes at least (below 2x this a buffer is updated by one thread).
constexpr int64_t kParallelGrain = 1 << 16;

}  // namespace caravan
