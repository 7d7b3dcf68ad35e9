// The one way library code speaks to the person running a job (warnings, stall reports):
// logLine("warning: ...") hands one line to the process's sink, which by default writes
// "caravan: <line>" to stderr. Results, metrics and progress go to their own streams
// (train/metrics.h), never here.
//
// Threading: logLine may be called from any thread; lines are never interleaved. Install a
// sink (tests, an embedding program) before the threads that log start.
#pragma once

#include <functional>
#include <string>

namespace caravan {

using LogSink = std::function<void(const std::string& line)>;

// Replaces the sink; an empty function restores the default (stderr). Returns the old one.
LogSink setLogSink(LogSink sink);

void logLine(const std::string& line);

}  // namespace caravan
