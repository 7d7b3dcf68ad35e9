// Activation memory for a run, from its memory options: the tier (and its measured bandwidth),
// the per-block policies (given, or planned under memory.budget when memory.policy = auto)
// and the executor that applies them. Shared by `caravan train` and `caravan plan`.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "data/dataset.h"
#include "memory/executor.h"
#include "memory/planner.h"
#include "memory/tier.h"
#include "memory/weights.h"
#include "models/model.h"
#include "pipeline/partition.h"
#include "train/run_options.h"

namespace caravan {

// Weights + gradients + optimizer state the run will hold from its first step on (what the
// activations share memory.budget with); with out-of-core weights, the most of them that will
// be in memory at once in `window` (OutOfCoreWeights::windowBytes). `bf16Gathered`
// (sync.shard = parameters; sync/sharding.h's bf16GatheredParameters): the weights gathered in
// bf16, 2 bytes an element.
int64_t persistentBytes(const RunOptions& options, BlockModel& model, const WeightOptions& window,
                        const std::set<const c10::TensorImpl*>& bf16Gathered = {});

// The windows out-of-core weights may run with, the largest (and the least waiting for the
// tier) first: the configured prefetch with two blocks' updates in flight and two pieces being
// written; then one piece written at a time; then each update finished before backward enters
// the next block; then no prefetch; then the optimizer state moved one parameter at a time.
// Under memory.budget each is planned and the run takes the one whose fitting activation plan
// is predicted fastest (to the end of the last update; WeightTraffic), printing every one.
std::vector<WeightOptions> weightWindows(const RunOptions& options);

// How parallel.pipeline_stages cuts the model (pipeline/partition.h): unless parallel.partition
// = even, each block is profiled on one micro-batch of `sample` (its first batch / M examples;
// memory.profile_repeats), its state bytes are weights + gradients + optimizer state, and the
// partition minimises the slowest stage under memory.budget (per worker).
struct PipelinePlan {
  std::vector<BlockCost> blocks;  // empty for even
  Partition partition;
  std::string report;  // the table `caravan plan` prints
};
PipelinePlan planPipeline(const RunOptions& options, BlockModel& model, const Batch& sample);
// The blocks as the partition costs them: each profiled block's times, saves and input (one
// micro-batch), its weights (`weightBytes`, per block) times `stateMultiple` (weights, gradients
// and optimizer state: 2 + the state per weight byte) as state, and the loss's time with the last
// block's backward (it runs on the last stage, and is not recomputed with the block).
std::vector<BlockCost> pipelineBlockCosts(const ModelProfile& profile,
                                          const std::vector<int64_t>& weightBytes,
                                          int64_t stateMultiple);
// The refusal when no cut fits memory.budget; `smallest`: the smallest budget one fits.
ConfigError noPartitionFits(const RunOptions& options, int64_t smallest);

struct ActivationMemory {
  std::vector<BlockPolicy> policies;
  std::unique_ptr<Tier> tier;  // when a policy swaps (or the planner may swap), or weights offload
  TierBandwidth bandwidth;
  std::optional<ModelProfile> profile;  // when planned
  std::optional<Plan> plan;
  std::unique_ptr<ActivationExecutor> executor;  // nullptr when every block keeps in core
  std::string report;                            // lines for the terminal
  WeightOptions weights;   // the window of out-of-core weights (memory.weights = offload)
  int64_t persistent = 0;  // persistentBytes with that window
  // sync.shard = parameters: the weights gathered in bf16 (sync/sharding.h), counted so above.
  std::set<const c10::TensorImpl*> bf16Gathered;
};

// What training this run needs at least, in memory it does not hold yet: weights, gradients and
// optimizer state (persistentBytes) and the activation peak of its memory.policy (for auto: the
// smallest plan's, or what profiling at full size needs, whichever is more; swaps counted at an
// unbounded bandwidth). Measured where it costs little even when the run itself could not fit:
// every size is linear in the batch (measured at 2 and 4 examples, or at the batch when it is
// at most 4) and, for sequences (`seqLen` > 64), quadratic in the length (measured at 16, 32
// and 64 tokens, checked at 48). For the built-in models it equals the profile of the whole
// batch (TrainingMemoryEstimate.EqualsTheProfileOfTheWholeBatch). nullopt when the sizes do
// not follow the quadratic (then nothing is claimed).
struct TrainingMemoryEstimate {
  int64_t persistent = 0;
  int64_t activations = 0;
  int64_t total() const { return persistent + activations; }
};
std::optional<TrainingMemoryEstimate> estimateTrainingMemory(const RunOptions& options,
                                                             BlockModel& model, const Batch& sample,
                                                             int64_t seqLen);

// Refuses (ConfigError) a run whose estimate, for each of the `localProcesses` that train on
// this host, is more than the machine leaves (core/machine.h: MemAvailable or the cgroup's
// limit), with the estimate and what to lower; the kernel would otherwise kill it mid-run. A
// lower bound is compared, so no run that fits is refused (pipeline stages: the whole model's
// weights, which every rank holds; a stage's activations are not known before the cut).
void checkTrainingFitsMachine(const RunOptions& options, BlockModel& model, const Batch& sample,
                              int64_t seqLen, int localProcesses);

// The smallest memory.budget under which the planner accepts `plan` (it aims at a margin
// below what a budget leaves for activations).
int64_t smallestPlannedBudget(const Plan& plan, int64_t persistent);
// A pipeline stage's policies from the partition (memory.policy = auto): an executor when a
// block does not keep (recompute only: stages do not swap).
void setStagePolicies(ActivationMemory& m, BlockModel& model, std::vector<BlockPolicy> policies,
                      int prefetch);
// `alwaysPlan`: profile and plan even if memory.policy is not auto, and return a plan that does
// not fit instead of throwing (caravan plan, the simulator). `sample`: a batch like the run's
// (for profiling). Throws ConfigError when memory.policy = auto and no plan fits memory.budget,
// naming the smallest budget the planner can fit. Pipelines with memory.policy = auto start
// with every block keeping (unless `alwaysPlan`): the partition chooses the stages' policies
// (setStagePolicies). `localProcesses`: the processes training on this host (whether the
// weights' updater has a core of its own, for the prediction).
ActivationMemory makeActivationMemory(const RunOptions& options, BlockModel& model,
                                      const Batch& sample, bool alwaysPlan, int localProcesses = 1);

}  // namespace caravan
