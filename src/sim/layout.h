// `parallel.layout = auto` and `caravan plan --cluster`: how to lay a job over W workers, chosen
// from what the simulator predicts for each way (sim/simulator.h) on the profiled workload.
//
// The ways searched, for W workers (K stages x D replicas = W):
//   K > 1  (K divides W, at most the model's blocks): all-reduce between the D replicas of each
//          stage, M micro-batches in {K, 2K, 4K} that divide the batch; the config's schedule
//          and partition.
//   K = 1  a world without server processes: all-reduce with sync.shard none, optimizer,
//          gradients or parameters (D > 1), all-reduce with memory.weights = offload (where the
//          workload profiled it); a world with servers (the config's sync.mode has them): ps-bsp.
//          With parallel.layout_sync = any, also the modes that change the optimisation:
//          local-sgd and gossip (ring), or ps-asp, ps-ssp and osp (fraction searched).
//   What the simulator does not simulate (pipelines with sharding or servers, offload with
//   either) is not searched; each candidate also passes validate() as caravan train would.
//   The precision is the run's: train.precision = auto chooses bf16 per block where this host
//   runs it faster (the profile is taken so). The memory policy is the run's planner's, from the
//   workload's per-block profile (Workload::planner; below).
//
// Memory per worker, as the run plans it:
//   K = 1  the simulator's model state (modelStateBytes: ZeRO's for sync.shard, the offload
//          window) and the planner's plan (memory/planner.h) in kPlanMargin of what the limit
//          leaves (sync.shard = parameters: no swap), its time added to backward;
//   K > 1  the run's partition (pipeline/partition.h partitionBlocks, as planPipeline calls it):
//          each stage's state plus the micro-batches in flight, recomputing blocks where a stage
//          does not fit (not under zb-h1); the cut it makes is the layout's parallel.partition,
//          so the simulation and the run cut there too.
// The limit is memory.budget where set, else and at most the host's memory over its processes.
// Ties in the prediction go to the layout that needs less memory.
//
// Threading: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim/cluster.h"
#include "sim/simulator.h"
#include "train/run_options.h"

namespace caravan::sim {

// parallel.layout_sync: which sync modes the search may choose.
enum class LayoutSync {
  kBsp,  // bsp: every step synchronous (all-reduce, sharded, pipelines; ps-bsp)
  kAny,  // any: also the asynchronous and local modes
};
// ConfigError naming the choices for another name.
LayoutSync parseLayoutSync(const std::string& name);

struct LayoutSpace {
  int workers = 1;  // K x D
  LayoutSync sync = LayoutSync::kBsp;
  int64_t steps = 20;  // simulated per candidate
};

struct LayoutChoice {
  RunOptions job;                 // the config's options laid out this way
  std::vector<std::string> keys;  // the layout as config overrides ("parallel.pipeline_stages=2")
  std::string name;               // label(job)
  SimResult predicted;            // with the planner's policy
  int64_t memoryBytes = 0;        // per worker, with the planner's policy (its largest stage)
  int64_t leastMemoryBytes = 0;   // the smallest limit per worker it fits (the planner's or the
                                  // partition's smallest plan, with the run's margin)
  bool fits = true;               // memoryBytes within the limit (no limit: always)
  std::string policy;             // the planner's policies, counted ("8 keep, 2 recompute")
  std::string reasons;            // one line: the shape, what bounds it, its memory

  // "allreduce+pipeline(2x4): 31.2 ms/step, 410.0 samples/s; <reasons>"
  std::string text() const;
};

struct LayoutSearch {
  int64_t memoryLimit = 0;  // per worker (0: none)
  std::string limitSource;  // what sets it: "memory.budget" or the host's memory
  // Those that fit, fastest first (ties: in the order searched); then those that do not, by
  // least memory.
  std::vector<LayoutChoice> ranked;
  std::vector<std::string> refused;  // "name: why", candidates validate() or the simulator refused

  const LayoutChoice* best() const;  // the first that fits, or nullptr
};

// The processes a cluster holds: on each host as many as its cores run at `threads` each (at
// least one).
int clusterCapacity(const ClusterSpec& cluster, int threads);

// The candidates for `own` (the config's options) on `space.workers` workers, in search order.
// `blocks`: the model's; `batch`: per worker.
std::vector<RunOptions> layoutCandidates(const RunOptions& own, const LayoutSpace& space,
                                         size_t blocks, int64_t batch);

// One precision the search lays the job out in: the workload profiled in it, and the
// train.precision its layouts pin ("": the config's own, no key).
struct PrecisionProfile {
  Workload workload;
  std::string precision;
};

// Simulates and ranks every candidate in each profile (where there are two, each layout's name
// ends in "+<precision>"). ConfigError when a workload lacks the planner's profile (a workload
// file from before it).
LayoutSearch searchLayouts(const std::vector<PrecisionProfile>& profiles, const RunOptions& own,
                           const ClusterSpec& cluster, const LayoutSpace& space);
// In the config's own precision.
LayoutSearch searchLayouts(const Workload& workload, const RunOptions& own,
                           const ClusterSpec& cluster, const LayoutSpace& space);

// The config overrides that lay `own` out as `job` (the keys the search changes): memory.policy
// auto under `memoryBudget` where the planner changes some block, else keep (offloaded weights:
// the config's policy, which the workload's offload profile was planned with).
std::vector<std::string> layoutKeys(const RunOptions& job, int64_t memoryBudget);

}  // namespace caravan::sim
