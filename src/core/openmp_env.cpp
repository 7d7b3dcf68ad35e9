// OpenMP's wait policy (see openmp_env.h).
#include "core/openmp_env.h"

#include <unistd.h>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "core/log.h"

namespace caravan {

namespace {
constexpr const char* kPolicy = "OMP_WAIT_POLICY";
constexpr const char* kSetByCaravan = "CARAVAN_OMP_SET";  // marks the value as ours
}  // namespace

void restartWithPassiveOpenMpWaits(char** argv, int64_t computeThreads, MatrixProducts products,
                                   int localProcesses) {
  if (openMpWaitPolicySet()) return;
  // Alone on the host, oneDNN's products keep libgomp's default.
  if (products == MatrixProducts::kOneDnn && localProcesses <= 1) return;
  // LibTorch's default: OMP_NUM_THREADS, else one thread per core (asking starts no thread).
  const int64_t threads = computeThreads > 0 ? computeThreads : at::get_num_threads();
  if (threads <= 1) return;
  setenv(kPolicy, "PASSIVE", 1);
  setenv(kSetByCaravan, "1", 1);
  execv("/proc/self/exe", argv);
  logLine(
      fmt::format("warning: could not restart with OMP_WAIT_POLICY=PASSIVE ({}); idle "
                  "OpenMP workers spin, which slows runs of more than one thread: set it "
                  "in the environment",
                  std::strerror(errno)));
  unsetenv(kPolicy);
  unsetenv(kSetByCaravan);
}

bool openMpWaitPolicySet() { return std::getenv(kPolicy) != nullptr; }

std::string openMpWaitPolicy() {
  const char* value = std::getenv(kPolicy);
  if (value == nullptr) return "unset (libgomp's default: spin)";
  const bool ours = std::getenv(kSetByCaravan) != nullptr;
  return fmt::format("{} ({})", value, ours ? "caravan's default" : "from the environment");
}

}  // namespace caravan
