// sync.mode as a type: how data-parallel workers keep their replicas together. Parsed once
// (parseSyncMode, in RunOptions::read and the simulator's workload reader); every later decision
// is a switch over SyncMode, which the compiler checks for completeness, and the name comes back
// only in messages (syncModeName).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace caravan {

enum class SyncMode {
  kAllReduce,  // allreduce: bucketed gradient all-reduce after every step (DDP)
  kLocalSgd,   // local-sgd: local steps, parameters averaged every sync.local_period
  kDiloco,     // diloco: inner steps, an outer step on the averaged change every period
  kGossip,     // gossip: each step averages with one neighbour
  kPsBsp,      // ps-bsp: parameter servers, every worker's gradient in each step
  kPsAsp,      // ps-asp: parameter servers, each worker's gradient applied as it comes
  kPsSsp,      // ps-ssp: parameter servers, workers at most sync.staleness steps apart
  kPsDiloco,   // ps-diloco: diloco's outer step on parameter servers
  kOsp,        // osp: servers; a fraction synchronised at once, the rest overlapped (OSP)
};

// Every mode, in the order of the schema's list.
inline constexpr SyncMode kSyncModes[] = {
    SyncMode::kAllReduce, SyncMode::kLocalSgd, SyncMode::kDiloco,
    SyncMode::kGossip,    SyncMode::kPsBsp,    SyncMode::kPsAsp,
    SyncMode::kPsSsp,     SyncMode::kPsDiloco, SyncMode::kOsp};

// The config's name of `mode` ("allreduce", "ps-bsp", ...).
const char* syncModeName(SyncMode mode);
// The mode named `name`; ConfigError naming the modes when there is none.
SyncMode parseSyncMode(std::string_view name);

// sync.shard: what data-parallel workers split among themselves (ZeRO's stages).
enum class ShardLevel {
  kNone,        // none: every worker holds everything (plain data parallelism)
  kOptimizer,   // optimizer: the optimizer state (ZeRO-1)
  kGradients,   // gradients: and the averaged gradients (ZeRO-2)
  kParameters,  // parameters: and the weights, gathered per block as it runs (ZeRO-3, FSDP)
};
inline constexpr ShardLevel kShardLevels[] = {ShardLevel::kNone, ShardLevel::kOptimizer,
                                              ShardLevel::kGradients, ShardLevel::kParameters};
const char* shardLevelName(ShardLevel level);
// The level named `name`; ConfigError naming the levels when there is none.
ShardLevel parseShardLevel(std::string_view name);

// ZeRO's accounting of the model state a worker holds (bytes), from the parameters' bytes
// (float32), the optimizer's state per weight byte (AdamW 2, SGD with momentum 1) and W.
// Units' padding and the gathered blocks of `parameters` are not counted.
struct ModelStateBytes {
  int64_t weights = 0, gradients = 0, optimizerState = 0;
  int64_t total() const { return weights + gradients + optimizerState; }
};
ModelStateBytes shardedModelState(ShardLevel level, int64_t parameterBytes, int stateFactor,
                                  int workers);

// The bytes a data-parallel worker sends per step at `level` over a ring of `workers`, for
// `parameterBytes` of float32 gradients: an all-reduce 2 (W-1)/W P; a reduce-scatter and an
// all-gather the same; parameters a second all-gather, 3 (W-1)/W P (the engine keeps the last
// block between its forward and backward: one block's gather less).
int64_t shardedBytesPerStep(ShardLevel level, int64_t parameterBytes, int workers);
// `caravan plan`'s table: each level's model state per worker (ZeRO's accounting, parameters
// with two gathered blocks of `largestBlockBytes`) and bytes sent per step, for each of
// `workers`.
std::string shardingReport(int64_t parameterBytes, int stateFactor, int64_t largestBlockBytes,
                           const std::vector<int>& workers);

// Whether `mode` runs parameter servers beside the workers (ps-*, osp).
bool usesServers(SyncMode mode);
// ps-bsp, ps-asp, ps-ssp: servers apply the workers' gradients with the run's optimizer under
// a consistency model (parameter_server.h).
bool isConsistencyMode(SyncMode mode);
// Whether the run's optimizer steps on the servers (ps-bsp/asp/ssp, osp), so the workers
// never see the update before it is applied; ps-diloco's servers run only the outer step.
bool stepsOnServers(SyncMode mode);
// diloco, ps-diloco: inner steps of the run's optimizer, outer steps every sync.local_period.
bool isDiloco(SyncMode mode);

}  // namespace caravan
