#include "pipeline/partition.h"

#include <algorithm>
#include <functional>
#include <limits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/config.h"
#include "core/errors.h"

namespace caravan {

PartitionChoice parsePartition(const std::string& text) {
  PartitionChoice c;
  if (text == "auto") return c;
  if (text == "time") return {PartitionObjective::kTimeOnly, {}};
  if (text == "parameters") return {PartitionObjective::kParameters, {}};
  if (text == "even") return {PartitionObjective::kEven, {}};
  const std::string usage = "parallel.partition = \"" + text +
                            "\": choose auto (time and memory), time, parameters, even, or the "
                            "blocks at which stages 1..K-1 start, such as \"3,6,9\"";
  c.objective = PartitionObjective::kGiven;
  for (const std::string& item : listItems(text)) {
    if (item.empty() || item.size() > 9 ||
        item.find_first_not_of("0123456789") != std::string::npos) {
      throw ConfigError(usage);
    }
    c.splits.push_back(static_cast<size_t>(std::stoul(item)));
  }
  return c;
}

std::vector<size_t> givenPartition(const std::vector<size_t>& splits, size_t blocks, int stages) {
  std::vector<size_t> b{0};
  b.insert(b.end(), splits.begin(), splits.end());
  b.push_back(blocks);
  bool increasing = true;
  for (size_t i = 1; i < b.size(); ++i) increasing = increasing && b[i - 1] < b[i];
  if (stages == 1) {
    throw ConfigError(fmt::format(
        "parallel.partition = \"{}\" cuts stages, but parallel.pipeline_stages = 1: leave "
        "parallel.partition at auto or set parallel.pipeline_stages = {}",
        fmt::join(splits, ","), splits.size() + 1));
  }
  if (splits.size() + 1 != static_cast<size_t>(stages) || !increasing) {
    throw ConfigError(fmt::format(
        "parallel.partition = \"{}\" does not cut {} blocks into parallel.pipeline_stages = {}: "
        "give {} increasing block indices between 1 and {} (where stages 1..{} start)",
        fmt::join(splits, ","), blocks, stages, stages - 1, blocks - 1, stages - 1));
  }
  return b;
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

constexpr double kUnbounded = std::numeric_limits<double>::infinity();

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

// What stage s over blocks [a, b) keeping `inFlight` micro-batches needs: every block keeps
// when that fits `budget` (or recomputation is not allowed); else blocks recompute, the most
// bytes saved per second of forward first, until it fits (or every block that can save
// something does, fits = false). budget <= 0: no limit.
//
// Memory: state + (inFlight - 1) x the kept bytes of a micro-batch + the most the micro-batch in
// backward holds: all it keeps when its backward starts, or, while recomputed block i is
// rebuilt, what the blocks before i keep + i's input + i's activations (the blocks after i are
// done). Backwards run one at a time (gpipe, 1f1b).
struct StagePlan {
  bool fits = true;
  double seconds = 0.0;           // forward + backward + recompute, one micro-batch
  double recomputeSeconds = 0.0;  // of which recompute
  int64_t memory = 0;
  int64_t leastMemory = 0;  // the least along the search (recomputing more can need more)
  std::vector<size_t> recomputed;
};

StagePlan planStage(const std::vector<BlockCost>& blocks, size_t a, size_t b, int inFlight,
                    int64_t budget, bool recompute) {
  StagePlan p;
  int64_t state = 0;
  for (size_t i = a; i < b; ++i) {
    state += blocks[i].stateBytes;
    p.seconds += blocks[i].forwardSeconds + blocks[i].backwardSeconds;
  }
  std::vector<bool> recomputes(b - a, false);
  auto memory = [&] {
    int64_t kept = 0, inBackward = 0;
    for (size_t i = a; i < b; ++i) {
      if (recomputes[i - a]) {
        inBackward = std::max(inBackward, kept + blocks[i].inputBytes + blocks[i].activationBytes);
        kept += blocks[i].inputBytes;
      } else {
        kept += blocks[i].activationBytes;
      }
    }
    return state + (inFlight - 1) * kept + std::max(kept, inBackward);
  };
  p.memory = p.leastMemory = memory();
  p.fits = budget <= 0 || p.memory <= budget;
  if (p.fits || !recompute) return p;
  std::vector<size_t> order;
  for (size_t i = a; i < b; ++i) {
    if (blocks[i].activationBytes > blocks[i].inputBytes) order.push_back(i);
  }
  auto gain = [&](size_t i) {
    return static_cast<double>(blocks[i].activationBytes - blocks[i].inputBytes) /
           std::max(blocks[i].forwardSeconds, 1e-9);
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return gain(x) > gain(y); });
  size_t leastAt = 0;  // how many of `order` recompute at the least memory
  for (size_t i : order) {
    recomputes[i - a] = true;
    p.recomputed.push_back(i);
    p.recomputeSeconds += blocks[i].forwardSeconds;
    p.memory = memory();
    if (p.memory < p.leastMemory) {
      p.leastMemory = p.memory;
      leastAt = p.recomputed.size();
    }
    if (p.memory <= budget) break;
  }
  p.fits = p.memory <= budget;
  if (!p.fits) {  // nothing fits: the stage at its least (recomputing more would need more)
    for (size_t k = leastAt; k < p.recomputed.size(); ++k)
      p.recomputeSeconds -= blocks[p.recomputed[k]].forwardSeconds;
    p.recomputed.resize(leastAt);
    p.memory = p.leastMemory;
  }
  p.seconds += p.recomputeSeconds;
  std::sort(p.recomputed.begin(), p.recomputed.end());
  return p;
}

// The contiguous partition of n blocks into k stages minimising the largest value(s, a, b) over
// its stages, among those where every stage is allowed(s, a, b); empty when none is.
std::vector<size_t> minMaxPartition(size_t n, int k,
                                    const std::function<double(int, size_t, size_t)>& value,
                                    const std::function<bool(int, size_t, size_t)>& allowed) {
  // best[s][b]: the best largest value of s stages over blocks [0, b); from[s][b]: its last cut.
  std::vector<std::vector<double>> best(k + 1, std::vector<double>(n + 1, kUnbounded));
  std::vector<std::vector<size_t>> from(k + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0.0;
  for (int s = 1; s <= k; ++s) {
    for (size_t b = s; b + (k - s) <= n; ++b) {
      for (size_t a = s - 1; a < b; ++a) {
        if (best[s - 1][a] == kUnbounded || !allowed(s - 1, a, b)) continue;
        const double v = std::max(best[s - 1][a], value(s - 1, a, b));
        if (v < best[s][b]) {
          best[s][b] = v;
          from[s][b] = a;
        }
      }
    }
  }
  if (best[k][n] == kUnbounded) return {};
  std::vector<size_t> cuts(k + 1, n);
  for (int s = k; s >= 1; --s) cuts[s - 1] = from[s][cuts[s]];
  return cuts;
}

}  // namespace

Partition partitionBlocks(const std::vector<BlockCost>& blocks, int stages, int microBatches,
                          PipelineSchedule schedule, int64_t budget, PartitionObjective objective,
                          bool recompute, const std::vector<size_t>& given) {
  const size_t n = blocks.size();
  const std::vector<size_t> even = evenPartition(n, stages);  // refuses stages > blocks
  std::vector<int> inFlight;
  for (const StageProgram& p : buildSchedule(schedule, stages, microBatches)) {
    inFlight.push_back(peakInFlight(p));
  }
  const Sums sum(blocks);
  auto plan = [&](int s, size_t a, size_t b) {
    return planStage(blocks, a, b, inFlight[s], budget, recompute);
  };
  // The least a stage can need (recomputing, when allowed, as far as that lowers it).
  auto leastMemory = [&](int s, size_t a, size_t b) {
    return static_cast<double>(planStage(blocks, a, b, inFlight[s], 1, recompute).leastMemory);
  };
  auto time = [&](int, size_t a, size_t b) { return sum.time[b] - sum.time[a]; };
  auto any = [](int, size_t, size_t) { return true; };

  Partition out;
  const std::vector<size_t> leanest = minMaxPartition(n, stages, leastMemory, any);
  switch (objective) {
    case PartitionObjective::kTimeAndMemory:
      out.boundaries = minMaxPartition(
          n, stages, [&](int s, size_t a, size_t b) { return plan(s, a, b).seconds; },
          [&](int s, size_t a, size_t b) { return plan(s, a, b).fits; });
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
    case PartitionObjective::kGiven:
      CARAVAN_CHECK_EQ(given.size(), static_cast<size_t>(stages) + 1, "given boundaries");
      out.boundaries = given;
      break;
  }
  // A cut the user fixed (given, even) names the least it needs itself; the others the least
  // any cut needs.
  const bool fixed =
      objective == PartitionObjective::kGiven || objective == PartitionObjective::kEven;
  const std::vector<size_t>& least = fixed ? out.boundaries : leanest;
  for (int s = 0; s < stages; ++s) {
    out.smallestBudget =
        std::max(out.smallestBudget, static_cast<int64_t>(leastMemory(s, least[s], least[s + 1])));
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
    const StagePlan p = plan(s, e.begin, e.end);
    e.memoryBytes = p.memory;
    e.recomputeSeconds = p.recomputeSeconds;
    e.recomputed = p.recomputed;
    out.fits = out.fits && p.fits;
    out.periodSeconds = std::max(out.periodSeconds, p.seconds);
    // zb-h1's B and W: half of the measured backward each (the profile does not split them).
    const double backward = e.backwardSeconds + e.recomputeSeconds;
    costs.push_back({e.forwardSeconds, backward / 2, backward / 2, 0.0});
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
      "| stage | blocks | forward+backward (+ recompute) ms per micro-batch | in flight | "
      "memory MiB | recomputed blocks |\n"
      "|---|---|---|---|---|---|\n";
  for (size_t s = 0; s < p.stages.size(); ++s) {
    const StageEstimate& e = p.stages[s];
    out += fmt::format(
        "| {} | {}-{} ({}..{}) | {:.2f} | {} | {:.2f}{} | {} |\n", s, e.begin, e.end - 1,
        blocks[e.begin].label, blocks[e.end - 1].label,
        (e.forwardSeconds + e.backwardSeconds + e.recomputeSeconds) * 1e3, e.inFlight,
        mib(e.memoryBytes), budget > 0 && e.memoryBytes > budget ? " (over the budget)" : "",
        e.recomputed.empty() ? std::string("none")
                             : fmt::format("{} ({:.2f} ms)", fmt::join(e.recomputed, ","),
                                           e.recomputeSeconds * 1e3));
  }
  out += fmt::format(
      "predicted step {:.1f} ms, bubble {:.1f}%, slowest stage {:.2f} ms per micro-batch; the "
      "smallest per-worker budget any partition fits: {:.1f} MiB\n",
      p.stepSeconds * 1e3, p.bubbleFraction * 100.0, p.periodSeconds * 1e3, mib(p.smallestBudget));
  return out;
}

}  // namespace caravan
