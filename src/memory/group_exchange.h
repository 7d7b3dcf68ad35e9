// GroupExchange: how out-of-core weights (weights.h) wait for the workers' exchange of one
// block's gradients before updating the block, without knowing who exchanges them. A
// synchronization strategy (sync/strategy.h) implements it; train/ connects the two.
#pragma once

#include <cstddef>

namespace caravan {

class GroupExchange {
 public:
  virtual ~GroupExchange() = default;
  // Callable from any thread: returns once group `group`'s final (exchanged) gradients are in
  // the parameters' .grad.
  virtual void finishGroup(size_t group) = 0;
  // Releases a finishGroup() still waiting for its exchange to be launched when the run is torn
  // down (that call then throws). Any thread.
  virtual void cancelGroupWaits() = 0;
};

}  // namespace caravan
