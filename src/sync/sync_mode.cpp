// sync.mode's names and kinds (see sync_mode.h).
#include "sync/sync_mode.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/errors.h"
#include "memory/tracker.h"

namespace caravan {

const char* syncModeName(SyncMode mode) {
  switch (mode) {
    case SyncMode::kAllReduce: return "allreduce";
    case SyncMode::kLocalSgd: return "local-sgd";
    case SyncMode::kDiloco: return "diloco";
    case SyncMode::kGossip: return "gossip";
    case SyncMode::kPsBsp: return "ps-bsp";
    case SyncMode::kPsAsp: return "ps-asp";
    case SyncMode::kPsSsp: return "ps-ssp";
    case SyncMode::kPsDiloco: return "ps-diloco";
    case SyncMode::kOsp: return "osp";
  }
  return "?";
}

SyncMode parseSyncMode(std::string_view name) {
  std::string names;
  for (SyncMode m : kSyncModes) {
    if (name == syncModeName(m)) return m;
    names += names.empty() ? "" : ", ";
    names += syncModeName(m);
  }
  throw ConfigError(fmt::format("sync.mode = {} is not a mode; use one of {}", name, names));
}

bool usesServers(SyncMode mode) {
  switch (mode) {
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp:
    case SyncMode::kPsDiloco:
    case SyncMode::kOsp: return true;
    case SyncMode::kAllReduce:
    case SyncMode::kLocalSgd:
    case SyncMode::kDiloco:
    case SyncMode::kGossip: return false;
  }
  return false;
}

bool isConsistencyMode(SyncMode mode) {
  switch (mode) {
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp: return true;
    case SyncMode::kAllReduce:
    case SyncMode::kLocalSgd:
    case SyncMode::kDiloco:
    case SyncMode::kGossip:
    case SyncMode::kPsDiloco:
    case SyncMode::kOsp: return false;
  }
  return false;
}

bool stepsOnServers(SyncMode mode) { return isConsistencyMode(mode) || mode == SyncMode::kOsp; }

bool isDiloco(SyncMode mode) { return mode == SyncMode::kDiloco || mode == SyncMode::kPsDiloco; }

const char* shardLevelName(ShardLevel level) {
  switch (level) {
    case ShardLevel::kNone: return "none";
    case ShardLevel::kOptimizer: return "optimizer";
    case ShardLevel::kGradients: return "gradients";
    case ShardLevel::kParameters: return "parameters";
  }
  return "?";
}

ShardLevel parseShardLevel(std::string_view name) {
  for (ShardLevel l : kShardLevels) {
    if (name == shardLevelName(l)) return l;
  }
  throw ConfigError(fmt::format(
      "sync.shard = \"{}\" is not a level; use none, optimizer, gradients or parameters", name));
}

ModelStateBytes shardedModelState(ShardLevel level, int64_t parameterBytes, int stateFactor,
                                  int workers) {
  const int64_t p = parameterBytes, w = std::max(1, workers);
  ModelStateBytes b;
  b.weights = level == ShardLevel::kParameters ? p / w : p;
  b.gradients = level == ShardLevel::kGradients || level == ShardLevel::kParameters ? p / w : p;
  b.optimizerState = level == ShardLevel::kNone ? stateFactor * p : stateFactor * p / w;
  return b;
}

int64_t shardedBytesPerStep(ShardLevel level, int64_t parameterBytes, int workers) {
  const int64_t w = std::max(1, workers);
  const int64_t ring = parameterBytes * (w - 1) / w;  // one reduce-scatter or all-gather
  return level == ShardLevel::kParameters ? 3 * ring : 2 * ring;
}

std::string shardingReport(int64_t parameterBytes, int stateFactor, int64_t largestBlockBytes,
                           const std::vector<int>& workers) {
  std::string out =
      "data parallel, per worker (sync.shard; model state by ZeRO's accounting, "
      "sent per step over a ring):\n";
  out += fmt::format("  {:<11}", "workers");
  for (int w : workers) out += fmt::format(" | {:>25}", fmt::format("W = {}", w));
  out += "\n";
  for (ShardLevel level : kShardLevels) {
    out += fmt::format("  {:<11}", shardLevelName(level));
    for (int w : workers) {
      int64_t state = shardedModelState(level, parameterBytes, stateFactor, w).total();
      if (level == ShardLevel::kParameters) state += 2 * largestBlockBytes;
      out += fmt::format(" | {:>9} sends {:>9}", formatBytes(state),
                         formatBytes(shardedBytesPerStep(level, parameterBytes, w)));
    }
    out += "\n";
  }
  return out;
}

}  // namespace caravan
