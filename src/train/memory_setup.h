// Activation memory for a run, from the memory.* keys: the tier (and its measured bandwidth),
// the per-block policies (given, or planned under memory.budget when memory.policy = auto)
// and the executor that applies them. Shared by `caravan train` and `caravan plan`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "core/config.h"
#include "data/dataset.h"
#include "memory/executor.h"
#include "memory/planner.h"
#include "memory/tier.h"
#include "models/model.h"

namespace caravan {

// Weights + gradients + optimizer state the run will hold from its first step on (what the
// activations share memory.budget with).
int64_t persistentBytes(const Config& config, BlockModel& model);

struct ActivationMemory {
  std::vector<BlockPolicy> policies;
  std::unique_ptr<Tier> tier;  // when a policy swaps (or the planner may swap)
  TierBandwidth bandwidth;
  std::optional<ModelProfile> profile;  // when planned
  std::optional<Plan> plan;
  std::unique_ptr<ActivationExecutor> executor;  // nullptr when every block keeps
  std::string report;                            // lines for the terminal
};

// `plan`: profile and plan even if memory.policy is not auto, and return a plan that does not
// fit instead of throwing (caravan plan). `sample`: a batch like the run's (for profiling).
// Throws ConfigError when memory.policy = auto and no plan fits memory.budget, naming the
// smallest budget the planner can fit.
ActivationMemory makeActivationMemory(const Config& config, BlockModel& model,
                                      const Batch& sample, bool plan);

}  // namespace caravan
