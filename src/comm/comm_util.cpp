// Helpers shared by the communicator backends (see comm_util.h).
#include "comm/comm_util.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

namespace caravan::comm {

std::string formatRanks(const std::vector<int>& ranks) {
  if (ranks.empty()) return "no rank";
  std::string out = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i > 0) out += ", ";
    out += j == i ? std::to_string(ranks[i])
                  : fmt::format("{}{}{}", ranks[i], j == i + 1 ? ", " : "-", ranks[j]);
    i = j + 1;
  }
  return out;
}

std::vector<int> otherRanks(int rank, int size) {
  std::vector<int> out;
  for (int r = 0; r < size; ++r) {
    if (r != rank) out.push_back(r);
  }
  return out;
}

std::string dtypeName(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(type);
  }
}

std::string describeTensor(const at::Tensor& t) {
  return fmt::format("{} {} element{}", t.numel(), dtypeName(t.scalar_type()),
                     t.numel() == 1 ? "" : "s");
}

std::string formatDuration(std::chrono::milliseconds d) {
  if (d.count() >= 10000 && d.count() % 1000 == 0) return fmt::format("{} s", d.count() / 1000);
  return fmt::format("{} ms", d.count());
}

std::string errorLine(const std::exception& e) {
  std::string m;
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) {
    m = c->what_without_backtrace();
  } else {
    m = e.what();
  }
  auto nl = m.find('\n');
  if (nl != std::string::npos) m.resize(nl);
  // Gloo prefixes its messages with "[./gloo/transport/tcp/pair.cc:598] ".
  if (!m.empty() && m[0] == '[') {
    auto close = m.find("] ");
    if (close != std::string::npos && m.find(':') < close) m = m.substr(close + 2);
  }
  return m;
}

void checkTensor(const at::Tensor& t, const char* op, const char* name) {
  CARAVAN_CHECK(t.defined(), "{}: {} is undefined", op, name);
  CARAVAN_CHECK(t.device().is_cpu(), "{}: {} is on {}, communicators take CPU tensors", op, name,
                t.device().str());
  CARAVAN_CHECK(t.is_contiguous(), "{}: {} is not contiguous", op, name);
}

void checkReducible(const at::Tensor& t, ReduceOp op, const char* what) {
  const auto type = t.scalar_type();
  const bool floating = type == at::kFloat || type == at::kDouble || type == at::kBFloat16;
  CARAVAN_CHECK(floating || type == at::kLong || type == at::kInt,
                "{}: cannot reduce {} tensors", what, dtypeName(type));
  CARAVAN_CHECK(floating || op != ReduceOp::kAvg, "{}: AVG needs a floating-point tensor, got {}",
                what, dtypeName(type));
}

std::chrono::milliseconds atLeastOneMs(std::chrono::milliseconds timeout) {
  return std::max(timeout, std::chrono::milliseconds(1));
}

WorkPtr FailureLatch::refuseIfFailed() const {
  auto message = get();
  if (!message) return nullptr;
  // The message already starts with "rank N: ".
  return std::make_shared<ReadyWork>(std::make_exception_ptr(
      PeerError(fmt::format("communicator unusable after an earlier failure: {}", *message))));
}

}  // namespace caravan::comm
