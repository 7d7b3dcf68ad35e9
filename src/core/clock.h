// Wall-clock helpers shared by the trainer, the memory executor and the planner.
#pragma once

#include <chrono>

namespace caravan {

// Seconds elapsed since `t` on the steady clock.
inline double secondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

}  // namespace caravan
