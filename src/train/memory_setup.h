// Activation memory for a run, from its memory options: the tier (and its measured bandwidth),
// the per-block policies (given, or planned under memory.budget when memory.policy = auto)
// and the executor that applies them. Shared by `caravan train` and `caravan plan`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "data/dataset.h"
#include "memory/executor.h"
#include "memory/planner.h"
#include "memory/tier.h"
#include "memory/weights.h"
#include "models/model.h"
#include "train/run_options.h"

namespace caravan {

// Weights + gradients + optimizer state the run will hold from its first step on (what the
// activations share memory.budget with); with out-of-core weights, the most of them that will
// be in memory at once (OutOfCoreWeights::windowBytes).
int64_t persistentBytes(const RunOptions& options, BlockModel& model);

struct ActivationMemory {
  std::vector<BlockPolicy> policies;
  std::unique_ptr<Tier> tier;  // when a policy swaps (or the planner may swap), or weights offload
  TierBandwidth bandwidth;
  std::optional<ModelProfile> profile;  // when planned
  std::optional<Plan> plan;
  std::unique_ptr<ActivationExecutor> executor;  // nullptr when every block keeps in core
  std::string report;                            // lines for the terminal
};

// `plan`: profile and plan even if memory.policy is not auto, and return a plan that does not
// fit instead of throwing (caravan plan). `sample`: a batch like the run's (for profiling).
// Throws ConfigError when memory.policy = auto and no plan fits memory.budget, naming the
// smallest budget the planner can fit.
ActivationMemory makeActivationMemory(const RunOptions& options, BlockModel& model,
                                      const Batch& sample, bool plan);

}  // namespace caravan
