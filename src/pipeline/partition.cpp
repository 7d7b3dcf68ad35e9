#include "pipeline/partition.h"

#include <algorithm>
#include <functional>
#include <limits>

#include <fmt/format.h>

#include "core/errors.h"

namespace caravan {

PartitionObjective parsePartitionObjective(const std::string& name) {
  if (name == "auto") return PartitionObjective::kTimeAndMemory;
  if (name == "time") return PartitionObjective::kTimeOnly;
  if (name == "parameters") return PartitionObjective::kParameters;
  if (name == "even") return PartitionObjective::kEven;
  throw ConfigError("parallel.partition = \"" + name +
                    "\": choose auto (time and memory), time, parameters or even");
}

std::vector<size_t> evenPartition(size_t blocks, int stages) {
  if (stages < 1 || static_cast<size_t>(stages) > blocks) {
    throw ConfigError("parallel.pipeline_stages = " + std::to_string(stages) +
                      " but the model has " + std::to_string(blocks) +
                      " blocks: every stage needs at least one, so use at most " +
                      std::to_string(blocks) + " stages");
  }
  std::vector<size_t> b{0};
  const size_t per = blocks / stages, extra = blocks % stages;
  for (int s = 0; s < stages; ++s) b.push_back(b.back() + per + (static_cast<size_t>(s) < extra));
  return b;
}

namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

struct Sums {
  std::vector<double> time;
  std::vector<int64_t> activations, state, parameters;
  explicit Sums(const std::vector<BlockCost>& blocks)
      : time{0.0}, activations{0}, state{0}, parameters{0} {
    for (const BlockCost& b : blocks) {
      time.push_back(time.back() + b.forwardSeconds + b.backwardSeconds);
      activations.push_back(activations.back() + b.activationBytes);
      state.push_back(state.back() + b.stateBytes);
      parameters.push_back(parameters.back() + b.parameterBytes);
    }
  }
};

// The contiguous partition of n blocks into k stages minimising the largest value(s, a, b) over
// its stages, among those where every stage is allowed(s, a, b); empty when none is.
std::vector<size_t> minMaxPartition(size_t n, int k,
                                    const std::function<double(int, size_t, size_t)>& value,
                                    const std::function<bool(int, size_t, size_t)>& allowed) {
  // best[s][b]: the best largest value of s stages over blocks [0, b); from[s][b]: its last cut.
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, kInfinity));
  std::vector<std::vector<size_t>> from(k + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0.0;
  for (int s = 1; s <= k; ++s) {
    for (size_t b = s; b + (k - s) <= n; ++b) {
      for (size_t a = s - 1; a < b; ++a) {
        if (best[s - 1][a] == kInfinity || !allowed(s - 1, a, b)) continue;
        const double v = std::max(best[s - 1][a], value(s - 1, a, b));
        if (v < best[s][b]) {
          best[s][b] = v;
          from[s][b] = a;
        }
      }
    }
  }
  if (best[k][n] == kInfinity) return {};
  std::vector<size_t> cuts(k + 1, n);
  for (int s = k; s >= 1; --s) cuts[s - 1] = from[s][cuts[s]];
  return cuts;
}

}  // namespace

Partition partitionBlocks(const std::vector<BlockCost>& blocks, int stages, int microBatches,
                          PipelineSchedule schedule, int64_t budget, PartitionObjective objective) {
  const size_t n = blocks.size();
  const std::vector<size_t> even = evenPartition(n, stages);  // refuses stages > blocks
  std::vector<int> inFlight;
  for (const StageProgram& p : buildSchedule(schedule, stages, microBatches)) {
    inFlight.push_back(peakInFlight(p));
  }
  const Sums sum(blocks);
  auto memory = [&](int s, size_t a, size_t b) {
    return (sum.state[b] - sum.state[a]) + inFlight[s] * (sum.activations[b] - sum.activations[a]);
  };
  auto time = [&](int, size_t a, size_t b) { return sum.time[b] - sum.time[a]; };
  auto any = [](int, size_t, size_t) { return true; };
  auto fitsBudget = [&](int s, size_t a, size_t b) {
    return budget <= 0 || memory(s, a, b) <= budget;
  };

  Partition out;
  const std::vector<size_t> leanest = minMaxPartition(
      n, stages, [&](int s, size_t a, size_t b) { return static_cast<double>(memory(s, a, b)); },
      any);
  switch (objective) {
    case PartitionObjective::kTimeAndMemory:
      out.boundaries = minMaxPartition(n, stages, time, fitsBudget);
      if (out.boundaries.empty()) out.boundaries = leanest;
      break;
    case PartitionObjective::kTimeOnly:
      out.boundaries = minMaxPartition(n, stages, time, any);
      break;
    case PartitionObjective::kParameters:
      out.boundaries = minMaxPartition(
          n, stages,
          [&](int, size_t a, size_t b) {
            return static_cast<double>(sum.parameters[b] - sum.parameters[a]);
          },
          any);
      break;
    case PartitionObjective::kEven: out.boundaries = even; break;
  }
  for (int s = 0; s < stages; ++s) {
    out.smallestBudget = std::max(out.smallestBudget, memory(s, leanest[s], leanest[s + 1]));
  }
  std::vector<StageCosts> costs;
  for (int s = 0; s < stages; ++s) {
    StageEstimate e;
    e.begin = out.boundaries[s];
    e.end = out.boundaries[s + 1];
    e.inFlight = inFlight[s];
    for (size_t i = e.begin; i < e.end; ++i) {
      e.forwardSeconds += blocks[i].forwardSeconds;
      e.backwardSeconds += blocks[i].backwardSeconds;
    }
    e.memoryBytes = memory(s, e.begin, e.end);
    out.fits = out.fits && (budget <= 0 || e.memoryBytes <= budget);
    out.periodSeconds = std::max(out.periodSeconds, e.forwardSeconds + e.backwardSeconds);
    // zb-h1's B and W: half of the measured backward each (the profile does not split them).
    costs.push_back({e.forwardSeconds, e.backwardSeconds / 2, e.backwardSeconds / 2, 0.0});
    out.stages.push_back(e);
  }
  const ScheduleSimulation sim =
      simulateSchedule(buildSchedule(schedule, stages, microBatches), costs);
  out.stepSeconds = sim.makespan;
  out.bubbleFraction = sim.bubbleFraction();
  return out;
}

std::string formatPartition(const std::vector<BlockCost>& blocks, const Partition& p,
                            int64_t budget) {
  auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
  std::string out =
      "| stage | blocks | forward+backward ms per micro-batch | in flight | memory MiB |\n"
      "|---|---|---|---|---|\n";
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const StageEstimate& e = p.stages[s];
    out += fmt::format("| {} | {}-{} ({}..{}) | {:.2f} | {} | {:.1f}{} |\n", s, e.begin, e.end - 1,
                       blocks[e.begin].label, blocks[e.end - 1].label,
                       (e.forwardSeconds + e.backwardSeconds) * 1e3, e.inFlight, mib(e.memoryBytes),
                       budget > 0 && e.memoryBytes > budget ? " (over the budget)" : "");
  }
  out += fmt::format(
      "predicted step {:.1f} ms, bubble {:.1f}%, slowest stage {:.2f} ms per micro-batch; the "
      "smallest per-worker budget any partition fits: {:.1f} MiB\n",
      p.stepSeconds * 1e3, p.bubbleFraction * 100.0, p.periodSeconds * 1e3, mib(p.smallestBudget));
  return out;
}

}  // namespace caravan
