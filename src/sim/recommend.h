// `caravan simulate --recommend`: the other ways to run a job, and their ranking from what the
// simulator predicts for each (sim/simulator.h). The policy only: cli/simulate.cpp simulates
// the candidates, refuses those `caravan train` would refuse (validate) and prints the ranking.
// Threading: pure functions.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "sim/cluster.h"
#include "sim/simulator.h"
#include "train/run_options.h"

namespace caravan::sim {

// `own` synchronised by `mode` in its plainest way: servers (at least one) only where the mode
// has them, the mode's consistency with the run's staleness, no compression, local SGD without a
// BSP phase, gossip on a ring, no sharding, weights in core, one stage of one micro-batch. What
// --recommend and the layout search (sim/layout.h) vary from.
RunOptions plainJob(const RunOptions& own, SyncMode mode);

// The ways to run `own` that --recommend compares, `own` first: all-reduce (plain, fp16,
// sharded: sync.shard = gradients and parameters, and with memory.weights = offload),
// ps-bsp, ps-asp, ps-ssp, osp with its fraction searched, local SGD, gossip on a ring, and for
// an even number of workers all-reduce over two pipeline stages of four micro-batches. Each is
// `own` with its sync mode, servers (at least one where the mode has them, else none),
// compression (none unless named), pipeline (one stage, one micro-batch unless named), weights
// in core unless named, local SGD without a BSP phase and gossip on a ring; one labelled as
// `own` is left out.
std::vector<RunOptions> candidates(const RunOptions& own, int workers);

// What bounds a simulated job: "compute-bound (93% computing)" when its workers compute >= 80%
// of the time, else "communication-bound (41% computing, busiest link 88%)".
bool isComputeBound(const SimResult& r);
std::string boundText(const SimResult& r);

// One simulated way to run the job, ranked.
struct Recommendation {
  std::string mode;  // SimResult::mode (label)
  double samplesPerSecond = 0.0;
  double epochMinutes = 0.0;  // 0: the epoch's size is unknown
  bool computeBound = false;  // the workers compute >= 80% of the time
  std::string bound;          // "compute-bound (93% computing)", "communication-bound (...)"
  std::string consistency;    // what the mode gives up against single-process training
  bool memoryPredicted = false;
  bool fits = true;  // the memory per worker fits its share of a host (or no host memory given)
  int64_t memoryPeakBytes = 0;

  // "allreduce: 812 samples/s, 1.2 min/epoch; compute-bound (93% computing); exact (...)".
  std::string text() const;
};

// The simulated ways (each job with its result), fastest first (ties in the given order), with
// what bounds each, what it gives up and whether it fits a host's memory: `workers` share the
// cluster's hosts round robin, each host's memory split evenly between its workers;
// `epochExamples` the training split's examples (0: unknown).
std::vector<Recommendation> recommend(
    const std::vector<std::pair<RunOptions, SimResult>>& simulated, const ClusterSpec& cluster,
    int workers, int64_t epochExamples);

}  // namespace caravan::sim
