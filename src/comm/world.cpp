// Launcher environments -> WorldInfo (see world.h).
#include "comm/world.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstdio>

#include <fmt/format.h>

#include "core/errors.h"

extern char** environ;

namespace caravan {
namespace {

std::string get(const Environment& env, const std::string& key) {
  auto it = env.find(key);
  return it == env.end() ? "" : it->second;
}

int parseInt(const Environment& env, const std::string& key, int min, int max) {
  const std::string v = get(env, key);
  size_t used = 0;
  long x = 0;
  try {
    x = std::stol(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != v.size() || x < min || x > max) {
    throw ConfigError(fmt::format("environment variable {}={} is not an integer in {}..{}; fix "
                                  "the launcher settings",
                                  key, v, min, max));
  }
  return static_cast<int>(x);
}

}  // namespace

Environment processEnvironment() {
  Environment env;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return env;
}

int slurmTasksOnNode(const std::string& tasksPerNode, int node) {
  // Groups "N" or "N(xM)" (M nodes of N tasks each), comma-separated, in node order.
  size_t at = 0;
  int first = 0;  // the group's first node
  while (at < tasksPerNode.size()) {
    const size_t end = std::min(tasksPerNode.find(',', at), tasksPerNode.size());
    const std::string group = tasksPerNode.substr(at, end - at);
    int tasks = 0, nodes = 1;
    char close = 0;
    const int fields = std::sscanf(group.c_str(), "%d(x%d%c", &tasks, &nodes, &close);
    const bool plain = fields == 1 && group == std::to_string(tasks);
    const bool repeated = fields == 3 && close == ')' && group.back() == ')';
    if ((!plain && !repeated) || tasks < 1 || nodes < 1) return 0;
    if (node < first + nodes) return tasks;
    first += nodes;
    at = end + 1;
  }
  return 0;
}

std::string firstSlurmHost(const std::string& nodeList) {
  // The first entry ends at a comma outside brackets.
  std::string first;
  int depth = 0;
  for (char c : nodeList) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (c == ',' && depth == 0) break;
    first.push_back(c);
  }
  auto open = first.find('[');
  if (open == std::string::npos) return first;
  // prefix[03-05,7] -> prefix03
  std::string prefix = first.substr(0, open);
  std::string range = first.substr(open + 1);
  std::string head;
  for (char c : range) {
    if (c == '-' || c == ',' || c == ']') break;
    head.push_back(c);
  }
  return prefix + head;
}

WorldInfo worldFromEnvironment(const Environment& env) {
  WorldInfo w;
  constexpr int kMaxWorld = 1 << 20;
  if (!get(env, "RANK").empty() || !get(env, "WORLD_SIZE").empty()) {
    w.launcher = get(env, "CARAVAN_LAUNCHER") == "caravan" ? "caravan" : "torchrun";
    w.worldSize = parseInt(env, "WORLD_SIZE", 1, kMaxWorld);
    w.rank = parseInt(env, "RANK", 0, kMaxWorld);
    w.localRank = get(env, "LOCAL_RANK").empty() ? w.rank : parseInt(env, "LOCAL_RANK", 0, kMaxWorld);
    w.localWorldSize =
        get(env, "LOCAL_WORLD_SIZE").empty() ? 1 : parseInt(env, "LOCAL_WORLD_SIZE", 1, kMaxWorld);
  } else if (!get(env, "OMPI_COMM_WORLD_RANK").empty()) {
    w.launcher = "openmpi";
    w.worldSize = parseInt(env, "OMPI_COMM_WORLD_SIZE", 1, kMaxWorld);
    w.rank = parseInt(env, "OMPI_COMM_WORLD_RANK", 0, kMaxWorld);
    w.localRank = get(env, "OMPI_COMM_WORLD_LOCAL_RANK").empty()
                      ? w.rank
                      : parseInt(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, kMaxWorld);
    w.localWorldSize = get(env, "OMPI_COMM_WORLD_LOCAL_SIZE").empty()
                           ? 1
                           : parseInt(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, kMaxWorld);
  } else if (!get(env, "SLURM_PROCID").empty()) {
    w.launcher = "slurm";
    w.worldSize = parseInt(env, "SLURM_NTASKS", 1, kMaxWorld);
    w.rank = parseInt(env, "SLURM_PROCID", 0, kMaxWorld);
    w.localRank = get(env, "SLURM_LOCALID").empty() ? 0 : parseInt(env, "SLURM_LOCALID", 0, kMaxWorld);
    // This node's tasks (OpenMP's waits depend on it, core/openmp_env.h): the step's count per
    // node (srun), else the job's; unknown: as if alone.
    std::string perNode = get(env, "SLURM_STEP_TASKS_PER_NODE");
    if (perNode.empty()) perNode = get(env, "SLURM_TASKS_PER_NODE");
    const int node =
        get(env, "SLURM_NODEID").empty() ? 0 : parseInt(env, "SLURM_NODEID", 0, kMaxWorld);
    w.localWorldSize = std::max(1, slurmTasksOnNode(perNode, node));
    std::string nodes = get(env, "SLURM_STEP_NODELIST");
    if (nodes.empty()) nodes = get(env, "SLURM_JOB_NODELIST");
    if (nodes.empty()) nodes = get(env, "SLURM_NODELIST");
    if (!nodes.empty()) w.masterAddr = firstSlurmHost(nodes);
  } else {
    return w;
  }
  if (w.rank >= w.worldSize) {
    throw ConfigError(fmt::format("rank {} is outside a world of {} ({} launcher variables); fix "
                                  "the launcher settings",
                                  w.rank, w.worldSize, w.launcher));
  }
  if (!get(env, "MASTER_ADDR").empty()) w.masterAddr = get(env, "MASTER_ADDR");
  if (!get(env, "MASTER_PORT").empty()) w.masterPort = parseInt(env, "MASTER_PORT", 1, 65535);
  w.token = get(env, kJobTokenVariable);
  w.start = get(env, kJobStartVariable);
  if (!get(env, kStoreFdVariable).empty() && w.rank == 0) {
    w.storeFd = parseInt(env, kStoreFdVariable, 0, INT_MAX);
  }
  return w;
}

}  // namespace caravan
