#include "pipeline/schedule.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <deque>
#include <map>
#include <tuple>

#include "core/errors.h"

namespace caravan {

PipelineSchedule parsePipelineSchedule(const std::string& name) {
  if (name == "gpipe") return PipelineSchedule::kGPipe;
  if (name == "1f1b") return PipelineSchedule::kOneFOneB;
  if (name == "zb-h1") return PipelineSchedule::kZeroBubbleH1;
  throw ConfigError("parallel.schedule = \"" + name + "\": choose gpipe, 1f1b or zb-h1");
}

std::string pipelineScheduleName(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::kGPipe: return "gpipe";
    case PipelineSchedule::kOneFOneB: return "1f1b";
    case PipelineSchedule::kZeroBubbleH1: return "zb-h1";
  }
  return "?";
}

std::string actionName(ActionKind kind) {
  switch (kind) {
    case ActionKind::kRecvActivation: return "recv-act";
    case ActionKind::kForward: return "F";
    case ActionKind::kSendActivation: return "send-act";
    case ActionKind::kRecvGradient: return "recv-grad";
    case ActionKind::kBackward: return "B";
    case ActionKind::kBackwardInput: return "Bi";
    case ActionKind::kBackwardWeight: return "W";
    case ActionKind::kSendGradient: return "send-grad";
  }
  return "?";
}

bool isCompute(ActionKind k) {
  return k == ActionKind::kForward || k == ActionKind::kBackward ||
         k == ActionKind::kBackwardInput || k == ActionKind::kBackwardWeight;
}

bool isReceive(ActionKind k) {
  return k == ActionKind::kRecvActivation || k == ActionKind::kRecvGradient;
}

namespace {

// Appends a compute action with the receive it needs before and the send it makes after.
void emit(StageProgram& p, ActionKind kind, int m, int stage, int stages) {
  const bool first = stage == 0, last = stage == stages - 1;
  switch (kind) {
    case ActionKind::kForward:
      if (!first) p.push_back({ActionKind::kRecvActivation, m});
      p.push_back({kind, m});
      if (!last) p.push_back({ActionKind::kSendActivation, m});
      break;
    case ActionKind::kBackward:
    case ActionKind::kBackwardInput:
      if (!last) p.push_back({ActionKind::kRecvGradient, m});
      p.push_back({kind, m});
      if (!first) p.push_back({ActionKind::kSendGradient, m});
      break;
    default: p.push_back({kind, m});
  }
}

std::vector<StageProgram> gpipe(int k, int m) {
  std::vector<StageProgram> out(k);
  for (int s = 0; s < k; ++s) {
    for (int i = 0; i < m; ++i) emit(out[s], ActionKind::kForward, i, s, k);
    for (int i = 0; i < m; ++i) emit(out[s], ActionKind::kBackward, i, s, k);
  }
  return out;
}

std::vector<StageProgram> oneFOneB(int k, int m) {
  std::vector<StageProgram> out(k);
  for (int s = 0; s < k; ++s) {
    const int warmup = std::min(k - s - 1, m);
    for (int i = 0; i < warmup; ++i) emit(out[s], ActionKind::kForward, i, s, k);
    for (int i = 0; i < m - warmup; ++i) {
      emit(out[s], ActionKind::kForward, warmup + i, s, k);
      emit(out[s], ActionKind::kBackward, i, s, k);
    }
    for (int i = m - warmup; i < m; ++i) emit(out[s], ActionKind::kBackward, i, s, k);
  }
  return out;
}

// 1f1b's order with each backward split into B and W, stage s running each W s micro-batches
// after its B (Qi et al.'s ZB-H1): the deferred Ws fill the drain, where 1f1b's later stages
// idle. After each drain B one pending W; the rest at the end.
std::vector<StageProgram> zeroBubbleH1(int k, int m) {
  std::vector<StageProgram> out(k);
  for (int s = 0; s < k; ++s) {
    StageProgram& p = out[s];
    const int warmup = std::min(k - s - 1, m);
    int nextW = 0;
    for (int i = 0; i < warmup; ++i) emit(p, ActionKind::kForward, i, s, k);
    for (int i = 0; i < m - warmup; ++i) {
      emit(p, ActionKind::kForward, warmup + i, s, k);
      emit(p, ActionKind::kBackwardInput, i, s, k);
      if (i - s >= 0) emit(p, ActionKind::kBackwardWeight, nextW++, s, k);
    }
    for (int i = m - warmup; i < m; ++i) {
      emit(p, ActionKind::kBackwardInput, i, s, k);
      emit(p, ActionKind::kBackwardWeight, nextW++, s, k);
    }
    while (nextW < m) emit(p, ActionKind::kBackwardWeight, nextW++, s, k);
  }
  return out;
}

// Runs a compute action of `seconds` from `start` within `c`'s budget per period and returns
// where it ends; `ran(from, to)` for each stretch it computes (one without a budget). `used`:
// what the stage spent of the budget in period `period` (the last it computed in), carried from
// one action to the next. A remainder within rounding of nothing (1e-12 of a period) is done,
// not carried into the next period.
template <typename Ran>
double computeUntil(const StageCosts& c, double start, double seconds, double* used,
                    int64_t* period, Ran&& ran) {
  if (c.quotaPeriod <= 0.0 || c.quotaBudget <= 0.0) {
    ran(start, start + seconds);
    return start + seconds;
  }
  const double p = c.quotaPeriod;
  double t = start;
  auto i = static_cast<int64_t>(std::floor((t - c.quotaPhase) / p));
  if (static_cast<double>(i + 1) * p + c.quotaPhase <= t) ++i;  // rounding at a period's start
  if (i != *period) {
    *period = i;
    *used = 0.0;
  }
  if (seconds <= 0.0) ran(t, t);
  const double nothing = 1e-12 * p;
  while (seconds > nothing) {
    const double periodEnd = static_cast<double>(i + 1) * p + c.quotaPhase;
    const double run = std::min({seconds, c.quotaBudget - *used, periodEnd - t});
    if (run > 0.0) {
      ran(t, t + run);
      t += run;
      seconds -= run;
      *used += run;
    }
    if (seconds > nothing) {  // out of budget (or at the period's end): on at the next period
      *period = ++i;
      *used = 0.0;
      t = std::max(t, periodEnd);
    }
  }
  return t;
}

// Runs programs with blocking receives and non-blocking sends. `costs` may be empty (order
// only). Returns "" or the violation; fills `sim` when given.
std::string execute(const std::vector<StageProgram>& programs, const std::vector<StageCosts>& costs,
                    ScheduleSimulation* sim) {
  const int k = static_cast<int>(programs.size());
  auto cost = [&](int s) -> const StageCosts& {
    static const StageCosts unit;
    if (costs.empty()) return unit;
    return costs.size() == 1 ? costs[0] : costs.at(s);
  };
  // (from stage, to stage, is gradient) -> messages in send order: (micro-batch, send time)
  std::map<std::tuple<int, int, bool>, std::deque<std::pair<int, double>>> links;
  std::vector<size_t> pc(k, 0);
  std::vector<double> clock(k, 0.0);
  std::vector<double> used(k, 0.0);  // of the stage's budget, in period `period`
  std::vector<int64_t> period(k, INT64_MIN);
  if (sim) {
    *sim = ScheduleSimulation{};
    sim->busy.assign(k, 0.0);
    sim->spans.assign(k, {});
  }
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < k; ++s) {
      while (pc[s] < programs[s].size()) {
        const Action a = programs[s][pc[s]];
        auto where = [&] {  // made only for an error (simulations run this per action)
          return "stage " + std::to_string(s) + " action " + std::to_string(pc[s]) + " (" +
                 actionName(a.kind) + " " + std::to_string(a.microBatch) + ")";
        };
        if (a.kind == ActionKind::kSendActivation || a.kind == ActionKind::kSendGradient) {
          const bool grad = a.kind == ActionKind::kSendGradient;
          const int to = grad ? s - 1 : s + 1;
          if (to < 0 || to >= k) return where() + ": sends past the end of the pipeline";
          links[{s, to, grad}].push_back({a.microBatch, clock[s]});
        } else if (a.kind == ActionKind::kRecvActivation || a.kind == ActionKind::kRecvGradient) {
          const bool grad = a.kind == ActionKind::kRecvGradient;
          const int from = grad ? s + 1 : s - 1;
          if (from < 0 || from >= k)
            return where() + ": receives from past the end of the pipeline";
          auto& q = links[{from, s, grad}];
          if (q.empty()) break;  // blocks until the sender gets there
          if (q.front().first != a.microBatch) {
            return where() + ": the other end sent micro-batch " + std::to_string(q.front().first) +
                   " first";
          }
          clock[s] = std::max(clock[s], q.front().second + cost(s).transfer);
          q.pop_front();
        } else {
          const StageCosts& c = cost(s);
          const double d = a.kind == ActionKind::kForward         ? c.forward
                           : a.kind == ActionKind::kBackwardInput ? c.backwardInput
                           : a.kind == ActionKind::kBackwardWeight
                               ? c.backwardWeight
                               : c.backwardInput + c.backwardWeight;
          clock[s] =
              computeUntil(c, clock[s], d, &used[s], &period[s], [&](double from, double to) {
                if (sim) sim->spans[s].push_back({a.kind, a.microBatch, from, to});
              });
          if (sim) sim->busy[s] += d;
        }
        ++pc[s];
        progress = true;
      }
    }
  }
  for (int s = 0; s < k; ++s) {
    if (pc[s] < programs[s].size()) {
      const Action a = programs[s][pc[s]];
      return "stage " + std::to_string(s) + " waits forever at action " + std::to_string(pc[s]) +
             " (" + actionName(a.kind) + " " + std::to_string(a.microBatch) +
             "): its sender never sends it";
    }
  }
  for (const auto& [link, q] : links) {
    if (!q.empty()) {
      return "stage " + std::to_string(std::get<0>(link)) + " sends micro-batch " +
             std::to_string(q.front().first) + " to stage " + std::to_string(std::get<1>(link)) +
             ", which never receives it";
    }
  }
  if (sim) sim->makespan = *std::max_element(clock.begin(), clock.end());
  return "";
}

}  // namespace

std::vector<StageProgram> buildSchedule(PipelineSchedule schedule, int stages, int microBatches) {
  if (stages < 1) throw ConfigError("parallel.pipeline_stages must be >= 1");
  if (microBatches < 1) throw ConfigError("parallel.micro_batches must be >= 1");
  switch (schedule) {
    case PipelineSchedule::kGPipe: return gpipe(stages, microBatches);
    case PipelineSchedule::kOneFOneB: return oneFOneB(stages, microBatches);
    case PipelineSchedule::kZeroBubbleH1: return zeroBubbleH1(stages, microBatches);
  }
  return {};
}

std::string checkSchedule(const std::vector<StageProgram>& programs, int microBatches) {
  const int k = static_cast<int>(programs.size());
  for (int s = 0; s < k; ++s) {
    const std::string stage = "stage " + std::to_string(s) + ": ";
    const bool first = s == 0, last = s == k - 1;
    // position of each action of each micro-batch; -1 = absent
    std::map<std::pair<ActionKind, int>, int> at;
    for (int i = 0; i < static_cast<int>(programs[s].size()); ++i) {
      const Action a = programs[s][i];
      if (a.microBatch < 0 || a.microBatch >= microBatches) {
        return stage + "micro-batch " + std::to_string(a.microBatch) + " out of range";
      }
      if (!at.emplace(std::make_pair(a.kind, a.microBatch), i).second) {
        return stage + actionName(a.kind) + " " + std::to_string(a.microBatch) + " runs twice";
      }
    }
    auto pos = [&](ActionKind kind, int m) {
      auto it = at.find({kind, m});
      return it == at.end() ? -1 : it->second;
    };
    int lastBackward = -1;  // accumulation order: the weight-gradient actions in increasing m
    for (int m = 0; m < microBatches; ++m) {
      const std::string mb = " " + std::to_string(m);
      const int f = pos(ActionKind::kForward, m), b = pos(ActionKind::kBackward, m);
      const int bi = pos(ActionKind::kBackwardInput, m), w = pos(ActionKind::kBackwardWeight, m);
      if (f < 0) return stage + "no forward of micro-batch" + mb;
      const bool whole = b >= 0 && bi < 0 && w < 0, split = b < 0 && bi >= 0 && w >= 0;
      if (!whole && !split) {
        return stage + "micro-batch" + mb + " needs one whole backward, or a B and a W, exactly";
      }
      const int backStart = whole ? b : bi, backEnd = whole ? b : w;
      if (backStart < f) return stage + "micro-batch" + mb + " goes backward before forward";
      if (split && w < bi) return stage + "micro-batch" + mb + " runs W before B";
      if (backEnd < lastBackward) {
        return stage + "weight gradients of micro-batch" + mb + " come before an earlier one's";
      }
      lastBackward = backEnd;
      const int ra = pos(ActionKind::kRecvActivation, m), sa = pos(ActionKind::kSendActivation, m);
      const int rg = pos(ActionKind::kRecvGradient, m), sg = pos(ActionKind::kSendGradient, m);
      if (first != (ra < 0) || (!first && ra > f)) {
        return stage + "the input of micro-batch" + mb + " is not received before its forward";
      }
      if (last != (sa < 0) || (!last && sa < f)) {
        return stage + "the output of micro-batch" + mb + " is not sent after its forward";
      }
      if (last != (rg < 0) || (!last && rg > backStart)) {
        return stage + "the output gradient of micro-batch" + mb +
               " is not received before its backward";
      }
      if (first != (sg < 0) || (!first && sg < backStart)) {
        return stage + "the input gradient of micro-batch" + mb + " is not sent after its backward";
      }
    }
    const size_t expected =
        static_cast<size_t>(microBatches) * (2 + (first ? 0 : 2) + (last ? 0 : 2));
    size_t extra = 0;
    for (const Action& a : programs[s]) extra += a.kind == ActionKind::kBackwardWeight;
    if (programs[s].size() != expected + extra) return stage + "has actions of unknown kind";
  }
  return execute(programs, {}, nullptr);
}

int peakInFlight(const StageProgram& program) {
  int inFlight = 0, peak = 0;
  for (const Action& a : program) {
    if (a.kind == ActionKind::kForward) peak = std::max(peak, ++inFlight);
    // A micro-batch's last backward action: the whole backward, or zb-h1's W.
    if (a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardWeight) --inFlight;
  }
  return peak;
}

double ScheduleSimulation::bubbleFraction() const {
  double total = 0.0;
  for (double b : busy) total += b;
  if (busy.empty() || makespan <= 0.0) return 0.0;
  return 1.0 - total / (static_cast<double>(busy.size()) * makespan);
}

ScheduleSimulation simulateSchedule(const std::vector<StageProgram>& programs,
                                    const std::vector<StageCosts>& costs) {
  CARAVAN_CHECK(costs.size() == 1 || costs.size() == programs.size(), "one cost or one per stage");
  ScheduleSimulation sim;
  const std::string problem = execute(programs, costs, &sim);
  CARAVAN_CHECK(problem.empty(), "{}", problem);
  return sim;
}

}  // namespace caravan
