// The step engine of a rank that holds the whole model (see data_parallel_step.h).
#include "train/data_parallel_step.h"

#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "memory/accounting.h"
#include "memory/tracker.h"
#include "memory/weights.h"
#include "sync/strategy.h"
#include "train/timeline.h"

namespace caravan {

DataParallelStep::DataParallelStep(BlockModel model, torch::optim::Optimizer& optimizer,
                                   StepOptions options, Parts parts)
    : StepEngine(optimizer, options), model_(std::move(model)), parts_(parts) {}

void DataParallelStep::computeGradients(const Batch& batch, int64_t step, StepResult& r) {
  const Clock::time_point start = Clock::now();
  if (parts_.strategy != nullptr) parts_.strategy->beforeForward(step);
  loss_ = forwardBackward(model_, batch, r, start);
  if (parts_.strategy != nullptr) parts_.strategy->finishGradients();
  r.syncEnd = Clock::now();
}

bool DataParallelStep::gradientsFinite(const StepResult&) {
  // With a strategy the exchanged gradients decide alone (equal on every rank of an
  // all-reduce; a rank's own loss is not), so replicas stay equal.
  bool finite = parts_.strategy != nullptr || std::isfinite(loss_.item<double>());
  for (const auto& p : model_->parameters()) {
    if (finite && p.grad().defined()) finite = at::isfinite(p.grad()).all().item<bool>();
  }
  return finite;
}

double DataParallelStep::clipGradients(double maxNorm, const StepResult&) {
  return torch::nn::utils::clip_grad_norm_(model_->parameters(), maxNorm);
}

std::vector<at::Tensor> DataParallelStep::trainedParameters() { return model_->parameters(); }

void DataParallelStep::update() {
  if (parts_.strategy != nullptr && parts_.strategy->updatesParameters()) return;  // servers did
  if (parts_.weights != nullptr) {
    parts_.weights->finishStep();
  } else {
    optimizer_.step();
  }
}

void DataParallelStep::afterUpdate(int64_t step, StepResult& r) {
  if (parts_.strategy != nullptr) parts_.strategy->afterStep(step);
  r.loss = loss_.item<double>();
  loss_ = at::Tensor();
}

void DataParallelStep::strategyLearningRate(double lr) {
  if (parts_.strategy != nullptr) parts_.strategy->setLearningRate(lr);
}

EvalResult DataParallelStep::evaluate(const Dataset& dataset, int64_t batchSize,
                                      int64_t maxBatches) {
  return caravan::evaluate(model_, dataset, batchSize, maxBatches, parts_.workers);
}

double DataParallelStep::consolidate() {
  return parts_.strategy != nullptr ? parts_.strategy->consolidate() : 0.0;
}

std::map<std::string, at::Tensor> DataParallelStep::strategyState() {
  return parts_.strategy != nullptr ? parts_.strategy->saveState()
                                    : std::map<std::string, at::Tensor>{};
}

void DataParallelStep::withWholeModel(const std::function<void()>& write) {
  if (parts_.workers != nullptr && parts_.workers->rank() != 0) {
    // Nothing to write here.
  } else if (parts_.weights != nullptr) {
    parts_.weights->withAllResident(write);  // the in-core format (weights.h)
  } else {
    write();
  }
  // The servers' optimizer state came into this optimizer for the file only.
  if (parts_.strategy != nullptr && parts_.strategy->updatesParameters()) {
    optimizer_.state().clear();
  }
}

void DataParallelStep::finish() {
  if (parts_.strategy != nullptr) parts_.strategy->finish();
}

void DataParallelStep::accountModelState(MemoryTracker& memory) {
  if (parts_.weights != nullptr) return;  // the store counts what it holds
  setModelStateBytes(memory, model_->parameters(), optimizer_);
}

// Out-of-core weights move between storages: the executor asks the store.
std::vector<at::Tensor> DataParallelStep::modelStateTensors() {
  return parts_.weights != nullptr ? std::vector<at::Tensor>{} : model_->parameters();
}

bool DataParallelStep::lockstep() const {
  return parts_.strategy == nullptr || parts_.strategy->lockstep();
}

std::map<std::string, double> DataParallelStep::takeMetrics() {
  return parts_.strategy != nullptr ? parts_.strategy->takeMetrics()
                                    : std::map<std::string, double>{};
}

// The strategy's records (e.g. "osp_fraction"), as they come (docs/metrics.md).
std::vector<nlohmann::json> DataParallelStep::takeRecords(int64_t, const StepResult&,
                                                          Clock::time_point, double seconds) {
  std::vector<nlohmann::json> records;
  if (parts_.strategy == nullptr) return records;
  for (StrategyEvent& e : parts_.strategy->takeEvents()) {
    nlohmann::json rec = {{"kind", e.kind}, {"step", e.step}, {"time_s", seconds}};
    for (const auto& [key, value] : e.numbers) rec[key] = value;
    for (const auto& [key, value] : e.words) rec[key] = value;
    records.push_back(std::move(rec));
  }
  return records;
}

void DataParallelStep::addSpans(Timeline& timeline, const StepResult& r,
                                Clock::time_point stepStart) const {
  addWholeModelSpans(timeline, r, stepStart, parts_.strategy != nullptr);
}

std::string DataParallelStep::rateKeys() const {
  return parts_.strategy != nullptr ? parts_.strategy->rateKeys() : StepEngine::rateKeys();
}

std::string DataParallelStep::memoryAdvice() const {
  return StepEngine::memoryAdvice() +
         (parts_.weights != nullptr
              ? ""
              : " (memory.weights = offload keeps weights and optimizer state on the tier)");
}

std::string DataParallelStep::describe() const {
  if (parts_.workers == nullptr) return "";
  return fmt::format(" per worker x {} workers ({}{})", parts_.workers->size(),
                     parts_.workers->backend(),
                     parts_.strategy != nullptr ? ", " + parts_.strategy->name() : "");
}

}  // namespace caravan
