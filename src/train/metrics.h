// What a user sees of a run: RUN_DIR/metrics.jsonl (one JSON object per line) and the
// terminal progress display (a bar on a TTY, plain periodic lines otherwise).
//
// Threading: both are used from the trainer thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

namespace caravan {

class MetricsSink {
 public:
  // Opens RUN_DIR/metrics.jsonl for appending. If `keepUpToStep` >= 0 (a resumed run), records
  // with a step greater than it are dropped first (they belong to work after the checkpoint
  // and will be redone), by an atomic rewrite; so is a last line that does not parse (cut
  // short when a run was killed). Every other line stays as it was.
  MetricsSink(const std::string& path, int64_t keepUpToStep);
  ~MetricsSink();
  MetricsSink(const MetricsSink&) = delete;
  MetricsSink& operator=(const MetricsSink&) = delete;

  // Writes one line and flushes it.
  void write(const nlohmann::json& record);

 private:
  std::FILE* file_ = nullptr;
  std::string path_;
};

class Progress {
 public:
  // `out` is the terminal stream (stderr); `tty` selects the bar; `quiet` prints nothing.
  Progress(std::FILE* out, bool tty, bool quiet, int64_t totalSteps, int64_t logEvery);
  void update(int64_t step, int64_t epoch, double loss, double lr, double samplesPerS);
  // A line that must appear whole (eval results, checkpoints, warnings): clears the bar first.
  void line(const std::string& text);
  void finish();

 private:
  std::FILE* out_;
  bool tty_;
  bool quiet_;
  int64_t total_;
  int64_t logEvery_;
  bool barShown_ = false;
  std::chrono::steady_clock::time_point start_;
  int64_t startStep_ = -1;
  std::chrono::steady_clock::time_point lastDraw_;
};

}  // namespace caravan
