// Byte counts (see accounting.h).
#include "memory/accounting.h"

#include <unistd.h>

#include <cctype>
#include <cmath>
#include <malloc.h>

#include <fstream>

#include <fmt/format.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "core/errors.h"
#include "memory/tracker.h"
#include "optim/fused.h"

namespace caravan {

int64_t tensorBytes(const std::vector<at::Tensor>& tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) {
    if (t.defined()) n += t.numel() * static_cast<int64_t>(t.element_size());
  }
  return n;
}

int64_t gradientBytes(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> grads;
  for (const auto& p : params) grads.push_back(p.grad());
  return tensorBytes(grads);
}

std::vector<at::Tensor> optimizerStateTensors(const torch::optim::OptimizerParamState& state) {
  std::vector<at::Tensor> all;
  if (const auto* s = dynamic_cast<const torch::optim::SGDParamState*>(&state)) {
    all = {s->momentum_buffer()};
  } else if (const auto* a = dynamic_cast<const torch::optim::AdamWParamState*>(&state)) {
    all = {a->exp_avg(), a->exp_avg_sq(), a->max_exp_avg_sq()};
  } else if (const auto* b = dynamic_cast<const torch::optim::AdamParamState*>(&state)) {
    all = {b->exp_avg(), b->exp_avg_sq(), b->max_exp_avg_sq()};
  }
  std::vector<at::Tensor> out;
  for (auto& t : all) {
    if (t.defined()) out.push_back(std::move(t));
  }
  return out;
}

std::vector<at::Tensor> optimizerStateTensors(torch::optim::Optimizer& optimizer,
                                              const at::Tensor& p) {
  auto it = optimizer.state().find(optimizerStateKey(p));
  if (it == optimizer.state().end()) return {};
  return optimizerStateTensors(*it->second);
}

int64_t optimizerStateBytes(const torch::optim::Optimizer& optimizer) {
  int64_t n = 0;
  for (const auto& [key, state] : optimizer.state()) n += tensorBytes(optimizerStateTensors(*state));
  return n;
}

void setModelStateBytes(MemoryTracker& memory, const std::vector<at::Tensor>& params,
                        const torch::optim::Optimizer& optimizer) {
  memory.set(MemoryCategory::kWeights, tensorBytes(params));
  memory.set(MemoryCategory::kGradients, gradientBytes(params));
  memory.set(MemoryCategory::kOptimizerState, optimizerStateBytes(optimizer));
}

int64_t residentBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return resident * static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
}

HeapBytes heapBytes() {
  const struct mallinfo2 m = ::mallinfo2();
  HeapBytes h;
  h.inUse = static_cast<int64_t>(m.uordblks + m.hblkhd);
  h.free = static_cast<int64_t>(m.fordblks);
  return h;
}

void releaseFreeHeap() { ::malloc_trim(0); }

int64_t parseBytes(const std::string& text, const std::string& key) {
  size_t i = 0;
  while (i < text.size() && std::isspace(static_cast<unsigned char>(text[i]))) ++i;
  if (i == text.size()) return 0;
  size_t used = 0;
  double value = 0.0;
  try {
    value = std::stod(text.substr(i), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(i + used);
  unit.erase(0, unit.find_first_not_of(' '));
  for (auto& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  double scale = -1.0;
  if (unit.empty() || unit == "b") scale = 1.0;
  if (unit == "k" || unit == "kib" || unit == "kb") scale = 1024.0;
  if (unit == "m" || unit == "mib" || unit == "mb") scale = 1024.0 * 1024;
  if (unit == "g" || unit == "gib" || unit == "gb") scale = 1024.0 * 1024 * 1024;
  if (unit == "t" || unit == "tib" || unit == "tb") scale = 1024.0 * 1024 * 1024 * 1024;
  // Hexadecimal ("0x10") is not a size stod should read; a size past 2^60 bytes is a typo, and
  // would overflow (it used to become 0: no limit); a nonzero size under one byte is too.
  const bool hex =
      text.size() > i + 1 && text[i] == '0' && (text[i + 1] == 'x' || text[i + 1] == 'X');
  const double bytes = value * scale;
  if (used == 0 || scale < 0 || !(value >= 0) || !std::isfinite(value) || hex ||
      bytes > std::ldexp(1.0, 60) || (bytes > 0 && bytes < 1)) {
    throw ConfigError(fmt::format("{} = \"{}\" is not a size; write e.g. \"2GiB\", \"512MiB\" or "
                                  "\"\" for no limit (units B, KiB, MiB, GiB, TiB; 1024-based)",
                                  key, text));
  }
  return static_cast<int64_t>(std::llround(bytes));
}

}  // namespace caravan
