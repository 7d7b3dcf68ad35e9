// sync.mode's names and kinds (see sync_mode.h).
#include "sync/sync_mode.h"

#include <fmt/format.h>

#include "core/errors.h"

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

}  // namespace caravan
