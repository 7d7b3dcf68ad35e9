// Activation memory for a run (see memory_setup.h).
#include "train/memory_setup.h"

#include <fmt/format.h>

#include "core/errors.h"
#include "memory/accounting.h"
#include "memory/tracker.h"

namespace caravan {

namespace {

constexpr int64_t kBandwidthProbeBytes = 64 << 20;
constexpr double kPlanMargin = 0.95;

}  // namespace

int64_t persistentBytes(const RunOptions& options, BlockModel& model) {
  const WeightOptions o = weightOptions(options);
  if (options.memory.offloadWeights) return OutOfCoreWeights::windowBytes(model, o);
  const int64_t weights = tensorBytes(model->parameters());
  return weights + weights + o.stateFactor * weights;
}

ActivationMemory makeActivationMemory(const RunOptions& options, BlockModel& model,
                                      const Batch& sample, bool plan) {
  const MemoryOptions& o = options.memory;
  ActivationMemory m;
  const std::string& policy = o.policy;
  const bool automatic = o.automatic();
  const int prefetch = static_cast<int>(o.prefetch);
  const size_t n = model->numBlocks();
  if (!automatic) m.policies = parsePolicies(policy, n, "memory.policy");
  const bool planning = automatic || plan;
  const bool offload = o.offloadWeights;
  if (needsTier(m.policies) || offload) {
    m.tier = makeTier(o.tier, o.swapDir);
    if (!planning) m.report += fmt::format("memory tier: {}\n", m.tier->describe());
  } else if (planning) {
    // The planner may swap if there is a tier; without one it plans keep and recompute only.
    try {
      m.tier = makeTier(o.tier, o.swapDir);
    } catch (const Error& e) {
      m.report += fmt::format("memory tier unavailable, planning without swap: {}\n", e.what());
    }
  }
  if (planning && m.tier) {
    // Only the planner uses the bandwidths: fixed policies skip the probe.
    m.bandwidth = m.tier->measure(kBandwidthProbeBytes);
    m.report += fmt::format("memory tier: {}, measured write {:.2f} GB/s, read {:.2f} GB/s\n",
                            m.tier->describe(), m.bandwidth.writeBytesPerSecond / 1e9,
                            m.bandwidth.readBytesPerSecond / 1e9);
  }
  if (planning) {
    const int64_t budget = o.budget;
    const int64_t persistent = persistentBytes(options, model);
    m.profile = profileModel(model, sample, static_cast<int>(o.profileRepeats));
    // The plan aims at 95% of what the budget leaves for activations: the model does not see
    // threads scheduled late on a busy machine (a swap write that lands after the next block's
    // saves; measured: up to 2% over a plan's peak with the tests running two at a time).
    const double room = kPlanMargin * static_cast<double>(budget - persistent);
    const int64_t activationBudget =
        budget > 0 ? std::max<int64_t>(static_cast<int64_t>(room), 1) : 0;
    if (automatic || budget > 0) {
      m.plan = planPolicies(*m.profile, m.bandwidth, activationBudget, prefetch);
    } else {
      // caravan plan of a given policy: predict it.
      Plan p;
      p.policies = m.policies;
      p.prediction = predict(*m.profile, m.policies, m.bandwidth, prefetch);
      p.fits = true;
      m.plan = p;
    }
    m.report += formatPlan(*m.profile, *m.plan, m.bandwidth, prefetch);
    m.report += fmt::format("weights, gradients and optimizer state: {}; memory.budget: {}\n",
                            formatBytes(persistent),
                            budget > 0 ? formatBytes(budget) : std::string("none"));
    if (automatic && !plan && !m.plan->fits) {
      const int64_t smallest = m.plan->prediction.peakBytes + persistent;
      throw ConfigError(fmt::format(
          "memory.budget = {} is below what this model and batch need with the best plan: "
          "activations {} ({}) + weights, gradients and optimizer state {}; the smallest budget "
          "the planner can fit is {} ({} bytes), or lower data.batch_size",
          formatBytes(budget), formatBytes(m.plan->prediction.peakBytes),
          formatPolicies(m.plan->policies), formatBytes(persistent), formatBytes(smallest),
          smallest));
    }
    if (automatic) m.policies = m.plan->policies;
  }
  bool allKeep = true;
  for (BlockPolicy p : m.policies) allKeep = allKeep && p == BlockPolicy::kKeep;
  // Out-of-core weights need the executor even when every block keeps: it turns saved views of
  // weights into descriptions, so they do not hold the blobs in memory.
  if (!allKeep || offload) {
    if (needsTier(m.policies) && !m.tier) {
      m.tier = makeTier(o.tier, o.swapDir);
    }
    m.executor = std::make_unique<ActivationExecutor>(model, m.policies, m.tier.get(), prefetch);
    const int64_t budget = o.budget;
    if (budget > 0 && m.profile) {
      std::vector<int64_t> saved;
      for (const auto& b : m.profile->blocks) saved.push_back(b.savedBytes);
      m.executor->setActivationLimit(std::max<int64_t>(budget - persistentBytes(options, model), 1),
                                     std::move(saved));
    }
    m.report += fmt::format("memory policies: {}\n", formatPolicies(m.policies));
  }
  if (offload) {
    m.report += fmt::format(
        "weights, gradients and optimizer state: out of core on the tier, at most {} in memory\n",
        formatBytes(persistentBytes(options, model)));
  }
  return m;
}

}  // namespace caravan
