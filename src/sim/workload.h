// What `caravan simulate` measures of a job on this host before it simulates a cluster
// (sim/simulator.h): one worker's step, block by block, as the memory planner profiles it.
// Threading: the caller's thread (it runs the model).
#pragma once

#include "sim/simulator.h"
#include "train/run_options.h"

namespace caravan {
class Config;
}

namespace caravan::sim {

// Profiles the config's model on its first batch (memory/planner.h profileModel, median of
// memory.profile_repeats) in the config's train.precision (bf16: the blocks a run would choose)
// at the config's threads (one when 0), times the optimizer's step over
// every parameter, and takes the activation peak the run's memory plan predicts (memory.policy,
// memory.budget) with the weights in core; then the same run with memory.weights = offload as
// its planner predicts it (Workload::offload; not measured where it cannot be planned, unless
// the config offloads). Applies the config's runtime options to this process.
Workload measureWorkload(const Config& config);

// A workload as JSON (`caravan simulate -o DIR` writes DIR/workload.json; --workload reads it
// back instead of profiling again). Written as caravan-workload-2; read: 2, or 1 (before
// gradient_bytes: Workload::gradientBytes left empty, each block's parameters one tensor).
// fromJson: ConfigError naming `source` for a missing or bad field.
std::string workloadJson(const Workload& w);
Workload workloadFromJson(const std::string& text, const std::string& source);

// ConfigError naming `source` when `w` was not profiled from the config's model (another
// model, or the same one at another size: its blocks' parameter bytes differ). Builds the model.
void checkWorkloadIsTheConfigs(const Workload& w, const Config& config, const std::string& source);

// Per block of `model`: the bytes of each of its parameters that takes a gradient, in
// registration order (Workload::gradientBytes; the parameters AllReduceStrategy buckets).
std::vector<std::vector<int64_t>> blockGradientBytes(BlockModelImpl& model);

}  // namespace caravan::sim
