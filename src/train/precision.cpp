// The per-block precision choice (see precision.h).
#include "train/precision.h"

#include <fmt/format.h>

#include "core/errors.h"
#include "memory/planner.h"
#include "models/precision.h"

namespace caravan {

std::string PrecisionChoice::blocksText() const {
  std::string text;
  for (bool b : bf16) text += b ? '1' : '0';
  return chosen ? text : "";
}

nlohmann::json PrecisionChoice::blocksJson(const BlockModelImpl& model) const {
  nlohmann::json blocks = nlohmann::json::array();
  for (size_t i = 0; i < bf16.size(); ++i) {
    nlohmann::json b = {{"block", model.blockLabel(i)}, {"bf16", static_cast<bool>(bf16[i])}};
    if (i < float32Seconds.size()) {
      b["float32_s"] = float32Seconds[i];
      b["bf16_s"] = bf16Seconds[i];
    }
    blocks.push_back(b);
  }
  return blocks;
}

namespace {

std::string blockList(const BlockModel& model, const std::vector<bool>& bf16, bool which) {
  std::string out;
  for (size_t i = 0; i < bf16.size(); ++i) {
    if (bf16[i] != which) continue;
    out += (out.empty() ? "" : ", ") + fmt::format("{} {}", i, model->blockLabel(i));
  }
  return out.empty() ? "none" : out;
}

}  // namespace

PrecisionChoice choosePrecision(const std::string& requested, BlockModel& model,
                                const Batch& sample, int repeats, const std::string& resumed) {
  PrecisionChoice c;
  c.requested = requested;
  const size_t n = model->numBlocks();
  c.bf16.assign(n, false);
  if (requested == "float32") {
    model->setBf16(c.bf16);
    return c;
  }
  if (!cpuRunsBf16()) {
    model->setBf16(c.bf16);
    c.report.push_back(fmt::format(
        "train.precision = {}: this CPU has no bf16 instructions (AVX512_BF16 or AMX-BF16), "
        "where bf16 runs slower than float32; the run stays float32 ({}=1 runs bf16 emulated)",
        requested, kEmulateBf16Env));
    return c;
  }
  if (!cpuHasBf16Instructions()) {
    c.report.push_back(fmt::format(
        "train.precision = {}: this CPU has no bf16 instructions; {}=1 runs bf16 anyway, "
        "emulated (slower than float32)",
        requested, kEmulateBf16Env));
  }
  if (!resumed.empty()) {
    if (resumed.size() != n) {
      throw CheckpointError(fmt::format(
          "the checkpoint's bf16 block choice has {} blocks, the model {}; it is damaged",
          resumed.size(), n));
    }
    for (size_t i = 0; i < n; ++i) c.bf16[i] = resumed[i] == '1';
    c.chosen = true;
    model->setBf16(c.bf16);
    c.report.push_back(fmt::format("precision: bf16 for blocks {} (the checkpoint's choice)",
                                   blockList(model, c.bf16, true)));
    return c;
  }
  if (requested == "bf16-all") {
    c.bf16.assign(n, true);
    c.chosen = true;
    model->setBf16(c.bf16);
    c.report.push_back("precision: bf16 for every block (train.precision = bf16-all)");
    return c;
  }
  CARAVAN_CHECK(requested == "bf16", "train.precision {}", requested);
  model->setBf16(std::vector<bool>(n, false));
  const ModelProfile f32 = profileModel(model, sample, repeats);
  model->setBf16(std::vector<bool>(n, true));
  const ModelProfile b16 = profileModel(model, sample, repeats);
  std::string timings;
  for (size_t i = 0; i < n; ++i) {
    c.float32Seconds.push_back(f32.blocks[i].forwardSeconds + f32.blocks[i].backwardSeconds);
    c.bf16Seconds.push_back(b16.blocks[i].forwardSeconds + b16.blocks[i].backwardSeconds);
    c.bf16[i] = c.bf16Seconds[i] <= kBf16Margin * c.float32Seconds[i];
    timings += fmt::format("{}{} {:.2f}/{:.2f}", i == 0 ? "" : ", ", model->blockLabel(i),
                           c.float32Seconds[i] * 1e3, c.bf16Seconds[i] * 1e3);
  }
  c.chosen = true;
  model->setBf16(c.bf16);
  c.report.push_back(fmt::format("precision: bf16 for blocks {}; float32 for {}",
                                 blockList(model, c.bf16, true), blockList(model, c.bf16, false)));
  c.report.push_back(fmt::format(
      "precision: forward+backward ms per block, float32/bf16 (bf16 where <= {:.2f}x): {}",
      kBf16Margin, timings));
  return c;
}

}  // namespace caravan
