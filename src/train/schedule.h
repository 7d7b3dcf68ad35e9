// Learning-rate schedules: linear warm-up, then constant, step decay or cosine decay.
// Pure functions of the step, so a resumed run recomputes the schedule from the step alone.
#pragma once

#include <cstdint>
#include <string>

namespace caravan {

struct ScheduleOptions {
  std::string kind = "constant";  // constant | step | cosine
  double peakLr = 0.01;
  int64_t warmupSteps = 0;
  int64_t stepSize = 1000;  // step: decay every stepSize steps after warm-up
  double gamma = 0.1;       // step: decay factor
  double minLr = 0.0;       // cosine: final rate
  int64_t totalSteps = 1;   // cosine: the rate reaches minLr at this step
};

// The rate for 0-based step `step` (the step about to be taken).
double learningRate(const ScheduleOptions& options, int64_t step);

}  // namespace caravan
