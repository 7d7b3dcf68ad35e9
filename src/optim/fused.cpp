// Fused AdamW and SGD (see fused.h). This file is compiled with -ffp-contract=off: every fused
// multiply-add below is an explicit std::fma, placed where LibTorch's kernels have one, and
// the compiler adds no others.
#include "optim/fused.h"

#include <cmath>
#include <cstdint>

#include <ATen/Parallel.h>
#include <torch/types.h>
#include <torch/utils.h>

namespace caravan {

namespace {

// Every parameter's update runs on contiguous float32 CPU buffers; anything else takes
// torch::optim's step.
bool fusable(const at::Tensor& p) {
  const at::Tensor& g = p.grad();
  return p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous() &&
         !p.is_sparse() && g.defined() && !g.is_sparse() && g.scalar_type() == at::kFloat &&
         g.is_contiguous() && g.sizes() == p.sizes();
}

template <typename F>
void forChunks(int64_t n, F&& f) {
  if (n < 2 * kParallelGrain) {
    f(int64_t{0}, n);
  } else {
    at::parallel_for(0, n, kParallelGrain, f);
  }
}

// The loops are built for three instruction sets and picked by what this CPU supports (cpuid):
// AVX-512 with FMA, AVX2 with FMA, and the baseline (whose std::fma is libm's fmaf, a call per
// element). Not GCC's target_clones: its "arch=haswell" clone is chosen by the CPU's *model*
// (__builtin_cpu_is), so on AMD's AVX2 CPUs every loop ran the baseline, about 10x slower
// (AdamW on 14M parameters, one thread, EPYC: 0.55 against 4.9 GB/s), and its ISA-level clones
// ("arch=x86-64-v3") are chosen the same way in GCC 12. Each loop body is an always-inline
// function, so each wrapper compiles it under its own target; the same float32 operations in each.
enum class Isa { kBaseline, kAvx2Fma, kAvx512Fma };

Isa cpuIsa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return Isa::kAvx512Fma;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2Fma;
    return Isa::kBaseline;
  }();
  return isa;
}

// NAME(ARGS...) calls BODY(ARGS...) compiled for the CPU's instruction set.
#define CARAVAN_DISPATCHED(NAME, BODY)                                          \
  template <typename... Args>                                                   \
  __attribute__((target("avx512f,avx2,fma"))) void NAME##Avx512(Args... args) { \
    BODY(args...);                                                              \
  }                                                                             \
  template <typename... Args>                                                   \
  __attribute__((target("avx2,fma"))) void NAME##Avx2(Args... args) {           \
    BODY(args...);                                                              \
  }                                                                             \
  template <typename... Args>                                                   \
  void NAME##Baseline(Args... args) {                                           \
    BODY(args...);                                                              \
  }                                                                             \
  template <typename... Args>                                                   \
  void NAME(Args... args) {                                                     \
    switch (cpuIsa()) {                                                         \
      case Isa::kAvx512Fma: return NAME##Avx512(args...);                       \
      case Isa::kAvx2Fma: return NAME##Avx2(args...);                           \
      case Isa::kBaseline: break;                                               \
    }                                                                           \
    NAME##Baseline(args...);                                                    \
  }

#define CARAVAN_LOOP __attribute__((always_inline)) inline

struct AdamWScalars {
  float decay;  // 1 - lr * weight_decay (applied when weightDecay)
  bool weightDecay;
  float beta1, oneMinusBeta1, beta2, oneMinusBeta2;
  float sqrtBiasCorrection2, eps;
  float negStepSize;  // -lr / (1 - beta1^t)
};

// torch::optim::AdamW, per element (LibTorch 1.13, adamw.cpp):
//   p.mul_(1 - lr wd); m.mul_(b1).add_(g, 1 - b1); v.mul_(b2).addcmul_(g, g, 1 - b2);
//   denom = (v.sqrt() / sqrt(bc2)).add_(eps); p.addcdiv_(m, denom, -lr / bc1)
// add_ with alpha is a + alpha b with one fma; addcmul_ is a + (s t1) t2 with its last multiply
// and add fused; addcdiv_ is a + (s t1) / t2 (measured: these orders give LibTorch's bits).
CARAVAN_LOOP void adamwBody(float* __restrict p, const float* __restrict g, float* __restrict m,
                            float* __restrict v, int64_t begin, int64_t end,
                            const AdamWScalars& s) {
  const float decay = s.weightDecay ? s.decay : 1.0f;
  for (int64_t i = begin; i < end; ++i) {
    const float gi = g[i];
    const float pi = s.weightDecay ? p[i] * decay : p[i];
    const float mi = std::fma(gi, s.oneMinusBeta1, m[i] * s.beta1);
    const float vi = std::fma(s.oneMinusBeta2 * gi, gi, v[i] * s.beta2);
    const float denom = std::sqrt(vi) / s.sqrtBiasCorrection2 + s.eps;
    p[i] = pi + s.negStepSize * mi / denom;
    m[i] = mi;
    v[i] = vi;
  }
}
CARAVAN_DISPATCHED(adamwLoop, adamwBody)

struct SgdScalars {
  float weightDecay;  // applied when hasWeightDecay
  bool hasWeightDecay;
  float momentum, oneMinusDampening;
  bool nesterov;
  float negLr;
};

// torch::optim::SGD with momentum, per element (LibTorch 1.13, sgd.cpp):
//   d = g.add(p, wd); buf = first ? d : buf.mul_(mu).add_(d, 1 - dampening);
//   d = nesterov ? d.add(buf, mu) : buf; p.add_(d, -lr)
CARAVAN_LOOP void sgdMomentumBody(float* __restrict p, const float* __restrict g,
                                  float* __restrict buf, int64_t begin, int64_t end, bool first,
                                  const SgdScalars& s) {
  for (int64_t i = begin; i < end; ++i) {
    const float pi = p[i];
    const float d = s.hasWeightDecay ? std::fma(pi, s.weightDecay, g[i]) : g[i];
    const float b = first ? d : std::fma(d, s.oneMinusDampening, buf[i] * s.momentum);
    const float u = s.nesterov ? std::fma(b, s.momentum, d) : b;
    buf[i] = b;
    p[i] = std::fma(u, s.negLr, pi);
  }
}
CARAVAN_DISPATCHED(sgdMomentumLoop, sgdMomentumBody)

// Plain SGD (momentum 0): d = g.add(p, wd); p.add_(d, -lr).
CARAVAN_LOOP void sgdBody(float* __restrict p, const float* __restrict g, int64_t begin,
                          int64_t end, const SgdScalars& s) {
  for (int64_t i = begin; i < end; ++i) {
    const float pi = p[i];
    const float d = s.hasWeightDecay ? std::fma(pi, s.weightDecay, g[i]) : g[i];
    p[i] = std::fma(d, s.negLr, pi);
  }
}
CARAVAN_DISPATCHED(sgdLoop, sgdBody)

// One parameter through the original optimizer: a group of one with the same options, its
// state moved in and back (an update of one parameter reads only that parameter's state).
template <typename Original, typename Options, typename State>
void stepWithOriginal(const at::Tensor& p, const Options& options, State& state) {
  Original one({p}, options);
  const auto key = optimizerStateKey(p);
  auto it = state.find(key);
  if (it != state.end()) one.state()[key] = std::move(it->second);
  one.step();
  auto updated = one.state().find(key);
  if (updated != one.state().end()) state[key] = std::move(updated->second);
}

// The step both optimizers take: the closure (with gradients on), then every parameter that has
// a gradient through `update(p, options)`, which returns false for a parameter it does not
// take; that one goes through Original's step.
template <typename Original, typename Options, typename Groups, typename State, typename Update>
torch::Tensor stepParameters(Groups& groups, State& state,
                             const torch::optim::Optimizer::LossClosure& closure, Update&& update) {
  torch::NoGradGuard noGrad;
  torch::Tensor loss;
  if (closure != nullptr) {
    at::AutoGradMode enableGrad(true);
    loss = closure();
  }
  for (auto& group : groups) {
    auto& options = static_cast<Options&>(group.options());
    for (auto& p : group.params()) {
      if (p.grad().defined() && !update(p, options)) {
        stepWithOriginal<Original>(p, options, state);
      }
    }
  }
  return loss;
}

// One float32 parameter through the fused AdamW loop, its state in `states`; false when the
// loop does not take it (amsgrad, or not a dense contiguous float32 CPU tensor).
template <typename States>
bool fusedAdamW(const at::Tensor& p, const torch::optim::AdamWOptions& options, States& states) {
  if (options.amsgrad() || !fusable(p)) return false;
  const auto key = optimizerStateKey(p);
  auto it = states.find(key);
  if (it == states.end()) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(0);
    s->exp_avg(torch::zeros_like(p, at::MemoryFormat::Contiguous));
    s->exp_avg_sq(torch::zeros_like(p, at::MemoryFormat::Contiguous));
    it = states.emplace(key, std::move(s)).first;
  }
  auto& state = static_cast<torch::optim::AdamWParamState&>(*it->second);
  state.step(state.step() + 1);
  const double beta1 = std::get<0>(options.betas()), beta2 = std::get<1>(options.betas());
  const double biasCorrection1 = 1 - std::pow(beta1, state.step());
  const double biasCorrection2 = 1 - std::pow(beta2, state.step());
  AdamWScalars s{};
  s.weightDecay = options.weight_decay() != 0;
  s.decay = static_cast<float>(1 - options.lr() * options.weight_decay());
  s.beta1 = static_cast<float>(beta1);
  s.oneMinusBeta1 = static_cast<float>(1 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.oneMinusBeta2 = static_cast<float>(1 - beta2);
  s.sqrtBiasCorrection2 = static_cast<float>(std::sqrt(biasCorrection2));
  s.eps = static_cast<float>(options.eps());
  s.negStepSize = static_cast<float>(-(options.lr() / biasCorrection1));
  at::Tensor m = state.exp_avg(), v = state.exp_avg_sq();
  if (!m.is_contiguous()) m = m.contiguous();
  if (!v.is_contiguous()) v = v.contiguous();
  state.exp_avg(m);
  state.exp_avg_sq(v);
  float* pp = p.data_ptr<float>();
  const float* gp = p.grad().data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  forChunks(p.numel(),
            [&](int64_t begin, int64_t end) { adamwLoop(pp, gp, mp, vp, begin, end, s); });
  return true;
}

// The same for SGD (momentum, dampening, Nesterov, weight decay).
template <typename States>
bool fusedSgd(const at::Tensor& p, const torch::optim::SGDOptions& options, States& states) {
  if (!fusable(p)) return false;
  SgdScalars s{};
  s.hasWeightDecay = options.weight_decay() != 0;
  s.weightDecay = static_cast<float>(options.weight_decay());
  s.momentum = static_cast<float>(options.momentum());
  s.oneMinusDampening = static_cast<float>(1 - options.dampening());
  s.nesterov = options.nesterov();
  s.negLr = static_cast<float>(-1 * options.lr());
  float* pp = p.data_ptr<float>();
  const float* gp = p.grad().data_ptr<float>();
  if (options.momentum() == 0) {
    forChunks(p.numel(), [&](int64_t begin, int64_t end) { sgdLoop(pp, gp, begin, end, s); });
    return true;
  }
  const auto key = optimizerStateKey(p);
  auto it = states.find(key);
  const bool first = it == states.end();
  if (first) {
    auto st = std::make_unique<torch::optim::SGDParamState>();
    st->momentum_buffer(torch::empty_like(p, at::MemoryFormat::Contiguous));
    it = states.emplace(key, std::move(st)).first;
  }
  auto& state = static_cast<torch::optim::SGDParamState&>(*it->second);
  at::Tensor buf = state.momentum_buffer();
  if (!buf.is_contiguous()) {
    buf = buf.contiguous();
    state.momentum_buffer(buf);
  }
  float* bp = buf.data_ptr<float>();
  forChunks(p.numel(),
            [&](int64_t begin, int64_t end) { sgdMomentumLoop(pp, gp, bp, begin, end, first, s); });
  return true;
}

}  // namespace

const char* fusedLoopInstructionSet() {
  switch (cpuIsa()) {
    case Isa::kAvx512Fma: return "avx512f+fma";
    case Isa::kAvx2Fma: return "avx2+fma";
    case Isa::kBaseline: break;
  }
  return "baseline";
}

torch::Tensor FusedAdamW::step(LossClosure closure) {
  return stepParameters<torch::optim::AdamW, torch::optim::AdamWOptions>(
      param_groups_, state_, closure,
      [this](const at::Tensor& p, const torch::optim::AdamWOptions& options) {
        return fusedAdamW(p, options, state_);
      });
}

torch::Tensor FusedSgd::step(LossClosure closure) {
  return stepParameters<torch::optim::SGD, torch::optim::SGDOptions>(
      param_groups_, state_, closure,
      [this](const at::Tensor& p, const torch::optim::SGDOptions& options) {
        return fusedSgd(p, options, state_);
      });
}

}  // namespace caravan
