// `caravan simulate` and `caravan calibrate` (sim/simulator.h, docs/simulate.md): the command
// line's part, reading the config and the cluster, writing predictions.jsonl and charts.json.
#pragma once

#include <string>
#include <vector>

namespace caravan {

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

struct CalibrateArgs {
  std::string output;
  int hosts = 1;
  double linkMbit = 1000.0;
  double latencyUs = 50.0;
  std::string swapDir = "/var/tmp";
};
int runCalibrate(const CalibrateArgs& args);

}  // namespace caravan
