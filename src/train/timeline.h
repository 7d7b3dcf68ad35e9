// Timeline: a per-rank Chrome-trace JSON file (chrome://tracing, Perfetto) of what a step
// spent its time on: forward, backward, each gradient bucket's communication, waits.
// Disabled (every call a no-op) when constructed with an empty path. Times count from the
// steady clock's epoch (Linux: boot), so the files of the ranks on one host share a time axis:
// merged (their traceEvents concatenated) they show every rank, e.g. each pipeline stage's
// forwards, backwards and receives side by side.
//
// Threading: complete() may be called from any thread (autograd's, the trainer's); flush()
// from the trainer thread at the end of the run.
#pragma once

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

namespace caravan {

class Timeline {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  Timeline(std::string path, int rank);
  bool enabled() const { return !path_.empty(); }
  // A complete event on `track` (a row in the viewer: 0 compute, 1 communication).
  void complete(const std::string& name, TimePoint start, TimePoint end, int track = 0);
  // Writes the file (atomically). Called at the end of the run; safe to call twice.
  void flush();

 private:
  struct Event {
    std::string name;
    double startUs;
    double durUs;
    int track;
  };
  std::string path_;
  int rank_;
  TimePoint origin_;
  std::mutex mutex_;
  std::vector<Event> events_;
};

}  // namespace caravan
