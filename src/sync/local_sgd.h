// Local SGD (sync.mode = "local-sgd"): each worker takes `period` (H) optimizer steps on its own
// gradients, then the workers average their parameters with one all-reduce. With
// `postLocalAfter` = K > 0 the first K steps are BSP all-reduce of gradients ("post-local
// SGD", Lin et al. 2020), local steps after that.
//
// Consistency: replicas are equal right after each averaging (and at start); in between each
// worker sees only its own updates, at most H-1 steps of the others' missing. Optimizer state
// (momentum) stays local (ours). H = 1 with plain SGD equals BSP all-reduce up to float
// rounding: the mean of (x - lr*g_k) is x - lr*mean(g_k).
//
// With `compression` int8 or int4 the averaging is DiLoCo's exchange (diloco.h) with outer lr 1
// and no outer momentum: each worker sends its parameters' change since the last averaging,
// quantized with error feedback, and every worker adds the mean change to the last averaged
// parameters. Its residuals are in checkpoints.
//
// Threading: trainer thread, except the inner all-reduce's gradient hooks (see allreduce.h).
#pragma once

#include <memory>

#include "sync/allreduce.h"
#include "sync/diloco.h"
#include "sync/sync_mode.h"

namespace caravan {

struct LocalSgdOptions {
  int64_t period = 4;          // H: steps between averagings, >= 1
  int64_t postLocalAfter = 0;  // K: BSP all-reduce for steps [0, K)
  AllReduceOptions allreduce;  // the BSP phase's buckets
  Compression compression = Compression::kNone;  // the averaging's: none, int8 or int4
};

class LocalSgdStrategy : public Strategy {
 public:
  LocalSgdStrategy(std::shared_ptr<Communicator> comm, LocalSgdOptions options);
  std::string name() const override { return syncModeName(SyncMode::kLocalSgd); }
  void attachModel(torch::nn::Module& model) override;
  void beforeForward(int64_t step) override;
  void finishGradients() override;
  void afterStep(int64_t step) override;
  double consolidate() override;
  std::map<std::string, at::Tensor> saveState() override;

 protected:
  void restoreState(const std::map<std::string, at::Tensor>& state, int64_t savedWorkers) override;

 private:
  bool bspPhase(int64_t step) const { return step < options_.postLocalAfter; }

  std::shared_ptr<Communicator> comm_;
  LocalSgdOptions options_;
  std::unique_ptr<AllReduceStrategy> bsp_;
  std::unique_ptr<DilocoStrategy> quantized_;   // int8/int4 averaging
  std::map<std::string, at::Tensor> restored_;  // a checkpoint's, until attachModel()
  torch::nn::Module* model_ = nullptr;
};

}  // namespace caravan
