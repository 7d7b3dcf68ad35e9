// The train record's window (see metrics_window.h).
#include "train/metrics_window.h"

#include "memory/accounting.h"
#include "memory/executor.h"
#include "memory/host_allocator.h"
#include "memory/tracker.h"
#include "memory/weights.h"

namespace caravan {
namespace {

double seconds(MetricsWindow::Clock::time_point a, MetricsWindow::Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

MetricsWindow::MetricsWindow(Distributed* dist)
    : dist_(dist), bytes_(dist != nullptr ? dist->bytes() : ByteCount{}), start_(Clock::now()) {}

void MetricsWindow::addStep(const StepResult& r, int64_t samples) {
  compute_ += r.computeSeconds;
  sync_ += r.syncWaitSeconds;
  ++steps_;
  samples_ += static_cast<double>(samples);
}

RankWindow MetricsWindow::own() const {
  return {compute_ / steps_, sync_ / steps_, static_cast<double>(memoryPeak_)};
}

double MetricsWindow::samplesPerSecond() const {
  const double s = seconds(start_, Clock::now());
  return s > 0 ? samples_ / s : 0.0;
}

nlohmann::json MetricsWindow::close(nlohmann::json rec, MemoryTracker& memory,
                                    ActivationExecutor* executor, OutOfCoreWeights* weights,
                                    const std::map<std::string, double>& engineMetrics) {
  const double steps = static_cast<double>(steps_);
  rec["compute_s"] = compute_ / steps;
  rec["sync_wait_s"] = sync_ / steps;
  // Tracked memory over the window (peaks) and the process's resident set now.
  rec["mem_activations_peak"] = memory.peak(MemoryCategory::kActivations);
  rec["mem_weights"] = memory.live(MemoryCategory::kWeights);
  rec["mem_gradients"] = memory.live(MemoryCategory::kGradients);
  rec["mem_optimizer_state"] = memory.live(MemoryCategory::kOptimizerState);
  rec["mem_tracked_peak"] = memory.totalPeak();
  rec["rss_bytes"] = residentBytes();
  const HeapBytes heap = heapBytes();
  rec["heap_in_use_bytes"] = heap.inUse;
  rec["heap_free_bytes"] = heap.free;
  if (HostAllocator::installed()) {
    const HostAllocator::Stats h = HostAllocator::instance().stats();
    rec["host_mapped_bytes"] = h.mapped;
    rec["host_cached_bytes"] = h.cached;
  }
  memory.resetPeaks();
  if (executor != nullptr) {
    const ExecutorStats x = executor->takeStats();
    rec["offloaded_bytes"] = static_cast<double>(x.bytesOffloaded) / steps;
    rec["recompute_s"] = x.recomputeSeconds / steps;
    rec["swap_stall_s"] = x.stallSeconds / steps;
  }
  if (weights != nullptr) {
    const WeightStats w = weights->takeStats();
    rec["weights_read_bytes"] = static_cast<double>(w.bytesRead) / steps;
    rec["weights_written_bytes"] = static_cast<double>(w.bytesWritten) / steps;
    rec["weights_update_s"] = w.updateSeconds / steps;
    rec["weights_stall_s"] = w.stallSeconds / steps;
  }
  if (dist_ != nullptr) {
    // This rank's bytes per step over the window, and the engine's own numbers.
    const ByteCount b = dist_->bytes();
    rec["sent_bytes"] = static_cast<double>(b.sent - bytes_.sent) / steps;
    rec["recv_bytes"] = static_cast<double>(b.received - bytes_.received) / steps;
    bytes_ = b;
    for (const auto& [key, value] : engineMetrics) rec[key] = value;
    // Time with an exchange outstanding per step (hidden behind compute or not).
    if (const auto outstanding = dist_->takeOutstandingSeconds()) {
      rec["comm_outstanding_s"] = *outstanding / steps;
    }
    if (ranks_.size() == static_cast<size_t>(dist_->workers()->size())) {
      std::vector<double> compute, wait, peak;
      for (const RankWindow& w : ranks_) {
        compute.push_back(w.computeS);
        wait.push_back(w.syncWaitS);
        peak.push_back(w.trackedPeakBytes);
      }
      rec["rank_compute_s"] = compute;
      rec["rank_sync_wait_s"] = wait;
      rec["rank_mem_tracked_peak"] = peak;
    }
    ranks_.clear();
  }
  samples_ = 0.0;
  compute_ = sync_ = 0.0;
  steps_ = 0;
  memoryPeak_ = 0;
  start_ = Clock::now();
  return rec;
}

}  // namespace caravan
