// Strategy: how the workers of a data-parallel job keep their replicas in step. The training
// loop calls the hooks; a strategy knows nothing about memory tiers or the data pipeline.
//
// Call order per step (trainer thread): beforeForward(step) -> forward/backward (the strategy
// may act on autograd's thread as gradients become ready) -> finishGradients() -> optimizer.
// Threading: hooks are called from the trainer thread; anything a strategy does on autograd's
// thread it synchronizes itself.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace torch {
namespace nn {
class Module;
}
}  // namespace torch

namespace caravan {

class Strategy {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // Called once, before the first step: e.g. broadcast rank 0's parameters.
  virtual void attach(torch::nn::Module& model) = 0;
  virtual void beforeForward(int64_t step) {}
  // After backward, before clipping and the optimizer: every rank's .grad holds what the
  // optimizer should apply (e.g. the average over ranks).
  virtual void finishGradients() = 0;
};

}  // namespace caravan
