// What a user sees of a run: RUN_DIR/metrics.jsonl (one JSON object per line) and the
// terminal progress display (a bar on a TTY, plain periodic lines otherwise).
//
// Threading: both are used from the trainer thread only.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace caravan {

// One line of a metrics.jsonl file as read back (by a resumed run and by `caravan report`).
struct MetricsLine {
  size_t number = 0;      // 1-based
  std::string_view text;  // the line without its newline (a view into the text read)
  nlohmann::json record;  // the JSON object on the line; null when blank or not an object
  std::string problem;    // why a non-blank line is not a record (at most ~200 characters)
  // The last line, without its newline, not a record: the signature of a run killed while
  // writing it. Any other line that is not a record is someone's data.
  bool cut = false;
};

// Every line of `text` (a metrics.jsonl file's contents). Never throws for any input: a line
// that does not parse (invalid JSON, a number out of double's range such as 1e400, invalid
// UTF-8) has `problem` set.
std::vector<MetricsLine> readMetricsLines(std::string_view text);

// At most `limit` bytes of `text` for an error message, with how much was left out.
std::string boundedQuote(std::string_view text, size_t limit = 120);

class MetricsSink {
 public:
  // Opens RUN_DIR/metrics.jsonl for appending. If `keepUpToStep` >= 0 (a resumed run), records
  // with an integer "step" greater than it are dropped first (they belong to work after the
  // checkpoint and will be redone), by an atomic rewrite; so is a cut last line (see
  // MetricsLine::cut). Every other line stays byte for byte, in its place.
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
  // `secondsLeft`: of train.max_minutes (infinity without): the ETA is the sooner of the two
  // ends, so a run bounded by time does not promise hours of steps it will not take.
  void update(int64_t step, int64_t epoch, double loss, double lr, double samplesPerS,
              double secondsLeft = std::numeric_limits<double>::infinity());
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
