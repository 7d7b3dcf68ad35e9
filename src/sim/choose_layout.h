// The layout search (sim/layout.h) for a config: what `caravan plan --cluster` prints and what
// `caravan train` runs under parallel.layout = auto. Profiles the model (sim/workload.h), checks
// the cluster can hold the job, searches, and refuses a job no layout fits in one line that names
// the nearest that would.
// Threading: the caller's thread (profiling runs the model).
#pragma once

#include <string>
#include <vector>

#include "sim/cluster.h"
#include "sim/layout.h"
#include "sim/simulator.h"

namespace caravan {
class Config;
}

namespace caravan::sim {

// parallel.cluster's file, or (empty) one host: this machine's cores and memory.
ClusterSpec layoutCluster(const std::string& path);

struct LayoutDecision {
  Workload workload;
  ClusterSpec cluster;
  int workers = 0;
  LayoutSearch search;
  double searchSeconds = 0.0;  // the search alone (profiling excluded)
  const LayoutChoice& chosen() const { return *search.best(); }
};

// Profiles the config's model and searches its layouts on `workers` workers (plus the config's
// servers where its mode has them). ConfigError, one line, when:
//   - `checkCapacity` and the cluster holds fewer processes than the job has (clusterCapacity):
//     it names the most workers it holds and the best layout for them;
//   - no layout fits the memory limit: it names the smallest limit one fits, and that layout.
// `given`: a workload profiled before (caravan simulate -o's workload.json), else profiled here.
// Prints nothing.
LayoutDecision chooseLayout(const Config& config, const ClusterSpec& cluster, int workers,
                            bool checkCapacity, const Workload* given = nullptr);

// The top `count` ways, one per line ("  1. allreduce+shard(...): ..."), and the chosen keys.
std::string formatLayouts(const LayoutDecision& d, size_t count);

// RUN_DIR/layout.json: the chosen layout (its keys, its prediction), the top five, every layout
// searched (fitting or not) and those refused.
std::string layoutJson(const LayoutDecision& d);
// The keys of a layout.json (a resumed run keeps its layout). ConfigError naming `source`.
std::vector<std::string> layoutKeysFromJson(const std::string& text, const std::string& source);

// What `caravan train` runs under parallel.layout = auto on rank 0 (train/layout_setup.h's
// LayoutChooser): on `resume` with a `file` there, its keys; else the search on this config's
// parallel.cluster (none: this machine, without the capacity check), written to `file`.
std::vector<std::string> chooseLayoutKeys(const Config& config, int workers,
                                          const std::string& file, bool resume, bool log);

}  // namespace caravan::sim
