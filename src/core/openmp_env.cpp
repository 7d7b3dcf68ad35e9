// OpenMP's wait policy (see openmp_env.h).
#include "core/openmp_env.h"

#include <unistd.h>

#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <strings.h>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/log.h"

namespace caravan {

namespace {
constexpr const char* kPolicy = "OMP_WAIT_POLICY";
constexpr const char* kSpinCount = "GOMP_SPINCOUNT";
constexpr const char* kSetByCaravan = "CARAVAN_OMP_SET";  // marks the value as ours
}  // namespace

void restartWithOpenMpWaits(char** argv, int64_t computeThreads, MatrixProducts products,
                            int localProcesses) {
  if (openMpWaitPolicySet()) return;
  // LibTorch's default: OMP_NUM_THREADS, else one thread per core (asking starts no thread).
  const int64_t threads = computeThreads > 0 ? computeThreads : at::get_num_threads();
  if (threads <= 1) return;
  const bool spin = products == MatrixProducts::kOpenMpPool && localProcesses <= 1;
  const char* name = spin ? kSpinCount : kPolicy;
  const std::string value = spin ? std::to_string(kOpenMpSpinCount) : "PASSIVE";
  setenv(name, value.c_str(), 1);
  setenv(kSetByCaravan, "1", 1);
  execv("/proc/self/exe", argv);
  logLine(fmt::format(
      "warning: could not restart with {}={} ({}); OpenMP's idle workers keep libgomp's "
      "default, which can slow runs of more than one thread: set it in the environment",
      name, value, std::strerror(errno)));
  unsetenv(name);
  unsetenv(kSetByCaravan);
}

bool openMpWaitPolicySet() {
  return std::getenv(kPolicy) != nullptr || std::getenv(kSpinCount) != nullptr;
}

bool openMpWorkersSpin() {
  const char* policy = std::getenv(kPolicy);
  const char* spins = std::getenv(kSpinCount);
  if (spins != nullptr) return std::strtoll(spins, nullptr, 10) != 0;
  return policy == nullptr || strcasecmp(policy, "PASSIVE") != 0;
}

std::string openMpWaitPolicy() {
  const bool ours = std::getenv(kSetByCaravan) != nullptr;
  if (const char* value = std::getenv(kPolicy)) {
    return fmt::format("{} ({})", value, ours ? "caravan's default" : "from the environment");
  }
  if (const char* spins = std::getenv(kSpinCount)) {
    return fmt::format("spin {} ({})", spins,
                       ours ? "caravan's default" : "GOMP_SPINCOUNT from the environment");
  }
  return "unset (libgomp's default: spin)";
}

}  // namespace caravan
