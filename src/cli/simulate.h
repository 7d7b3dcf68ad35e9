// `caravan simulate` and `caravan calibrate` (sim/simulator.h, docs/simulate.md): the command
// line's part, reading the config and the cluster, writing predictions.jsonl and charts.json.
#pragma once

#include <string>
#include <vector>

namespace caravan {

class Config;
namespace sim {
struct Workload;
}

// A workload.json of `caravan simulate -o` for this config: ConfigError when unreadable, of
// another model, or profiled at another data.batch_size.
sim::Workload readWorkload(const std::string& path, const Config& config);

struct SimulateArgs {
  std::string configPath;
  std::vector<std::string> overrides;
  std::string clusterPath;
  std::vector<int> workers;  // empty: 1, 2, 4, ... up to the cluster's hosts
  int64_t steps = 100;
  uint64_t seed = 1;
  std::string outDir;        // empty: print only
  std::string workloadPath;  // a DIR/workload.json of an earlier -o: no profiling
  bool recommend = false;
};
int runSimulate(const SimulateArgs& args);

// `caravan plan --cluster`: the layout search (sim/choose_layout.h), printed; -o writes its JSON.
struct PlanLayoutArgs {
  std::string configPath;
  std::vector<std::string> overrides;
  std::string clusterPath;
  int workers = 0;  // 0: the cluster's hosts less the config's servers
  std::string workloadPath;
  std::string output;
};
int runPlanLayout(const PlanLayoutArgs& args);

struct CalibrateArgs {
  std::string output;
  int hosts = 1;
  double linkMbit = 1000.0;
  double latencyUs = 50.0;
  std::string swapDir = "/var/tmp";
};
int runCalibrate(const CalibrateArgs& args);

}  // namespace caravan
