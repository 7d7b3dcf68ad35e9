// Metrics file and terminal progress (see metrics.h).
#include "train/metrics.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "core/errors.h"
#include "core/files.h"

namespace caravan {

std::string boundedQuote(std::string_view text, size_t limit) {
  if (text.size() <= limit) return std::string(text);
  return fmt::format("{}... ({} bytes in all)", text.substr(0, limit), text.size());
}

std::vector<MetricsLine> readMetricsLines(std::string_view text) {
  std::vector<MetricsLine> lines;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    const bool complete = end != std::string_view::npos;
    if (!complete) end = text.size();
    MetricsLine line;
    line.number = lines.size() + 1;
    line.text = text.substr(pos, end - pos);
    pos = end + 1;
    if (line.text.find_first_not_of(" \t\r") != std::string_view::npos) {
      try {
        line.record = nlohmann::json::parse(line.text);
        if (!line.record.is_object()) {
          line.record = nullptr;
          line.problem = "is not a JSON object";
        }
      } catch (const nlohmann::json::exception& e) {
        // parse_error, or out_of_range for a number past double's range. Its message quotes
        // the text it last read, which may be the whole line.
        line.record = nullptr;
        line.problem = "is not JSON (" + boundedQuote(e.what(), 200) + ")";
      }
      line.cut = !complete && !line.problem.empty();
    }
    lines.push_back(std::move(line));
  }
  return lines;
}

namespace {
// A record of work after step `step` (redone after a resume from it).
bool laterThan(const nlohmann::json& record, int64_t step) {
  if (!record.is_object()) return false;
  const auto it = record.find("step");
  if (it == record.end() || !it->is_number_integer()) return false;
  return it->is_number_unsigned() ? it->get<uint64_t>() > static_cast<uint64_t>(step)
                                  : it->get<int64_t>() > step;
}
}  // namespace

MetricsSink::MetricsSink(const std::string& path, int64_t keepUpToStep) : path_(path) {
  if (keepUpToStep >= 0) {
    std::string why, kept;
    // A run directory whose metrics.jsonl was removed has nothing to keep.
    const bool exists = ::access(path.c_str(), F_OK) == 0;
    const std::optional<std::string> text =
        exists ? readRegularFile(path, &why) : std::optional<std::string>("");
    if (!text) {
      throw IoError(
          fmt::format("cannot read {}: it {}; restore the run's metrics file (a "
                      "regular file) or move that away",
                      path, why));
    }
    for (const MetricsLine& line : readMetricsLines(*text)) {
      if (line.cut) continue;  // a killed run's half-written record
      if (!laterThan(line.record, keepUpToStep)) kept.append(line.text).push_back('\n');
    }
    writeFileAtomic(path, kept);
  }
  file_ = std::fopen(path.c_str(), "a");
  if (file_ == nullptr) {
    throw IoError(fmt::format("cannot open {}: {}", path, std::strerror(errno)));
  }
}

MetricsSink::~MetricsSink() {
  if (file_ != nullptr) std::fclose(file_);
}

void MetricsSink::write(const nlohmann::json& record) {
  std::string line = record.dump() + "\n";
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw IoError(fmt::format("cannot write {}: {} (free disk space)", path_, std::strerror(errno)));
  }
}

namespace {
std::string formatDuration(double seconds) {
  if (!(seconds >= 0) || seconds > 1e7) return "--:--";
  auto s = static_cast<int64_t>(seconds);
  if (s >= 3600) return fmt::format("{}:{:02d}:{:02d}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{:02d}:{:02d}", s / 60, s % 60);
}
}  // namespace

Progress::Progress(std::FILE* out, bool tty, bool quiet, int64_t totalSteps, int64_t logEvery)
    : out_(out), tty_(tty), quiet_(quiet), total_(totalSteps), logEvery_(logEvery) {
  start_ = std::chrono::steady_clock::now();
  lastDraw_ = start_ - std::chrono::seconds(1);
}

void Progress::update(int64_t step, int64_t epoch, double loss, double lr, double samplesPerS,
                      double secondsLeft) {
  if (quiet_) return;
  auto now = std::chrono::steady_clock::now();
  if (startStep_ < 0) {
    startStep_ = step - 1;
    start_ = now;
  }
  double elapsed = std::chrono::duration<double>(now - start_).count();
  double perStep = step > startStep_ ? elapsed / static_cast<double>(step - startStep_) : 0.0;
  double eta = std::min(perStep * static_cast<double>(total_ - step), std::max(0.0, secondsLeft));
  if (tty_) {
    if (now - lastDraw_ < std::chrono::milliseconds(100) && step != total_) return;
    lastDraw_ = now;
    constexpr int kWidth = 24;
    int filled = total_ > 0 ? static_cast<int>(kWidth * step / total_) : 0;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(kWidth, '.');
    std::fprintf(out_, "\r[%s] step %lld/%lld ep %lld loss %.4f lr %.3g %.0f samples/s ETA %s\x1b[K",
                 bar.c_str(), static_cast<long long>(step), static_cast<long long>(total_),
                 static_cast<long long>(epoch), loss, lr, samplesPerS, formatDuration(eta).c_str());
    std::fflush(out_);
    barShown_ = true;
  } else if (step % logEvery_ == 0 || step == total_) {
    std::fprintf(out_, "step %lld/%lld epoch %lld loss %.4f lr %.4g %.1f samples/s eta %s\n",
                 static_cast<long long>(step), static_cast<long long>(total_),
                 static_cast<long long>(epoch), loss, lr, samplesPerS, formatDuration(eta).c_str());
    std::fflush(out_);
  }
}

void Progress::line(const std::string& text) {
  if (quiet_) return;
  if (barShown_) std::fputs("\r\x1b[K", out_);
  std::fprintf(out_, "%s\n", text.c_str());
  std::fflush(out_);
  barShown_ = false;
  lastDraw_ = std::chrono::steady_clock::now() - std::chrono::seconds(1);
}

void Progress::finish() {
  if (quiet_) return;
  if (barShown_) std::fputs("\n", out_);
  barShown_ = false;
  std::fflush(out_);
}

}  // namespace caravan
