// MemoryTracker: the bytes of the tensors a training run holds, live and peak, by category:
// activations saved for backward (counted as autograd saves and frees them, through
// saved_tensors.h), weights, gradients and optimizer state (measured totals, set by the
// trainer). The peak of the sum is tracked too: it is what memory.budget bounds.
//
// Activations are counted by storage: several saved tensors sharing one storage (a view, or
// one op's output saved by the next op too) count it once, and a saved view holds its whole
// storage, so it counts the whole storage.
//
// Threading: any thread (atomic counters); peaks are exact under concurrent updates.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <string>

namespace caravan {

enum class MemoryCategory { kActivations = 0, kWeights, kGradients, kOptimizerState };
inline constexpr int kMemoryCategories = 4;

class MemoryTracker {
 public:
  // Bytes that come and go (activations).
  void add(MemoryCategory c, int64_t bytes);
  // A measured total replaces the category's live bytes.
  void set(MemoryCategory c, int64_t bytes);

  int64_t live(MemoryCategory c) const { return live_[index(c)].load(); }
  int64_t peak(MemoryCategory c) const { return peak_[index(c)].load(); }
  int64_t totalLive() const { return total_.load(); }
  int64_t totalPeak() const { return totalPeak_.load(); }
  // Peaks restart from the live values (e.g. per log window).
  void resetPeaks();

 private:
  static int index(MemoryCategory c) { return static_cast<int>(c); }
  void change(MemoryCategory c, int64_t delta);

  std::array<std::atomic<int64_t>, kMemoryCategories> live_{}, peak_{};
  std::atomic<int64_t> total_{0}, totalPeak_{0};
};

// "1.5 GiB", "512 MiB", "900 KiB", "12 B".
std::string formatBytes(int64_t bytes);
// As formatBytes, rounded up at its last digit: a size suggested as enough (the smallest budget
// that works) is at least `bytes` when read back (3284143 bytes: "3.2 MiB", not "3.1 MiB").
std::string formatBytesAtLeast(int64_t bytes);

}  // namespace caravan
