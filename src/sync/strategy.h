// Strategy: how the workers of a data-parallel job keep their replicas in step. The step engine
// (train/data_parallel_step.h) calls the hooks; a strategy knows nothing about memory tiers or
// the data pipeline.
//
// attach(model, context) once, before the first step: everything a strategy needs from the run
// (optimizer, per-block parameter groups, a checkpoint's state, the event sink) comes in one
// AttachContext, applied in a fixed order before the strategy's own attachModel().
// Call order per step (trainer thread): beforeForward(step) -> forward/backward (the strategy
// may act on autograd's thread as gradients become ready) -> finishGradients() -> optimizer
// -> afterStep(step). consolidate() comes between steps, before evaluation and checkpoints.
// Threading: hooks are called from the trainer thread; anything a strategy does on autograd's
// thread it synchronizes itself.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/torch_fwd.h"
#include "memory/group_exchange.h"

namespace caravan {

using CommEventSink = std::function<void(const std::string& name,
                                         std::chrono::steady_clock::time_point start,
                                         std::chrono::steady_clock::time_point end)>;

// What the run hands a strategy when it attaches.
struct AttachContext {
  // The run's own optimizer (rank 0's is the one checkpoints hold). Strategies whose optimizer
  // runs elsewhere (parameter servers) seed it from this one and put its state back into it
  // for checkpoints (saveState).
  torch::optim::Optimizer* optimizer = nullptr;
  // Out-of-core weights (memory/weights.h): one group per block, exchanged as soon as the
  // block's gradients are final (needs supportsParameterGroups()); empty: the whole model.
  std::vector<std::vector<at::Tensor>> parameterGroups;
  // A checkpoint's strategy state (saveState of the run that wrote it) and how many workers
  // wrote it, which may differ from this job's (resharding); null for a new run.
  const std::map<std::string, at::Tensor>* restoredState = nullptr;
  int64_t savedWorkers = 0;
  // The steps already done: a resumed run's step, 0 for a new run (strategies whose schedule
  // depends on the step before afterStep() tells it, e.g. ps-diloco's rounds).
  int64_t startStep = 0;
  // (name, start, end) of each communication, for the timeline and the metrics; may be empty.
  CommEventSink sink;
};

// A record for metrics.jsonl that belongs to no one step window (docs/metrics.md), e.g. OSP's
// fraction moves: {"kind": kind, "step": step, numbers..., words...}.
struct StrategyEvent {
  std::string kind;
  int64_t step = 0;
  std::map<std::string, double> numbers;
  std::map<std::string, std::string> words;
};

class Strategy : public GroupExchange {
 public:
  virtual ~Strategy() = default;
  virtual std::string name() const = 0;
  // Called once, before the first step: takes the context (in this order: optimizer, start step,
  // sink, parameter groups, restored state), then attachModel(), e.g. broadcast rank 0's
  // parameters.
  void attach(torch::nn::Module& model, AttachContext context = {});
  virtual void beforeForward(int64_t step) {}
  // The step's learning rate, set before beforeForward; for strategies that run the
  // optimizer elsewhere (parameter servers).
  virtual void setLearningRate(double lr) {}
  // After backward, before clipping and the optimizer: every rank's .grad holds what the
  // optimizer should apply (e.g. the average over ranks, or the local gradient).
  virtual void finishGradients() = 0;
  // After the optimizer step: strategies that synchronize parameters act here.
  virtual void afterStep(int64_t step) {}
  // Makes every replica equal (the mean over ranks) where the strategy lets them drift apart
  // (local SGD, gossip), so evaluation and checkpoints see one model. Returns how far apart
  // they were (consensus distance, 0 for strategies that keep replicas equal).
  virtual double consolidate() { return 0.0; }
  // True when finishGradients() already installed the updated parameters (the optimizer runs
  // on servers): the step engine skips its own optimizer step.
  virtual bool updatesParameters() const { return false; }
  // After the last step on every rank (normal end or a stop): say goodbye to servers.
  virtual void finish() {}
  // The config keys whose rates move the parameters, for the advice after a non-finite loss.
  virtual std::string rateKeys() const { return "optim.lr"; }
  // True when the workers advance step by step together, so the trainer's per-step agreement
  // (mean loss, stop flags; one small all-reduce) costs no extra waiting. Asynchronous
  // strategies return false: the trainer then agrees only every train.log_every steps and at
  // the last step, and stop requests take effect at the next agreement.
  virtual bool lockstep() const { return true; }
  // Strategy-specific numbers for the next train record of metrics.jsonl (e.g. staleness,
  // stage-1 fraction), aggregated over the steps since the previous call.
  virtual std::map<std::string, double> takeMetrics() { return {}; }
  // Records since the last call, in order (every rank keeps them; rank 0 writes them).
  virtual std::vector<StrategyEvent> takeEvents() { return {}; }

  // Out-of-core weights (memory/weights.h) update each block as soon as its gradients are
  // final. A strategy that supports it exchanges gradients in the context's parameter groups;
  // finishGroup(g), callable from any thread, waits for group g's exchange and leaves its
  // final gradients in .grad (finishGradients() still finishes every group).
  // cancelGroupWaits() releases a finishGroup() waiting for a launch when the run is torn down
  // (it then throws).
  virtual bool supportsParameterGroups() const { return false; }
  void finishGroup(size_t group) override {}
  void cancelGroupWaits() override {}

  // Strategy state in checkpoints: on every rank, after consolidate(), before rank 0 writes
  // the checkpoint (a collective over the job). Puts state kept elsewhere into the context's
  // optimizer in its in-core form (the servers' optimizer state), and returns the strategy's
  // own tensors for the checkpoint (rank 0's return value is stored; e.g. every worker's top-k
  // residual).
  virtual std::map<std::string, at::Tensor> saveState() { return {}; }

 protected:
  // The strategy's own part of attach(), after the context was applied.
  virtual void attachModel(torch::nn::Module& model) = 0;
  // The context's parameter groups (only called when supportsParameterGroups()).
  virtual void useParameterGroups(std::vector<std::vector<at::Tensor>> groups) {}
  // A checkpoint's state (AttachContext::restoredState) and the number of workers that wrote
  // it: the strategy says what it keeps (e.g. the residuals' mean when that number differs).
  virtual void restoreState(const std::map<std::string, at::Tensor>& state,
                            int64_t savedWorkers) {}

  CommEventSink sink_;
  torch::optim::Optimizer* optimizer_ = nullptr;
  int64_t startStep_ = 0;  // AttachContext::startStep
};

}  // namespace caravan
