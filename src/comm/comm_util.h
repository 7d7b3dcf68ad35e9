// Helpers shared by the communicator backends (gloo, mpi): argument checks, the wording of
// peer failures (which ranks, which operation), a Work that is done at issue time, and the
// sticky "this communicator already failed" latch.
//
// Threading: the free functions are pure; FailureLatch and ReadyWork are thread-safe.
#pragma once

#include <chrono>
#include <exception>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"

namespace caravan::comm {

// "rank 1", "ranks 1-3", "ranks 0, 2, 5-7"; "no rank" when empty.
std::string formatRanks(const std::vector<int>& ranks);
// Every rank of 0..size-1 but `rank`.
std::vector<int> otherRanks(int rank, int size);
// "float32", "bfloat16", "int64", ...
std::string dtypeName(at::ScalarType type);
// "7 float32 elements"
std::string describeTensor(const at::Tensor& t);
// "500 ms", "30 s"
std::string formatDuration(std::chrono::milliseconds d);
// One line from any exception: c10::Error without its backtrace, Gloo's "[file:line] " prefix
// removed, only the first line kept.
std::string errorLine(const std::exception& e);
// The contract every backend enforces on a tensor argument (a broken one is a bug in the
// caller): defined, on the CPU, contiguous.
void checkTensor(const at::Tensor& t, const char* op, const char* name);
// A reduction's dtype: float32, float64, bfloat16, int32 or int64; AVG needs a floating type.
void checkReducible(const at::Tensor& t, ReduceOp op, const char* what);
// Waits shorter than 1 ms count as 1 ms (0 must never mean "forever" underneath).
std::chrono::milliseconds atLeastOneMs(std::chrono::milliseconds timeout);

// A Work finished when it was issued: zero-element operations, local copies, or an operation
// refused because the communicator already failed (then wait() rethrows that error).
class ReadyWork : public Work {
 public:
  explicit ReadyWork(std::exception_ptr error = nullptr) : error_(std::move(error)) {}
  void wait(std::chrono::milliseconds) override {
    if (error_) std::rethrow_exception(error_);
  }
  bool isCompleted() override { return true; }

 private:
  std::exception_ptr error_;
};

// The first peer failure a communicator saw. After it, the ranks' operation sequences no longer
// line up, so every later operation fails at once with the original reason.
class FailureLatch {
 public:
  void set(const std::string& message) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!message_) message_ = message;
  }
  std::optional<std::string> get() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return message_;
  }
  // A ReadyWork carrying PeerError when failed, else null.
  WorkPtr refuseIfFailed() const;

 private:
  mutable std::mutex mutex_;
  std::optional<std::string> message_;
};

}  // namespace caravan::comm
