// What the machine lets this process allocate: the memory the kernel reports available
// (/proc/meminfo MemAvailable) and, where the process's control group limits memory (cgroup
// v2 memory.max, or v1 memory.limit_in_bytes), what that limit leaves; and what its own
// address-space limit (ulimit -v) leaves.
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

// What this process's address-space limit (RLIMIT_AS, `ulimit -v`) leaves it: the limit less
// its size now (VmSize in `procRoot`/self/status), with the limit; nullopt without a limit.
// Unlike the memory above, it is per process, not shared by the processes of a host.
struct AddressSpaceLeft {
  int64_t bytes = 0;
  int64_t limit = 0;
};
std::optional<AddressSpaceLeft> addressSpaceLeft(const std::string& procRoot = "/proc");

}  // namespace caravan
