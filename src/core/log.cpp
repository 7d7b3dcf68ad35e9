// The process's log sink (see log.h).
#include "core/log.h"

#include <cstdio>
#include <mutex>
#include <utility>

namespace caravan {
namespace {

std::mutex& sinkMutex() {
  static std::mutex m;
  return m;
}

LogSink& sink() {
  static LogSink s;
  return s;
}

}  // namespace

LogSink setLogSink(LogSink next) {
  std::lock_guard<std::mutex> lock(sinkMutex());
  return std::exchange(sink(), std::move(next));
}

void logLine(const std::string& line) {
  std::lock_guard<std::mutex> lock(sinkMutex());
  if (sink()) {
    sink()(line);
  } else {
    std::fprintf(stderr, "caravan: %s\n", line.c_str());
  }
}

}  // namespace caravan
