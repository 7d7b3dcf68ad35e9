// The fused optimizers (optim/fused.h) against torch::optim: the same start, the same gradients,
// every element compared after every step.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/Version.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "optim/fused.h"

using namespace caravan;

namespace {

// Sizes that cover the vector loops' tails and the split across threads (> 2 kParallelGrain).
const std::vector<int64_t> kSizes = {1, 7, 33, 1000, 2 * kParallelGrain + 17};

std::vector<at::Tensor> makeParams(at::ScalarType dtype = at::kFloat) {
  std::vector<at::Tensor> params;
  for (int64_t n : kSizes) {
    params.push_back(torch::randn({n}, torch::TensorOptions(dtype)).requires_grad_(true));
  }
  return params;
}

std::vector<at::Tensor> copies(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone().requires_grad_(true));
  return out;
}

// Fresh random gradients, the same on both sides.
void setSameGradients(std::vector<at::Tensor>& a, std::vector<at::Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor g = torch::randn_like(a[i]);
    a[i].mutable_grad() = g.clone();
    b[i].mutable_grad() = g.clone();
  }
}

// Units in the last place between two float32 tensors (largest over the elements), and how
// many elements differ at all.
struct UlpDiff {
  int64_t maxUlps = 0;
  int64_t differing = 0;
};

UlpDiff ulpDiff(const at::Tensor& a, const at::Tensor& b) {
  UlpDiff d;
  const at::Tensor x = a.contiguous(), y = b.contiguous();
  const float* px = x.data_ptr<float>();
  const float* py = y.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) {
    int32_t ix, iy;
    std::memcpy(&ix, &px[i], 4);
    std::memcpy(&iy, &py[i], 4);
    if (ix == iy) continue;
    ++d.differing;
    // Ordered integers: the distance between two floats of one sign in representable steps.
    auto ordered = [](int32_t v) { return v < 0 ? INT32_MIN - v : v; };
    d.maxUlps = std::max<int64_t>(d.maxUlps, std::llabs(static_cast<int64_t>(ordered(ix)) -
                                                        static_cast<int64_t>(ordered(iy))));
  }
  return d;
}

// |a - b| in units of the float32 spacing at the largest of |b|, |before| and the update
// |b - before| (before: the value the step started from; undefined: |b| alone), the largest
// over the elements. AdamW's bound, kRoundingSpacings = 4: LibTorch 2.13's float32 sqrt is not
// the correctly rounded one (measured: 1 ulp apart from NumPy's in 15% of values, at every CPU
// capability; the fused loop's std::sqrt is exact), and the division, the epsilon, the step size
// and the final add each round by half a spacing after it, in each implementation. Measured up
// to 3 of these spacings; counted in the result's own ulps that read up to 4096 where the
// parameter and its update nearly cancel (elements of about 1e-4). LibTorch 1.13's sqrt was
// exact, and AdamW was bitwise equal then.
constexpr double kRoundingSpacings = 4.0;

double spacingsApart(const at::Tensor& a, const at::Tensor& b, const at::Tensor& before) {
  at::Tensor scale = b.abs();
  if (before.defined()) scale = at::maximum(at::maximum(scale, before.abs()), (b - before).abs());
  const at::Tensor spacing = at::nextafter(scale, at::full_like(scale, INFINITY)) - scale;
  return ((a - b).abs() / spacing).max().item<double>();
}

// Runs `steps` steps of both optimizers on the same gradients (and, in step s, learning rate
// lr(s)), comparing parameters and state after each; `stateOf` lists a parameter's state
// tensors. After each comparison the fused side takes the reference's values, so the bound is
// per step and does not compound.
void compareSteps(torch::optim::Optimizer& reference, torch::optim::Optimizer& fused,
                  std::vector<at::Tensor>& refParams, std::vector<at::Tensor>& fusedParams,
                  int steps,
                  const std::function<std::vector<at::Tensor>(torch::optim::Optimizer&,
                                                              const at::Tensor&)>& stateOf,
                  bool bitwise) {
  int64_t differing = 0, maxUlps = 0;
  for (int s = 0; s < steps; ++s) {
    const double lr = 0.01 * (1.0 + 0.5 * std::sin(s));
    for (auto* o : {&reference, &fused}) {
      for (auto& g : o->param_groups()) g.options().set_lr(lr);
    }
    setSameGradients(refParams, fusedParams);
    std::vector<std::vector<at::Tensor>> before;  // each parameter and its state, before the step
    for (const at::Tensor& p : refParams) {
      std::vector<at::Tensor> b = stateOf(reference, p);
      b.insert(b.begin(), p);
      for (at::Tensor& t : b) t = t.detach().clone();
      before.push_back(std::move(b));
    }
    reference.step();
    fused.step();
    torch::NoGradGuard noGrad;
    for (size_t i = 0; i < refParams.size(); ++i) {
      std::vector<at::Tensor> want = stateOf(reference, refParams[i]);
      std::vector<at::Tensor> got = stateOf(fused, fusedParams[i]);
      want.insert(want.begin(), refParams[i]);
      got.insert(got.begin(), fusedParams[i]);
      ASSERT_EQ(want.size(), got.size());
      for (size_t k = 0; k < want.size(); ++k) {
        const UlpDiff d = ulpDiff(got[k], want[k]);
        differing += d.differing;
        maxUlps = std::max(maxUlps, d.maxUlps);
        const at::Tensor was = k < before[i].size() ? before[i][k] : at::Tensor();
        EXPECT_LE(spacingsApart(got[k], want[k], was), kRoundingSpacings)
            << "step " << s << " parameter " << i << " tensor " << k << " (" << d.maxUlps
            << " ulps of the result)";
        got[k].copy_(want[k]);
      }
    }
  }
  std::cout << "elements differing from torch::optim over " << steps << " steps: " << differing
            << " (max " << maxUlps << " ulp)\n";
  if (bitwise) EXPECT_EQ(differing, 0);
}

std::vector<at::Tensor> adamState(torch::optim::Optimizer& o, const at::Tensor& p) {
  auto it = o.state().find(optimizerStateKey(p));
  if (it == o.state().end()) return {};
  auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
  return {s.exp_avg(), s.exp_avg_sq()};
}

std::vector<at::Tensor> sgdState(torch::optim::Optimizer& o, const at::Tensor& p) {
  auto it = o.state().find(optimizerStateKey(p));
  if (it == o.state().end()) return {};
  return {static_cast<torch::optim::SGDParamState&>(*it->second).momentum_buffer()};
}

}  // namespace

TEST(FusedOptim, AdamWStaysWithinRoundingOfTorchOptimEachStep) {
  for (double weightDecay : {0.0, 0.01}) {
    torch::manual_seed(1);
    std::vector<at::Tensor> ref = makeParams(), mine = copies(ref);
    torch::optim::AdamWOptions o(0.01);
    o.betas({0.9, 0.95}).eps(1e-8).weight_decay(weightDecay);
    torch::optim::AdamW reference(ref, o);
    FusedAdamW fused(mine, o);
    compareSteps(reference, fused, ref, mine, 20, adamState, /*bitwise=*/false);
  }
}

TEST(FusedOptim, SgdStaysWithinRoundingOfTorchOptimEachStep) {
  struct Case {
    double momentum, dampening, weightDecay;
    bool nesterov;
  };
  for (const Case& c :
       {Case{0.0, 0.0, 0.0, false}, Case{0.0, 0.0, 5e-4, false}, Case{0.9, 0.0, 0.0, false},
        Case{0.9, 0.1, 5e-4, false}, Case{0.9, 0.0, 5e-4, true}}) {
    SCOPED_TRACE(::testing::Message() << "momentum " << c.momentum << " dampening " << c.dampening
                                      << " wd " << c.weightDecay << " nesterov " << c.nesterov);
    torch::manual_seed(2);
    std::vector<at::Tensor> ref = makeParams(), mine = copies(ref);
    torch::optim::SGDOptions o(0.05);
    o.momentum(c.momentum).dampening(c.dampening).weight_decay(c.weightDecay).nesterov(c.nesterov);
    torch::optim::SGD reference(ref, o);
    FusedSgd fused(mine, o);
    // SGD's operations (multiply, add, multiply-add) are exactly rounded in both: bitwise.
    compareSteps(reference, fused, ref, mine, 10, sgdState, /*bitwise=*/true);
  }
}

// A parameter the loops do not take (float64 here) goes through torch::optim's own step, with
// its state kept in the fused optimizer.
TEST(FusedOptim, OtherParametersTakeTorchOptimsStep) {
  torch::manual_seed(3);
  std::vector<at::Tensor> ref = makeParams(at::kDouble), mine = copies(ref);
  torch::optim::AdamWOptions o(0.01);
  o.weight_decay(0.01);
  torch::optim::AdamW reference(ref, o);
  FusedAdamW fused(mine, o);
  for (int s = 0; s < 3; ++s) {
    setSameGradients(ref, mine);
    reference.step();
    fused.step();
  }
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_TRUE(torch::equal(ref[i], mine[i])) << i;
    EXPECT_TRUE(torch::equal(adamState(reference, ref[i])[1], adamState(fused, mine[i])[1]));
  }
}

// The loops run with the widest instructions the CPU has, as the kernel reports its flags in
// /proc/cpuinfo. GCC's target_clones picked its "arch=haswell" clone by the CPU's model, so on
// AMD's AVX2 CPUs every loop ran the baseline build (a libm call per fused multiply-add), 10x
// slower.
TEST(FusedOptim, LoopsRunWithTheWidestInstructionsTheCpuHas) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) {
      flags = line.substr(line.find(':') + 1) + " ";
      break;
    }
  }
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo flags on this system";
  auto has = [&](const std::string& f) { return flags.find(" " + f + " ") != std::string::npos; };
  const std::string expected = has("avx512f") && has("fma") ? "avx512f+fma"
                               : has("avx2") && has("fma")  ? "avx2+fma"
                                                            : "baseline";
  EXPECT_EQ(fusedLoopInstructionSet(), expected) << "flags:" << flags;
}
