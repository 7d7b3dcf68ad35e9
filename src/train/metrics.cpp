// Metrics file and terminal progress (see metrics.h).
#include "train/metrics.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "core/errors.h"
#include "train/checkpoint.h"

namespace caravan {

MetricsSink::MetricsSink(const std::string& path, int64_t keepUpToStep) : path_(path) {
  if (keepUpToStep >= 0) {
    std::ifstream in(path);
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    std::string kept;
    for (size_t i = 0; i < lines.size(); ++i) {
      auto j = nlohmann::json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
      if (j.is_discarded() || !j.is_object()) {
        // Only the last line is a killed run's signature (cut short while written); anything
        // else that does not parse is someone's data, kept as it is.
        if (i + 1 < lines.size()) kept += lines[i] + "\n";
        continue;
      }
      const auto step = j.find("step");
      const bool later =
          step != j.end() && step->is_number_integer() && step->get<int64_t>() > keepUpToStep;
      if (!later) kept += lines[i] + "\n";  // records after the checkpoint are redone
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

void Progress::update(int64_t step, int64_t epoch, double loss, double lr, double samplesPerS) {
  if (quiet_) return;
  auto now = std::chrono::steady_clock::now();
  if (startStep_ < 0) {
    startStep_ = step - 1;
    start_ = now;
  }
  double elapsed = std::chrono::duration<double>(now - start_).count();
  double perStep = step > startStep_ ? elapsed / static_cast<double>(step - startStep_) : 0.0;
  double eta = perStep * static_cast<double>(total_ - step);
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
