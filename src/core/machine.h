// What the machine lets this process allocate: the memory the kernel reports available
// (/proc/meminfo MemAvailable) and, where the process's control group limits memory (cgroup
// v2 memory.max, or v1 memory.limit_in_bytes), what that limit leaves.
//
// Threading: free functions; any thread. Reads /proc and /sys on each call.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace caravan {

struct AvailableMemory {
  int64_t bytes = 0;
  int64_t cgroupLimit = 0;  // > 0: the bytes are what this limit leaves; 0: MemAvailable
};

// The smaller of the two, or nullopt when neither can be read (not Linux, no /proc).
// `procRoot` and `cgroupRoot` are for tests ("/proc", "/sys/fs/cgroup").
std::optional<AvailableMemory> availableMemory(const std::string& procRoot = "/proc",
                                               const std::string& cgroupRoot = "/sys/fs/cgroup");

}  // namespace caravan
