// Activation memory for a run (see memory_setup.h).
#include "train/memory_setup.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <thread>

#include <ATen/Parallel.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/clock.h"
#include "core/errors.h"
#include "core/machine.h"
#include "memory/accounting.h"
#include "memory/tracker.h"
#include "sync/sharding.h"
#include "train/setup.h"

namespace caravan {

namespace {

constexpr int64_t kBandwidthProbeBytes = 64 << 20;

int availableCores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(CPU_COUNT(&set), 1);
  return std::max(static_cast<int>(std::thread::hardware_concurrency()), 1);
}

// The run's optimizer's seconds per weight byte: timed on a copy of the largest block's
// parameters with random gradients (the first step makes the state; the median of three
// after it).
double updateSecondsPerByte(const RunOptions& options, BlockModel& model) {
  std::vector<at::Tensor> largest;
  int64_t bytes = 0;
  for (const auto& ps : blockParameters(model)) {
    if (tensorBytes(ps) > bytes) {
      bytes = tensorBytes(ps);
      largest = ps;
    }
  }
  if (bytes == 0) return 0.0;
  std::vector<at::Tensor> copies;
  {
    at::NoGradGuard noGrad;
    for (const auto& p : largest) {
      at::Tensor c = p.detach().clone().requires_grad_(true);
      c.mutable_grad() = at::randn_like(c);
      copies.push_back(c);
    }
  }
  auto optimizer = makeOptimizer(options.optim, copies);
  std::vector<double> seconds;
  for (int r = 0; r < 4; ++r) {
    at::NoGradGuard noGrad;
    const auto t0 = std::chrono::steady_clock::now();
    optimizer->step();
    if (r > 0) seconds.push_back(secondsSince(t0));
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2] / static_cast<double>(bytes);
}

// What out-of-core weights move and compute per block with `window`, for the planner.
WeightTraffic weightTraffic(BlockModel& model, const WeightOptions& window, double secondsPerByte,
                            int localProcesses) {
  WeightTraffic t;
  const auto blocks = blockParameters(model);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const int64_t w = tensorBytes(blocks[i]);
    t.weightBytes.push_back(i == 0 ? 0 : w);  // block 0 stays in memory
    std::vector<int64_t> pieces;
    if (i > 0) {
      for (int64_t bytes : statePieceBytes(blocks[i], window)) {
        if (bytes > 0) pieces.push_back(bytes);
      }
    }
    t.statePieces.push_back(std::move(pieces));
    t.updateSeconds.push_back(secondsPerByte * static_cast<double>(w));
  }
  t.prefetch = window.prefetch;
  t.overlap = window.overlapUpdates;
  t.updateBacklog = window.updateBacklog;
  t.writesInFlight = window.maxWritesInFlight;
  t.updaterSharesCore =
      std::max(localProcesses, 1) * std::max(at::get_num_threads(), 1) >= availableCores();
  return t;
}

// "prefetch 1, 0 update(s) waiting at most, 1 write(s) in flight, optimizer state in pieces of
// at most 8.0 MiB", for the terminal.
std::string describeWindow(const WeightOptions& w) {
  return fmt::format(
      "prefetch {}, {} update(s) waiting at most, {} write(s) in flight, optimizer state in "
      "pieces of {}",
      w.prefetch, w.updateBacklog, w.maxWritesInFlight,
      w.stateChunkBytes <= 1 ? std::string("one parameter")
                             : "at most " + formatBytes(w.stateChunkBytes));
}

}  // namespace

std::vector<WeightOptions> weightWindows(const RunOptions& options) {
  std::vector<WeightOptions> out;
  WeightOptions o = weightOptions(options);
  out.push_back(o);
  o.maxWritesInFlight = 1;
  out.push_back(o);
  o.updateBacklog = 0;
  out.push_back(o);
  if (o.prefetch > 0) {
    o.prefetch = 0;
    out.push_back(o);
  }
  o.stateChunkBytes = 1;
  out.push_back(o);
  return out;
}

namespace {

// The bytes of the largest block's own trainable parameters (a sharded unit: float32, as its
// gradients), of the largest block's gathered weights (2 bytes an element of those gathered in
// bf16), and of the parameters several blocks read (the shared unit).
struct UnitBytes {
  int64_t largest = 0, gathered = 0, shared = 0;
};
UnitBytes unitBytes(BlockModel& model, const std::set<const c10::TensorImpl*>& bf16Gathered) {
  // The layout ShardedParameters lays (sharedParameters: the shared unit; the rest per block).
  UnitBytes u;
  const std::set<const c10::TensorImpl*> shared = sharedParameters(model);
  for (const auto& block : blockParameters(model)) {
    int64_t own = 0, gathered = 0;
    std::set<const c10::TensorImpl*> seen;  // a module registered twice in the block: once
    for (const auto& p : block) {
      const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
      if (shared.count(impl) == 0 && seen.insert(impl).second) {
        own += tensorBytes({p});
        gathered += gatherBytes({p}, bf16Gathered);
      }
    }
    u.largest = std::max(u.largest, own);
    u.gathered = std::max(u.gathered, gathered);
  }
  std::set<const c10::TensorImpl*> counted;
  for (const auto& p : model->parameters()) {
    const c10::TensorImpl* impl = p.unsafeGetTensorImpl();
    if (p.requires_grad() && shared.count(impl) != 0 && counted.insert(impl).second) {
      u.shared += tensorBytes({p});
    }
  }
  return u;
}

// A sharded worker's model state (sync.shard over options.workers): ZeRO's accounting
// (shardedModelState); under gradients two units' local gradients in flight; under parameters
// two gathered blocks (the one running, the prefetched one; bf16-gathered weights at 2 bytes)
// and one block's local gradients. Out of core (parameters): only those, the slices of two
// units being read or updated, and the shared unit (gathered throughout, its slices in memory).
int64_t shardedPersistentBytes(const RunOptions& options, BlockModel& model, int stateFactor,
                               const std::set<const c10::TensorImpl*>& bf16Gathered) {
  const int w = std::max(1, options.workers);
  const ShardLevel level = options.sync.shard;
  const UnitBytes u = unitBytes(model, bf16Gathered);
  if (level == ShardLevel::kParameters && options.memory.offloadWeights) {
    const int64_t slices = (2 + stateFactor) * (2 * u.largest + u.shared) / w;
    return 2 * u.gathered + u.largest + u.shared + std::max(u.largest, u.shared) + slices;
  }
  const int64_t state =
      shardedModelState(level, tensorBytes(model->parameters()), stateFactor, w).total();
  if (level == ShardLevel::kParameters) return state + 2 * u.gathered + u.largest;
  return state + (level == ShardLevel::kGradients ? 2 * u.largest : 0);
}

}  // namespace

int64_t persistentBytes(const RunOptions& options, BlockModel& model, const WeightOptions& window,
                        const std::set<const c10::TensorImpl*>& bf16Gathered) {
  if (options.sync.shard != ShardLevel::kNone) {
    return shardedPersistentBytes(options, model, window.stateFactor, bf16Gathered);
  }
  if (options.memory.offloadWeights) return OutOfCoreWeights::windowBytes(model, window);
  const int64_t weights = tensorBytes(model->parameters());
  return weights + weights + window.stateFactor * weights;
}

PipelinePlan planPipeline(const RunOptions& options, BlockModel& model, const Batch& sample) {
  const PipelineOptions& o = options.pipeline;
  const PartitionChoice choice = parsePartition(o.partition);
  const PartitionObjective objective = choice.objective;
  PipelinePlan plan;
  const size_t n = model->numBlocks();
  // Refuses more stages than blocks first (as every rank does).
  const std::vector<size_t> even = evenPartition(n, o.stages);
  // A cut fixed in advance (even, given) needs no profile, unless the budget may ask its stages
  // to recompute.
  const std::vector<size_t> fixed = objective == PartitionObjective::kEven ? even
                                    : objective == PartitionObjective::kGiven
                                        ? givenPartition(choice.splits, n, o.stages)
                                        : std::vector<size_t>{};
  if (!fixed.empty() && !(options.memory.automatic() && options.memory.budget > 0)) {
    plan.partition.boundaries = fixed;
    plan.report =
        fmt::format("pipeline: {} stages {} (parallel.partition = {}): boundaries {}\n", o.stages,
                    objective == PartitionObjective::kEven ? "of equal block counts" : "as given",
                    o.partition, fmt::join(plan.partition.boundaries, ","));
    return plan;
  }
  const int64_t micro = sample.size() / o.microBatches;
  const Batch one{sample.input.slice(0, 0, micro), sample.target.slice(0, 0, micro)};
  const ModelProfile profile =
      profileModel(model, one, static_cast<int>(options.memory.profileRepeats));
  const int64_t factor = 2 + weightOptions(options).stateFactor;
  // A tied parameter counts with every block that reads it: a stage holds it (its gradient
  // and optimizer state too) wherever one of them runs (PipelineStage::sumTiedGradients). Two
  // of them on one stage count it twice: the partition errs on the safe side.
  const auto named = model->named_parameters();
  std::vector<int64_t> alsoRead(n, 0);
  for (const auto& use : model->sharedUses()) {
    if (named.contains(use.name)) alsoRead.at(use.user) += tensorBytes({named[use.name]});
  }
  std::vector<int64_t> weights(n);
  for (size_t i = 0; i < n; ++i) {
    weights[i] = tensorBytes(model->block(i).ptr()->parameters()) + alsoRead[i];
  }
  plan.blocks = pipelineBlockCosts(profile, weights, factor);
  // memory.policy = auto: stages may recompute blocks (not zb-h1's: its W reads them again).
  const PipelineSchedule schedule = o.schedule;
  plan.partition = partitionBlocks(
      plan.blocks, o.stages, o.microBatches, schedule, options.memory.budget, objective,
      options.memory.automatic() && schedule != PipelineSchedule::kZeroBubbleH1, fixed);
  plan.report = fmt::format(
      "pipeline: {} stages, {} micro-batches of {} examples, {} (parallel.partition = {}); per "
      "block profiled on one micro-batch\n",
      o.stages, o.microBatches, micro, pipelineScheduleName(o.schedule), o.partition);
  plan.report += formatPartition(plan.blocks, plan.partition, options.memory.budget);
  return plan;
}

std::vector<BlockCost> pipelineBlockCosts(const ModelProfile& profile,
                                          const std::vector<int64_t>& weightBytes,
                                          int64_t stateMultiple) {
  std::vector<BlockCost> costs;
  for (size_t i = 0; i < profile.blocks.size(); ++i) {
    const BlockProfile& b = profile.blocks[i];
    costs.push_back({b.label, b.forwardSeconds, b.backwardSeconds, b.savedBytes,
                     stateMultiple * weightBytes[i], weightBytes[i], b.inputBytes});
  }
  costs.back().backwardSeconds += profile.lossSeconds;
  return costs;
}

ConfigError noPartitionFits(const RunOptions& options, int64_t smallest) {
  const PartitionObjective objective = parsePartition(options.pipeline.partition).objective;
  if (objective == PartitionObjective::kGiven || objective == PartitionObjective::kEven) {
    return ConfigError(fmt::format(
        "memory.budget = {} per worker does not fit the cut parallel.partition = {} into {} "
        "stages; that cut needs at least {} ({} bytes): raise the budget, or let "
        "parallel.partition = auto choose a cut",
        options.memory.budgetText, options.pipeline.partition, options.pipeline.stages,
        formatBytesAtLeast(smallest), smallest));
  }
  return ConfigError(fmt::format(
      "memory.budget = {} per worker fits no partition of the model into {} stages; the "
      "smallest budget one fits is {} ({} bytes): raise it, add stages, or lower "
      "parallel.micro_batches' size (data.batch_size)",
      options.memory.budgetText, options.pipeline.stages, formatBytesAtLeast(smallest), smallest));
}

int64_t smallestPlannedBudget(const Plan& plan, int64_t persistent) {
  return budgetForPlannedPeak(plan.prediction.peakBytes, persistent);
}

void setStagePolicies(ActivationMemory& m, BlockModel& model, std::vector<BlockPolicy> policies,
                      int prefetch) {
  CARAVAN_CHECK(!needsTier(policies), "a stage's policies do not swap");
  m.policies = std::move(policies);
  bool allKeep = true;
  for (BlockPolicy p : m.policies) allKeep = allKeep && p == BlockPolicy::kKeep;
  if (allKeep) return;
  m.executor = std::make_unique<ActivationExecutor>(model, m.policies, nullptr, prefetch);
  m.report += fmt::format("memory policies: {}\n", formatPolicies(m.policies));
}

namespace {

// The tier: when a policy swaps or the weights are out of core, or, when planning, if one can
// be made (the planner may swap; without one it plans keep and recompute only). Only the
// planner uses the bandwidths: fixed policies skip the probe, and so does a run whose planner
// must not swap (`maySwap` false: sync.shard = parameters, where a swapped activation could
// hold a gathered weight), which plans keep and recompute.
void openTier(ActivationMemory& m, const MemoryOptions& o, TierDtype tierDtype, bool planning,
              bool maySwap) {
  if (needsTier(m.policies) || o.offloadWeights) {
    m.tier = makeTier(o.tier, o.swapDir);
    if (!planning) m.report += fmt::format("memory tier: {}\n", m.tier->describe());
  } else if (planning) {
    try {
      m.tier = makeTier(o.tier, o.swapDir);
    } catch (const Error& e) {
      m.report += fmt::format("memory tier unavailable, planning without swap: {}\n", e.what());
    }
  }
  if (planning && m.tier && maySwap) {
    // memory.tier_dtype = bf16: measured through the conversions, in bytes as stored.
    m.bandwidth = m.tier->measure(kBandwidthProbeBytes, tierDtype);
    m.report += fmt::format(
        "memory tier: {}, measured write {:.2f} GB/s, read {:.2f} GB/s{}\n", m.tier->describe(),
        m.bandwidth.writeBytesPerSecond / 1e9, m.bandwidth.readBytesPerSecond / 1e9,
        tierDtype == TierDtype::kBf16 ? " (of bf16 bytes, conversions included: memory.tier_dtype)"
                                      : "");
  }
}

// memory.policy = auto or a budget: the plan (m.plan) of the fastest window that fits.
// Out-of-core weights under a budget: every window is planned, and the one whose fitting plan
// is predicted fastest (to the end of the last update) wins; a smaller one leaves the
// activations more room and waits more for the tier. None fitting: the smallest window's plan
// (the refusal names its budget).
void planWindows(ActivationMemory& m, const RunOptions& options, BlockModel& model, double perByte,
                 int localProcesses) {
  const MemoryOptions& o = options.memory;
  const int64_t budget = o.budget;
  const bool offload = o.offloadWeights && options.sync.shard == ShardLevel::kNone;
  const std::vector<WeightOptions> windows =
      offload && budget > 0 ? weightWindows(options) : std::vector<WeightOptions>{m.weights};
  auto cost = [](const Plan& p) {
    return std::max(p.prediction.stepSeconds, p.prediction.updatesEndSeconds);
  };
  std::optional<WeightTraffic> traffic;
  std::string considered;
  for (size_t k = 0; k < windows.size(); ++k) {
    const WeightOptions& window = windows[k];
    const int64_t persistent = persistentBytes(options, model, window, m.bf16Gathered);
    // The plan aims at 95% of what the budget leaves for activations: the model does not see
    // threads scheduled late on a busy machine (a swap write that lands after the next block's
    // saves; measured: up to 2% over a plan's peak with the tests running two at a time).
    const int64_t activationBudget = budget > 0 ? plannedActivationBudget(budget, persistent) : 0;
    if (offload) traffic = weightTraffic(model, window, perByte, localProcesses);
    // Predicted with the write backpressure the executor applies (attachExecutor): a planned
    // run's executor drains at the plan's budget, so the margin holds while the writes lag too.
    Plan plan =
        planPolicies(*m.profile, m.bandwidth, activationBudget, static_cast<int>(o.prefetch),
                     traffic ? &*traffic : nullptr, activationBudget);
    if (windows.size() > 1) {
      considered += fmt::format(
          "  window {}: {} ({}): {}\n", k + 1, formatBytes(persistent), describeWindow(window),
          plan.fits ? fmt::format("predicted step {:.1f} ms", cost(plan) * 1e3)
                    : std::string("no activation plan fits"));
    }
    const bool better = !m.plan || (plan.fits && (!m.plan->fits || cost(plan) < cost(*m.plan)));
    if (better || (!m.plan->fits && k + 1 == windows.size())) {
      m.weights = window;
      m.persistent = persistent;
      m.plan = std::move(plan);
    }
  }
  if (!considered.empty()) {
    m.report +=
        "out-of-core windows under memory.budget (the fastest that fits is taken):\n" + considered;
  }
}

// Profiles the model and plans (planWindows) or, for caravan plan of a given policy without a
// budget, predicts it; reports the plan. See makeActivationMemory for `alwaysPlan`.
void planActivations(ActivationMemory& m, const RunOptions& options, BlockModel& model,
                     const Batch& sample, TierDtype tierDtype, bool automatic, bool alwaysPlan,
                     int localProcesses) {
  const MemoryOptions& o = options.memory;
  const int64_t budget = o.budget;
  const bool offload = o.offloadWeights && options.sync.shard == ShardLevel::kNone;
  m.profile = profileModel(model, sample, static_cast<int>(o.profileRepeats));
  m.profile->activationsOnTier = tierDtype;
  const double perByte = offload ? updateSecondsPerByte(options, model) : 0.0;
  if (automatic || budget > 0) {
    planWindows(m, options, model, perByte, localProcesses);
  } else {
    // caravan plan of a given policy: predict it.
    std::optional<WeightTraffic> traffic;
    if (offload) traffic = weightTraffic(model, m.weights, perByte, localProcesses);
    Plan p;
    p.policies = m.policies;
    p.prediction = predict(*m.profile, m.policies, m.bandwidth, static_cast<int>(o.prefetch),
                           traffic ? &*traffic : nullptr);
    p.fits = true;
    m.plan = p;
  }
  const int64_t persistent = m.persistent;
  m.report += formatPlan(*m.profile, *m.plan, m.bandwidth, static_cast<int>(o.prefetch));
  m.report +=
      fmt::format("weights, gradients and optimizer state: {}; memory.budget: {}\n",
                  formatBytes(persistent), budget > 0 ? formatBytes(budget) : std::string("none"));
  if (automatic && !alwaysPlan && !m.plan->fits) {
    const int64_t smallest = smallestPlannedBudget(*m.plan, persistent);
    throw ConfigError(fmt::format(
        "memory.budget = {} is below what this model and batch need with the best plan: "
        "activations {} ({}) + weights, gradients and optimizer state {}; the smallest budget "
        "the planner can fit is {} ({} bytes), or lower data.batch_size",
        formatBytes(budget), formatBytes(m.plan->prediction.peakBytes),
        formatPolicies(m.plan->policies), formatBytes(persistent), formatBytesAtLeast(smallest),
        smallest));
  }
  if (automatic) m.policies = m.plan->policies;
}

// The executor, when a block does not keep or the weights are out of core (it turns saved views
// of weights into descriptions, so they do not hold the blobs in memory), with the write
// backpressure under a budget.
void attachExecutor(ActivationMemory& m, const MemoryOptions& o, BlockModel& model,
                    const Batch& sample, TierDtype tierDtype, bool automatic) {
  bool allKeep = true;
  for (BlockPolicy p : m.policies) allKeep = allKeep && p == BlockPolicy::kKeep;
  if (allKeep && !o.offloadWeights) return;
  if (needsTier(m.policies) && !m.tier) {
    m.tier = makeTier(o.tier, o.swapDir);
  }
  m.executor = std::make_unique<ActivationExecutor>(model, m.policies, m.tier.get(),
                                                    static_cast<int>(o.prefetch), tierDtype);
  const int64_t budget = o.budget;
  if (budget > 0 && (m.profile || needsTier(m.policies))) {
    // Fixed swap policies too (one that writes nothing has nothing to wait for, and skips the
    // profiling pass): without a limit, writes slower than forward pile up in memory (all-swap
    // at 50 MB/s grew past its cgroup during its first step, before the budget check after it
    // could refuse the run). Not planned, they are profiled for sizes only (one untimed pass),
    // so the check can look ahead at what each block will save and the peak stays within the
    // limit rather than one block over it.
    const ModelProfile sizes = m.profile ? *m.profile : profileModel(model, sample, 0);
    std::vector<int64_t> saved;
    for (const auto& b : sizes.blocks) saved.push_back(b.savedBytes);
    // The loss's saves join the last block's (its forward follows straight after).
    if (!saved.empty()) saved.back() += sizes.lossSavedBytes;
    // A planned run drains at the budget its plan was fitted to (the plan's margin below the
    // room, as its prediction assumed); a fixed policy at the whole room.
    const double room = static_cast<double>(budget - m.persistent);
    const int64_t limit = static_cast<int64_t>(automatic ? kPlanMargin * room : room);
    m.executor->setActivationLimit(std::max<int64_t>(limit, 1), std::move(saved));
  }
  m.report += fmt::format("memory policies: {}\n", formatPolicies(m.policies));
}

}  // namespace

ActivationMemory makeActivationMemory(const RunOptions& options, BlockModel& model,
                                      const Batch& sample, bool alwaysPlan, int localProcesses) {
  const MemoryOptions& o = options.memory;
  const TierDtype tierDtype = parseTierDtype(o.tierDtype, "memory.tier_dtype");
  ActivationMemory m;
  // A pipeline's partition plans its stages (setStagePolicies); until then every block keeps.
  const std::string policy =
      o.automatic() && options.pipeline.active() && !alwaysPlan ? std::string("keep") : o.policy;
  const bool automatic = policy == "auto";
  if (!automatic) m.policies = parsePolicies(policy, model->numBlocks(), "memory.policy");
  const bool planning = automatic || alwaysPlan;
  // Out-of-core weights of OutOfCoreWeights' kind (a sharded run's slices have their own).
  const bool sharded = options.sync.shard != ShardLevel::kNone;
  openTier(m, o, tierDtype, planning, options.sync.shard != ShardLevel::kParameters);
  m.weights = weightOptions(options);
  if (options.sync.shard == ShardLevel::kParameters) {
    m.bf16Gathered = bf16GatheredParameters(model, sample);
  }
  m.persistent = persistentBytes(options, model, m.weights, m.bf16Gathered);
  if (options.sync.shard == ShardLevel::kParameters && o.budget > 0) {
    // However the state is split, a block runs whole: its weights gathered, then its gradients.
    const UnitBytes u = unitBytes(model, m.bf16Gathered);
    const int64_t block = std::max(u.gathered + u.largest, 2 * u.shared);
    if (o.budget < block) {
      throw ConfigError(fmt::format(
          "memory.budget = {} is below one gathered block under sync.shard = parameters: the "
          "largest block's weights and their gradients take {}; raise memory.budget above that "
          "(activations come on top), or cut the model into smaller blocks",
          o.budgetText, formatBytesAtLeast(block)));
    }
  }
  if (planning) {
    planActivations(m, options, model, sample, tierDtype, automatic, alwaysPlan, localProcesses);
  }
  attachExecutor(m, o, model, sample, tierDtype, automatic);
  if (o.offloadWeights && sharded) {
    m.report += fmt::format(
        "weights, gradients and optimizer state: each worker's slices on the tier, at most {} in "
        "memory (gathered blocks, slices being read or written)\n",
        formatBytes(m.persistent));
  } else if (o.offloadWeights) {
    const WeightWindow w = OutOfCoreWeights::window(model, m.weights);
    m.report += fmt::format(
        "weights, gradients and optimizer state: out of core on the tier, at most {} in memory "
        "(weights {}, optimizer state {}, gradients {}): {}\n",
        formatBytes(w.total), formatBytes(w.weights), formatBytes(w.state),
        formatBytes(w.gradients), describeWindow(m.weights));
  }
  return m;
}

namespace {

// `batch`'s first `rows` examples and, for sequences, first `tokens` positions.
Batch slice(const Batch& batch, int64_t rows, int64_t tokens) {
  auto cut = [&](const at::Tensor& t) {
    at::Tensor out = t.narrow(0, 0, rows);
    if (tokens > 0) out = out.narrow(1, 0, tokens);
    return out.contiguous();
  };
  return Batch{cut(batch.input), cut(batch.target)};
}

// The quadratic through (16, a), (32, b), (64, c), at x (Lagrange's form).
double quadratic(double a, double b, double c, double x) {
  return a * (x - 32) * (x - 64) / 768.0 - b * (x - 16) * (x - 64) / 512.0 +
         c * (x - 16) * (x - 32) / 1536.0;
}

// Each block's input and saved bytes on `batch`'s first `rows` examples at `seqLen` tokens:
// profiled there when seqLen <= 64, else at 16, 32 and 64 tokens and fitted by a quadratic in
// the length, which must also give the sizes at 48; nullopt when it does not.
std::optional<ModelProfile> profileAt(BlockModel& model, const Batch& sample, int64_t rows,
                                      int64_t seqLen) {
  if (seqLen <= 64) return profileModel(model, slice(sample, rows, 0), 0);
  std::map<int, ModelProfile> at;
  for (int tokens : {16, 32, 48, 64}) {
    at[tokens] = profileModel(model, slice(sample, rows, tokens), 0);
  }
  ModelProfile out = at[64];
  // The size at seqLen from those at 16, 32 and 64 tokens, checked at 48; nullopt: not quadratic.
  auto fit = [&](const std::function<int64_t(const ModelProfile&)>& of) -> std::optional<int64_t> {
    const double a = static_cast<double>(of(at[16])), b = static_cast<double>(of(at[32]));
    const double c = static_cast<double>(of(at[64])), check = static_cast<double>(of(at[48]));
    if (std::abs(quadratic(a, b, c, 48) - check) > 0.5) return std::nullopt;
    return std::llround(std::max(0.0, quadratic(a, b, c, static_cast<double>(seqLen))));
  };
  for (size_t i = 0; i < out.blocks.size(); ++i) {
    for (int64_t BlockProfile::*field : {&BlockProfile::inputBytes, &BlockProfile::savedBytes}) {
      const auto v = fit([&](const ModelProfile& p) { return p.blocks[i].*field; });
      if (!v) return std::nullopt;
      out.blocks[i].*field = *v;
    }
  }
  const auto loss = fit([](const ModelProfile& p) { return p.lossSavedBytes; });
  if (!loss) return std::nullopt;
  out.lossSavedBytes = *loss;
  return out;
}

}  // namespace

std::optional<TrainingMemoryEstimate> estimateTrainingMemory(const RunOptions& options,
                                                             BlockModel& model, const Batch& sample,
                                                             int64_t seqLen) {
  const int64_t batch = sample.size();
  if (batch == 0) return std::nullopt;
  // Sizes are linear in the batch (a per-example part and a shared one, such as batch norm's
  // statistics or the causal mask): up to 4 examples measured as they are, else at 2 and 4.
  std::optional<ModelProfile> full = profileAt(model, sample, std::min<int64_t>(batch, 4), seqLen);
  if (!full) return std::nullopt;
  if (batch > 4) {
    const std::optional<ModelProfile> two = profileAt(model, sample, 2, seqLen);
    if (!two) return std::nullopt;
    auto extrapolate = [&](int64_t at2, int64_t at4) {
      const double a = static_cast<double>(at2), b = static_cast<double>(at4);
      return std::llround(std::max(0.0, a + (b - a) / 2.0 * static_cast<double>(batch - 2)));
    };
    for (size_t i = 0; i < full->blocks.size(); ++i) {
      for (int64_t BlockProfile::*field : {&BlockProfile::inputBytes, &BlockProfile::savedBytes}) {
        full->blocks[i].*field = extrapolate(two->blocks[i].*field, full->blocks[i].*field);
      }
    }
    full->lossSavedBytes = extrapolate(two->lossSavedBytes, full->lossSavedBytes);
  }
  // A lower bound: swaps cost no memory in flight at an infinite bandwidth. Infinite, not just
  // large: the profile above is not timed (every block takes 0 s), so a write of any finite
  // length would outlast every forward and count each swapped block's saves as held, keep's
  // peak (a swap run that needed 117 MiB was refused as needing 522 MiB).
  const double inf = std::numeric_limits<double>::infinity();
  const TierBandwidth unbounded{inf, inf};
  const int prefetch = static_cast<int>(options.memory.prefetch);
  int64_t activations = 0;
  if (options.memory.automatic()) {
    int64_t inputs = 0, largest = 0;
    for (const BlockProfile& b : full->blocks) {
      inputs += b.inputBytes;
      largest = std::max(largest, b.savedBytes);
    }
    const Plan smallest = planPolicies(*full, unbounded, 1, prefetch);
    activations = std::max(smallest.prediction.peakBytes, inputs + largest);
  } else {
    const auto policies = parsePolicies(options.memory.policy, model->numBlocks(), "memory.policy");
    activations = predict(*full, policies, unbounded, prefetch).peakBytes;
  }
  // The smallest window out-of-core weights may take (a lower bound).
  return TrainingMemoryEstimate{persistentBytes(options, model, weightWindows(options).back()),
                                activations};
}

void checkTrainingFitsMachine(const RunOptions& options, BlockModel& model, const Batch& sample,
                              int64_t seqLen, int localProcesses) {
  const std::optional<AvailableMemory> room = availableMemory();
  const std::optional<AddressSpaceLeft> address = addressSpaceLeft();
  if (!room && !address) return;
  std::optional<TrainingMemoryEstimate> need;
  if (options.pipeline.stages > 1) {
    // A stage's share is not known before the cut; what every rank holds for certain is the
    // whole model's weights (each builds it), so that is the lower bound compared.
    need = TrainingMemoryEstimate{tensorBytes(model->parameters()), 0};
  } else {
    need = estimateTrainingMemory(options, model, sample, seqLen);
  }
  if (!need) return;
  int64_t total = need->total() * std::max(localProcesses, 1);
  std::string machine;
  if (room && total > room->bytes) {
    machine =
        room->cgroupLimit > 0
            ? fmt::format("{} left under this process's cgroup limit of {}",
                          formatBytes(room->bytes), formatBytes(room->cgroupLimit))
            : fmt::format("{} available on this machine (MemAvailable)", formatBytes(room->bytes));
  } else if (address && need->total() > address->bytes) {  // the limit is this process's own
    total = need->total();
    localProcesses = 1;
    machine = fmt::format("{} of address space this process's limit of {} (ulimit -v) leaves it",
                          formatBytes(address->bytes), formatBytes(address->limit));
  } else {
    return;
  }
  throw ConfigError(fmt::format(
      "this run needs at least {}{} (activations {} at data.batch_size = {}{}, weights, "
      "gradients and optimizer state {}), more than the {}; lower data.batch_size{}{}",
      formatBytes(total),
      localProcesses > 1 ? fmt::format(" for its {} processes on this host", localProcesses) : "",
      formatBytes(need->activations), sample.size(),
      seqLen > 0 ? fmt::format(", data.seq_len = {}", seqLen) : "", formatBytes(need->persistent),
      machine, seqLen > 0 ? " or data.seq_len" : "",
      options.memory.automatic() || options.pipeline.stages > 1
          ? ""
          : ", or set memory.policy = auto with a memory.budget to recompute or swap blocks"));
}

}  // namespace caravan
