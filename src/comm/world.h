// Who this process is in a job: rank, world size and where the rendezvous store lives, read
// from the environment of whichever launcher started it (caravan's own, torchrun, Slurm or
// Open MPI). Pure functions of an environment map, so every launcher is unit-testable.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace caravan {

struct WorldInfo {
  int rank = 0;
  int worldSize = 1;
  int localRank = 0;
  // Ranks on this host (LOCAL_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_SIZE, Slurm's
  // SLURM_STEP_TASKS_PER_NODE or SLURM_TASKS_PER_NODE at SLURM_NODEID).
  int localWorldSize = 1;
  std::string masterAddr = "127.0.0.1";
  int masterPort = 29500;
  std::string launcher = "none";  // none | caravan | torchrun | slurm | openmpi
  // The job's secret (CARAVAN_JOB_TOKEN; `--workers` makes one): a process without it cannot
  // use the rendezvous store nor complete a connection to a rank. Empty: not authenticated.
  std::string token;
  // One start of a job (CARAVAN_JOB_START, a fresh value for each start of `caravan train
  // --workers`, restarts included): a file store, which outlives its job, keeps each start's
  // keys apart under it. Empty: none given (other launchers).
  std::string start;
  // Rank 0's rendezvous socket, already listening on masterAddr:masterPort (CARAVAN_STORE_FD,
  // which `caravan train --workers` sets for its rank 0, so the port is held from the moment it
  // is picked). -1: rank 0 binds masterPort itself.
  int storeFd = -1;
};

// The variable that carries rank 0's listening socket (WorldInfo::storeFd).
inline constexpr const char* kStoreFdVariable = "CARAVAN_STORE_FD";

// The variable that carries a start's identity (WorldInfo::start).
inline constexpr const char* kJobStartVariable = "CARAVAN_JOB_START";

// The variable that carries the job token (never a config key: config.toml is written out).
inline constexpr const char* kJobTokenVariable = "CARAVAN_JOB_TOKEN";

using Environment = std::map<std::string, std::string>;

// The current process environment as a map.
Environment processEnvironment();

// Reads the launcher variables, in this order of precedence: torchrun-style RANK/WORLD_SIZE
// (also what `caravan train --workers N` sets), Open MPI's OMPI_COMM_WORLD_*, Slurm's
// SLURM_PROCID/SLURM_NTASKS (master = first host of SLURM_STEP_NODELIST/SLURM_NODELIST unless
// MASTER_ADDR is set). No variables: a world of one. Throws ConfigError for inconsistent or
// malformed values (rank outside the world, non-numeric sizes, a port outside 1..65535).
WorldInfo worldFromEnvironment(const Environment& env);

// The first host of a Slurm node list: "node[03-05,7],gpu1" -> "node03".
std::string firstSlurmHost(const std::string& nodeList);

// The tasks on node `node` (0-based) of a Slurm tasks-per-node list: "2(x3),1" -> 2 on nodes
// 0-2, 1 on node 3. 0 when the list does not name that node or is malformed.
int slurmTasksOnNode(const std::string& tasksPerNode, int node);

}  // namespace caravan
