// Learning-rate schedules (see schedule.h).
#include "train/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/errors.h"

namespace caravan {

double learningRate(const ScheduleOptions& o, int64_t step, double trainSeconds) {
  CARAVAN_CHECK(step >= 0, "step {}", step);
  if (step < o.warmupSteps) {
    return o.peakLr * static_cast<double>(step + 1) / static_cast<double>(o.warmupSteps);
  }
  const int64_t s = step - o.warmupSteps;
  if (o.kind == "constant") return o.peakLr;
  if (o.kind == "step") {
    return o.peakLr * std::pow(o.gamma, static_cast<double>(s / std::max<int64_t>(1, o.stepSize)));
  }
  if (o.kind == "cosine") {
    double progress = 0.0;
    if (o.horizon == "time") {
      CARAVAN_CHECK(o.budgetSeconds > 0, "a time horizon needs a budget");
      progress = std::clamp(trainSeconds / o.budgetSeconds, 0.0, 1.0);
    } else {
      const int64_t span = std::max<int64_t>(1, o.totalSteps - o.warmupSteps);
      progress = std::min(1.0, static_cast<double>(s) / static_cast<double>(span));
    }
    return o.minLr + (o.peakLr - o.minLr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  }
  CARAVAN_CHECK(false, "unknown schedule kind {}", o.kind);
  return 0.0;
}

}  // namespace caravan
