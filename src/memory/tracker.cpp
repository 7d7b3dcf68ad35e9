// MemoryTracker (see tracker.h).
#include "memory/tracker.h"

#include <cmath>

#include <fmt/format.h>

namespace caravan {
namespace {

void raise(std::atomic<int64_t>& peak, int64_t value) {
  int64_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}

}  // namespace

void MemoryTracker::change(MemoryCategory c, int64_t delta) {
  const int64_t now = live_[index(c)].fetch_add(delta) + delta;
  raise(peak_[index(c)], now);
  raise(totalPeak_, total_.fetch_add(delta) + delta);
}

void MemoryTracker::add(MemoryCategory c, int64_t bytes) { change(c, bytes); }

void MemoryTracker::set(MemoryCategory c, int64_t bytes) {
  change(c, bytes - live_[index(c)].load());
}

void MemoryTracker::resetPeaks() {
  for (int i = 0; i < kMemoryCategories; ++i) peak_[i].store(live_[i].load());
  totalPeak_.store(total_.load());
}

std::string formatBytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

std::string formatBytesAtLeast(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const auto up = [](double v, double places) { return std::ceil(v * places) / places; };
  if (b >= 1024.0 * 1024 * 1024) {
    return fmt::format("{:.2f} GiB", up(b / (1024.0 * 1024 * 1024), 100));
  }
  if (b >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", up(b / (1024.0 * 1024), 10));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", up(b / 1024.0, 10));
  return fmt::format("{} B", bytes);
}

}  // namespace caravan
