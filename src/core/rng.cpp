// The default CPU generator's state (see rng.h).
#include "core/rng.h"

#include <mutex>

#include <ATen/CPUGeneratorImpl.h>

namespace caravan {

at::Tensor defaultRngState() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void setDefaultRngState(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

}  // namespace caravan
