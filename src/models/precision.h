// bf16 mixed precision on the CPU (train.precision, train/precision.h chooses per block).
//
// A bf16 block runs under LibTorch's CPU autocast with bfloat16: the ops autocast lists as
// lower precision (linear, matmul, bmm, baddbmm, convolutions) cast their inputs, weights
// included, to bf16 and run through oneDNN's bf16 kernels; the ops after them take bf16 inputs
// as they come. Its floating outputs go back to float32, so what flows between blocks, the
// loss and every reduction stay float32, and so do the parameters (the master weights), their
// gradients (autograd casts a gradient back to its tensor's type) and the optimizer state.
// Autocast's cache of cast weights is off: a step's cast copies die with the step.
//
// What bf16 does to exactness: the tensors a bf16 block saves for backward are bf16 (half the
// bytes), and memory.policy swap or swap-input moves them as they are; recompute reruns the
// block under the same autocast, so every policy still gives the same gradients as keep.
#pragma once

namespace caravan {

// Whether this CPU has bf16 arithmetic (AVX512_BF16 or AMX-BF16, from cpuid). Without it
// oneDNN emulates bf16 matrix products, slower than float32: train.precision stays float32.
bool cpuHasBf16Instructions();

// The environment variable that makes a CPU without bf16 instructions run train.precision's
// bf16 blocks anyway ("1"): emulated, several times slower than float32, for checking what a
// bf16 run computes (its tests) on any machine.
inline constexpr const char* kEmulateBf16Env = "CARAVAN_EMULATE_BF16";

// Whether bf16 blocks run here: the CPU has bf16 instructions, or CARAVAN_EMULATE_BF16=1.
bool cpuRunsBf16();

// Autocast to bf16 on this thread while alive (the previous state comes back after).
class Bf16Autocast {
 public:
  Bf16Autocast();
  ~Bf16Autocast();
  Bf16Autocast(const Bf16Autocast&) = delete;
  Bf16Autocast& operator=(const Bf16Autocast&) = delete;

 private:
  bool enabled_, cache_;
  int dtype_;
};

}  // namespace caravan
