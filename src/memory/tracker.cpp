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
  constexpr double kKiB = 1024.0, kMiB = kKiB * 1024, kGiB = kMiB * 1024;
  // Rounded up past a unit's 1024 (1023.95 KiB): the next unit's 1.0.
  if (b >= kGiB || up(b / kMiB, 10) >= 1024.0) return fmt::format("{:.2f} GiB", up(b / kGiB, 100));
  if (b >= kMiB || up(b / kKiB, 10) >= 1024.0) return fmt::format("{:.1f} MiB", up(b / kMiB, 10));
  if (b >= kKiB) return fmt::format("{:.1f} KiB", up(b / kKiB, 10));
  return fmt::format("{} B", bytes);
}

}  // namespace caravan
