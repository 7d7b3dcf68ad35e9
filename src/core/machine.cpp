// availableMemory (see machine.h).
#include "core/machine.h"

#include <sys/resource.h>

#include <algorithm>
#include <fstream>
#include <sstream>

namespace caravan {
namespace {

std::optional<int64_t> readNumber(const std::string& path) {
  std::ifstream in(path);
  std::string word;
  if (!(in >> word) || word == "max") return std::nullopt;
  try {
    size_t used = 0;
    const long long v = std::stoll(word, &used);
    if (used != word.size() || v < 0) return std::nullopt;
    return static_cast<int64_t>(v);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

std::optional<int64_t> memAvailable(const std::string& procRoot) {
  std::ifstream in(procRoot + "/meminfo");
  std::string key;
  int64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return std::nullopt;
}

// The limit of the process's memory control group and what it uses now.
std::optional<AvailableMemory> cgroupRoom(const std::string& procRoot,
                                          const std::string& cgroupRoot) {
  std::ifstream in(procRoot + "/self/cgroup");
  std::string line;
  while (std::getline(in, line)) {
    // "0::/path" (v2) or "4:memory:/path" (v1).
    const size_t a = line.find(':');
    const size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const std::string path = line.substr(b + 1);
    const bool v2 = controllers.empty();
    const bool v1 = controllers == "memory" || controllers.find("memory,") != std::string::npos ||
                    controllers.find(",memory") != std::string::npos;
    if (!v1 && !v2) continue;
    // The group's directory: inside a container the hierarchy is often mounted at the group (or
    // an ancestor of it), so the path's leading parts are dropped one by one until it exists.
    const std::string mount = v2 ? cgroupRoot : cgroupRoot + "/memory";
    const std::string limitFile = v2 ? "/memory.max" : "/memory.limit_in_bytes";
    const std::string usageFile = v2 ? "/memory.current" : "/memory.usage_in_bytes";
    std::optional<int64_t> limit, used;
    for (std::string tail = path;;) {
      std::ifstream probe(mount + tail + usageFile);
      if (probe) {
        limit = readNumber(mount + tail + limitFile);  // "max" (v2): none
        used = readNumber(mount + tail + usageFile);
        break;
      }
      if (tail.empty() || tail == "/") break;
      const size_t next = tail.find('/', 1);
      tail = next == std::string::npos ? "" : tail.substr(next);
    }
    // v1 reports "no limit" as a number near 2^63.
    if (limit && *limit >= (int64_t{1} << 62)) limit.reset();
    if (limit && used) {
      return AvailableMemory{std::max<int64_t>(*limit - *used, 0), *limit};
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<AvailableMemory> availableMemory(const std::string& procRoot,
                                               const std::string& cgroupRoot) {
  std::optional<AvailableMemory> best;
  if (const auto bytes = memAvailable(procRoot)) best = AvailableMemory{*bytes, 0};
  if (const auto room = cgroupRoom(procRoot, cgroupRoot)) {
    if (!best || room->bytes < best->bytes) best = room;
  }
  return best;
}

std::optional<AddressSpaceLeft> addressSpaceLeft(const std::string& procRoot) {
  struct rlimit limit {};
  if (::getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return std::nullopt;
  std::ifstream in(procRoot + "/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmSize:", 0) != 0) continue;
    std::istringstream fields(line.substr(7));  // "VmSize:  123456 kB"
    int64_t kib = 0;
    if (!(fields >> kib)) return std::nullopt;
    const auto cap = static_cast<int64_t>(std::min<rlim_t>(limit.rlim_cur, INT64_MAX));
    return AddressSpaceLeft{std::max<int64_t>(cap - kib * 1024, 0), cap};
  }
  return std::nullopt;
}

}  // namespace caravan
