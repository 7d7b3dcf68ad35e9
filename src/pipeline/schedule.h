// Pipeline schedules as data: for each of K stages, the ordered list of actions it runs in one
// training step over M micro-batches (forward, backward — or for zero-bubble its two halves —
// and the sends and receives of activations and their gradients). A stage executes its list in
// order; nothing about the order is decided at run time, so every schedule is checked here,
// without a network (checkSchedule, simulateSchedule), and the executor (pipeline/stage.h) only
// follows it. Algorithms: ../shared/ALGORITHMS.md §3.
//
//   gpipe   all forwards, then all backwards (micro-batch order); every stage keeps all M
//           micro-batches' activations. Bubble (K-1)/(M+K-1) when a backward costs 2 forwards.
//   1f1b    PipeDream-Flush: stage s runs min(K-s-1, M) warm-up forwards, then alternates one
//           forward and one backward, then drains the backwards; keeps at most K-s micro-batches
//           in flight. Same bubble as gpipe, less memory.
//   zb-h1   zero bubble (Qi et al., ICLR 2024, ZB-H1): each backward is split into B (the
//           gradient of the stage's input: on the critical path) and W (its weights' gradients:
//           deferrable). 1f1b's order of F and B, with stage s running each W s micro-batches
//           after its B; the deferred Ws fill the drain. Every stage keeps at most min(K, M)
//           micro-batches in flight (1f1b's first stage's peak: the same peak memory, spread
//           evenly). Bubble (K-1)/(3M+K-1) when F = B = W and M >= K: a third of 1f1b's idle time.
//
// Micro-batch m's backward halves and its gradient accumulation always run in increasing m, so
// every schedule adds the micro-batches' gradients in the order one worker accumulating them
// would (exactness, tests/test_pipeline.cpp).
// Threading: pure functions.
#pragma once

#include <string>
#include <vector>

namespace caravan {

enum class PipelineSchedule { kGPipe, kOneFOneB, kZeroBubbleH1 };

// "gpipe" | "1f1b" | "zb-h1"; ConfigError naming the choices otherwise.
PipelineSchedule parsePipelineSchedule(const std::string& name);
std::string pipelineScheduleName(PipelineSchedule schedule);

enum class ActionKind {
  kRecvActivation,  // micro-batch m's input from stage s-1
  kForward,
  kSendActivation,  // m's output to stage s+1
  kRecvGradient,    // the gradient of m's output from stage s+1
  kBackward,        // m's whole backward (input and weight gradients): gpipe, 1f1b
  kBackwardInput,   // zb-h1's B: the gradient of m's input only (keeps m's graph)
  kBackwardWeight,  // zb-h1's W: m's weight gradients (frees m's graph)
  kSendGradient,    // the gradient of m's input to stage s-1
};
std::string actionName(ActionKind kind);  // "F", "B", "W", "send-act", ...
bool isCompute(ActionKind kind);          // F, B, Bi, W
bool isReceive(ActionKind kind);          // recv-act, recv-grad

struct Action {
  ActionKind kind;
  int microBatch;
  bool operator==(const Action& o) const { return kind == o.kind && microBatch == o.microBatch; }
};

using StageProgram = std::vector<Action>;

// The programs of all `stages` stages (index = stage) for `microBatches` micro-batches.
// ConfigError when stages < 1 or microBatches < 1.
std::vector<StageProgram> buildSchedule(PipelineSchedule schedule, int stages, int microBatches);

// "" when `programs` is a valid schedule of `microBatches` micro-batches, else the first
// violation found, in words: every micro-batch forwarded once and backed up once (B or B+W, W
// after B), forward before backward, a receive before the action that uses it and a send after
// the one that produces it, sends and receives pairing up in the same order on both ends of
// every link, and the whole schedule running to the end when receives block and sends do not.
std::string checkSchedule(const std::vector<StageProgram>& programs, int microBatches);

// The most micro-batches stage program `program` holds at once: forwarded, and whose last
// backward action (B, or W for zb-h1) has not yet run. What the memory model assumes:
// gpipe M, 1f1b min(K-s, M), zb-h1 min(K, M).
int peakInFlight(const StageProgram& program);

// Compute times of one micro-batch on one stage, in any unit; transfers take `transfer`; a
// stage with a quota computes within its budget per period (StageCosts).
struct StageCosts {
  double forward = 1.0;
  double backwardInput = 1.0;   // B (kBackward costs backwardInput + backwardWeight)
  double backwardWeight = 1.0;  // W
  double transfer = 0.0;        // one activation or gradient message, send to receive
  // A budget per period (a cgroup's CPU quota, scripts/netns_hosts.sh): with quotaPeriod > 0,
  // the stage computes at most quotaBudget of the times above in each period [i P + phase,
  // (i + 1) P + phase), across its actions; what is left of an action waits for the next
  // period. Waiting for a receive spends none of it. 0: no budget.
  double quotaPeriod = 0.0;
  double quotaBudget = 0.0;
  double quotaPhase = 0.0;  // in [0, quotaPeriod)
};

struct ScheduleSpan {
  ActionKind kind;
  int microBatch;
  double start, end;
};

struct ScheduleSimulation {
  double makespan = 0.0;     // the step: first action to the last stage done
  std::vector<double> busy;  // per stage: time computing
  // Per stage: each compute action's interval (where a budget stops it, each stretch it computes).
  std::vector<std::vector<ScheduleSpan>> spans;
  // Idle compute over all stages: 1 - sum(busy) / (stages * makespan).
  double bubbleFraction() const;
};

// Runs the programs with per-stage costs (costs.size() == programs.size(), or one entry for
// all): each stage runs its actions in order, a receive waits for its send plus the transfer
// time, sends do not wait. checkSchedule must have passed (else CARAVAN_CHECK fails).
ScheduleSimulation simulateSchedule(const std::vector<StageProgram>& programs,
                                    const std::vector<StageCosts>& costs);

}  // namespace caravan
