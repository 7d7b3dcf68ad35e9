// The window of a train record: what the steps since the last record took (per-step means of
// compute and synchronization wait, samples per second without evaluations and checkpoints,
// bytes on the wire, every worker's numbers), and the record itself with the memory, the
// executor's, the out-of-core store's and the step engine's numbers.
//
// Threading: the trainer thread only.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/counting_communicator.h"
#include "train/distributed.h"
#include "train/step.h"

namespace caravan {

class ActivationExecutor;
class MemoryTracker;
class OutOfCoreWeights;

class MetricsWindow {
 public:
  using Clock = std::chrono::steady_clock;
  explicit MetricsWindow(Distributed* dist);

  // One step that trained `samples` examples over all workers: its compute and its wait on
  // synchronization (StepResult's split).
  void addStep(const StepResult& r, int64_t samples);
  // The tracked memory a step of the window needed at its peak (activations on top of weights,
  // gradients and optimizer state); the window keeps the largest.
  void addMemoryPeak(int64_t bytes) { memoryPeak_ = std::max(memoryPeak_, bytes); }
  // This rank's per-step means so far (for the agreement that carries every worker's).
  RankWindow own() const;
  // Every worker's, filled by the agreement of a step that writes a record.
  std::vector<RankWindow>* ranks() { return &ranks_; }
  double samplesPerSecond() const;
  // Leaves `pause` (an evaluation, a checkpoint) out of the window's time.
  void exclude(Clock::duration pause) { start_ += pause; }

  // The train record of the window's last step; starts a new window. `memory`'s peaks restart
  // too; `executor` and `weights` may be null; `engineMetrics`: the step engine's numbers
  // (StepEngine::takeMetrics, e.g. a strategy's staleness).
  nlohmann::json close(nlohmann::json record, MemoryTracker& memory, ActivationExecutor* executor,
                       OutOfCoreWeights* weights,
                       const std::map<std::string, double>& engineMetrics);

 private:
  Distributed* dist_;
  double samples_ = 0.0;
  double compute_ = 0.0, sync_ = 0.0;
  int64_t steps_ = 0;
  int64_t memoryPeak_ = 0;
  ByteCount bytes_;
  std::vector<RankWindow> ranks_;
  Clock::time_point start_;
};

}  // namespace caravan
