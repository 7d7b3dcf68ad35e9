// Learning-rate schedules: linear warm-up, then constant, step decay or cosine decay.
// Pure functions of the step and, for a time horizon, of the training seconds so far (which a
// checkpoint records: TrainingState::elapsedSeconds), so a resumed run recomputes the schedule
// from what the checkpoint holds.
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
  int64_t totalSteps = 1;   // cosine, steps horizon: the rate reaches minLr at this step
  // cosine: what its progress counts. "steps": (step - warm-up) / (totalSteps - warm-up);
  // "time": training seconds / budgetSeconds (train.max_minutes), so the rate reaches minLr
  // when the run's time is up on any machine. Warm-up counts steps either way.
  std::string horizon = "steps";
  double budgetSeconds = 0.0;
};

// The rate for 0-based step `step` (the step about to be taken) after `trainSeconds` of
// training (read only by a time horizon).
double learningRate(const ScheduleOptions& options, int64_t step, double trainSeconds = 0.0);

}  // namespace caravan
