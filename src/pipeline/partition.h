// Cutting a model's blocks into K contiguous pipeline stages (ALGORITHMS.md §3, the joint
// time + memory partition). From each block's measured forward and backward time and memory
// for one micro-batch, a dynamic program over contiguous block ranges picks the partition that
// minimises the slowest stage's time (the pipeline's steady-state period) while every stage
// fits the per-worker budget, counting the micro-batches in flight the schedule keeps on that
// stage (gpipe M, 1f1b min(K-s, M), zb-h1 min(K, M): peakInFlight). The common tools partition
// by parameter count or layer count instead; both are here as objectives too, for comparison.
//
// Memory of stage s over blocks [a, b): Σ stateBytes (weights, gradients, optimizer state) +
// inFlight(s) × Σ activationBytes (what a micro-batch's forward keeps until its backward).
// With recomputation allowed (memory.policy = auto), a stage that does not fit recomputes
// blocks: such a block keeps only its input per micro-batch in flight, costs its forward again
// in backward, and needs its activations for one micro-batch while its backward runs (counted
// with what the blocks before it keep then); blocks are picked by bytes saved per second of
// forward, until the stage fits. The dynamic program
// weighs those stage times like any other, so a cut that needs less recomputation wins. (Swap
// is not chosen for stages: the micro-batches in flight would share the tier's bandwidth.)
// Threading: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "pipeline/schedule.h"

namespace caravan {

struct BlockCost {
  std::string label;
  double forwardSeconds = 0.0;   // one micro-batch
  double backwardSeconds = 0.0;  // one micro-batch
  int64_t activationBytes = 0;   // kept from its forward until its backward, one micro-batch
  int64_t stateBytes = 0;        // weights + gradients + optimizer state
  int64_t parameterBytes = 0;    // weights alone (the parameter-count objective)
  int64_t inputBytes = 0;        // its input, one micro-batch (what recomputing it keeps)
};

enum class PartitionObjective {
  kTimeAndMemory,  // fastest period among partitions that fit (ours)
  kTimeOnly,       // fastest period, memory ignored
  kParameters,     // parameter bytes balanced (DeepSpeed's "parameters" method)
  kEven,           // equal block counts (evenPartition)
  kGiven,          // split points the user wrote (torch.distributed.pipelining's way)
};
// parallel.partition: "auto" (time and memory) | "time" | "parameters" | "even", or the blocks
// at which stages 1..K-1 start ("3,6,9": stage 1 starts at block 3, ...; `splits`).
// ConfigError otherwise.
struct PartitionChoice {
  PartitionObjective objective = PartitionObjective::kTimeAndMemory;
  std::vector<size_t> splits;  // kGiven
};
PartitionChoice parsePartition(const std::string& text);
// K + 1 boundaries from K - 1 split points over `blocks` blocks; ConfigError (naming what to
// write) unless they are K - 1 increasing block indices in (0, blocks).
std::vector<size_t> givenPartition(const std::vector<size_t>& splits, size_t blocks, int stages);

struct StageEstimate {
  size_t begin = 0, end = 0;       // blocks [begin, end)
  int inFlight = 0;                // micro-batches the schedule keeps at once
  double forwardSeconds = 0.0;     // per micro-batch
  double backwardSeconds = 0.0;    // per micro-batch
  double recomputeSeconds = 0.0;   // per micro-batch: the recomputed blocks' forwards again
  int64_t memoryBytes = 0;         // state + inFlight × activations (+ a recomputed block's)
  std::vector<size_t> recomputed;  // blocks that recompute (ascending)
};

struct Partition {
  std::vector<size_t> boundaries;  // K + 1 block indices
  std::vector<StageEstimate> stages;
  bool fits = true;             // every stage within the budget (always with no budget)
  double periodSeconds = 0.0;   // the slowest stage's forward + backward (+ recompute) per
                                // micro-batch
  double stepSeconds = 0.0;     // the schedule simulated with these stage times (transfers free)
  double bubbleFraction = 0.0;  // of that simulation
  // The smallest per-worker budget any partition of K stages fits (the one minimising the
  // largest stage's memory), for the message when nothing fits; for a given or even cut, the
  // smallest that cut fits.
  int64_t smallestBudget = 0;
};

// Block boundaries of K stages over n blocks: K + 1 increasing indices from 0 to n, every
// stage at least one block. evenPartition: as equal block counts as they can be, the earlier
// stages taking the remainder. ConfigError when stages > blocks.
std::vector<size_t> evenPartition(size_t blocks, int stages);

// `budget` <= 0: no memory limit. ConfigError when stages > blocks. With kTimeAndMemory and no
// partition that fits, returns the one with the smallest largest stage (fits = false).
// `recompute`: stages that do not fit the budget may recompute blocks (with any objective: the
// other objectives' cuts then recompute what their stages need). `given`: kGiven's boundaries.
Partition partitionBlocks(const std::vector<BlockCost>& blocks, int stages, int microBatches,
                          PipelineSchedule schedule, int64_t budget, PartitionObjective objective,
                          bool recompute = false, const std::vector<size_t>& given = {});

// The table `caravan plan` prints: one row per stage (blocks, time, memory, in flight).
std::string formatPartition(const std::vector<BlockCost>& blocks, const Partition& partition,
                            int64_t budget);

}  // namespace caravan
