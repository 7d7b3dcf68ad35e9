// Strategy::attach (see strategy.h): the context, applied in one order for every strategy.
#include "sync/strategy.h"

#include "core/errors.h"

namespace caravan {

void Strategy::attach(torch::nn::Module& model, AttachContext context) {
  optimizer_ = context.optimizer;
  startStep_ = context.startStep;
  sink_ = std::move(context.sink);
  if (!context.parameterGroups.empty()) {
    CARAVAN_CHECK(supportsParameterGroups(),
                  "strategy {} cannot exchange per parameter group "
                  "(validate() should have refused it)",
                  name());
    useParameterGroups(std::move(context.parameterGroups));
  }
  if (context.restoredState != nullptr) {
    restoreState(*context.restoredState, context.savedWorkers);
  }
  attachModel(model);
}

}  // namespace caravan
