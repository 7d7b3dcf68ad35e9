// train.precision: which blocks run in bf16 (models/precision.h).
//   float32   every block in float32 (the default).
//   bf16      each block is timed both ways at the start (forward and backward on the run's
//             first batch, memory.profile_repeats times, after a warm-up) and runs in bf16
//             only where that was at least kMargin faster.
//   bf16-all  every block in bf16, untimed: the same choice on every run and machine.
// A CPU without bf16 instructions stays float32 and says so. A resumed run takes the choice its
// checkpoint recorded (TrainingState::bf16Blocks), so resuming stays exact.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/dataset.h"
#include "models/model.h"

namespace caravan {

struct PrecisionChoice {
  std::string requested = "float32";
  std::vector<bool> bf16;                           // per block, as applied to the model
  std::vector<double> float32Seconds, bf16Seconds;  // per block forward + backward (timed)
  std::vector<std::string> report;                  // lines for the terminal
  bool chosen = false;  // a bf16 choice was made (timed, every block, or the checkpoint's)
  // The checkpoint's record: one 0/1 per block ("0111", "000" for a timed choice of none) when
  // chosen, else "" (float32 asked for, or no bf16 instructions).
  std::string blocksText() const;
  // summary.json's precision_blocks: per block its label, bf16 or not, and (timed) both times.
  nlohmann::json blocksJson(const BlockModelImpl& model) const;
};

// bf16 where its forward + backward takes at most this fraction of float32's.
constexpr double kBf16Margin = 0.97;

// Chooses as train.precision = `requested` says (or as `resumed`, a checkpoint's blocksText,
// says when not empty) and applies the choice to `model`. `repeats`: timings per block and
// precision (medians).
PrecisionChoice choosePrecision(const std::string& requested, BlockModel& model,
                                const Batch& sample, int repeats, const std::string& resumed);

}  // namespace caravan
