#include "sim/workload.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <set>

#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include "core/config.h"
#include "core/errors.h"
#include "memory/accounting.h"
#include "memory/planner.h"
#include "memory/saved_tensors.h"
#include "memory/tracker.h"
#include "sync/sharding.h"
#include "train/memory_setup.h"
#include "train/precision.h"
#include "train/run_setup.h"
#include "train/setup.h"

namespace caravan::sim {

namespace {

// The caller's thread counts, put back when the profile is done: a run's rank 0 that searches
// its layout (parallel.layout = auto) goes on training with its own (train.threads = 0: every
// core), not the profile's one.
class KeepThreadCounts {
 public:
  KeepThreadCounts() : torch_(at::get_num_threads()), blas_(blasThreads()) {}
  ~KeepThreadCounts() {
    at::set_num_threads(torch_);
    if (blas_ > 0) setBlasThreads(blas_);
  }
  KeepThreadCounts(const KeepThreadCounts&) = delete;
  KeepThreadCounts& operator=(const KeepThreadCounts&) = delete;

 private:
  int torch_, blas_;
};

}  // namespace

Workload measureWorkload(const Config& config) {
  const RunOptions options = RunOptions::read(config);
  const KeepThreadCounts keep;
  RuntimeOptions runtime = options.runtime;
  // One thread unless the config says otherwise: the libraries' default (every core) is not
  // what a worker gets on a host it shares.
  runtime.threads = std::max<int64_t>(1, runtime.threads);
  applyRuntimeOptions(runtime);
  installSavedTensorEngine();
  RunSetup setup = RunSetup::forInspection(config);
  setup.model->train();
  const Batch sample = setup.sampleBatch();
  // train.precision as a run makes it (bf16: each block timed both ways on this host).
  const int repeats = std::max<int>(2, static_cast<int>(options.memory.profileRepeats));
  const PrecisionChoice precision =
      choosePrecision(options.runtime.precision, setup.model, sample, repeats, "");

  Workload w;
  w.model = setup.model->modelName();
  w.bf16Blocks = static_cast<int>(std::count(precision.bf16.begin(), precision.bf16.end(), true));
  w.batchPerWorker = sample.size();
  w.epochExamples = setup.data.train->size();
  w.threads = static_cast<int>(runtime.threads);
  // The refusal caravan train gives when memory.policy = auto fits no plan under memory.budget
  // (for the run's own memory.weights only: the other way is measured whatever it fits).
  auto refuseIfNoPlanFits = [&](const ActivationMemory& a) {
    if (!options.memory.automatic() || a.plan->fits) return;
    throw ConfigError(
        fmt::format("memory.budget = {} fits no plan for this model and batch "
                    "(caravan plan says what fits); caravan train would refuse it",
                    options.memory.budgetText));
  };
  // memory.weights = offload as the run's planner predicts it (one worker, sync.shard = none):
  // planned first, on a profile of its own, and let go before the in-core plan.
  double offloadStepSeconds = 0.0;
  {
    RunOptions offload = options;
    offload.memory.offloadWeights = true;
    offload.sync.shard = ShardLevel::kNone;
    try {
      const ActivationMemory o =
          makeActivationMemory(offload, setup.model, sample, /*alwaysPlan=*/true);
      if (options.memory.offloadWeights) refuseIfNoPlanFits(o);
      w.offload.measured = true;
      w.offload.windowBytes = o.persistent;
      w.offload.activationPeakBytes = o.plan->prediction.peakBytes;
      offloadStepSeconds =
          std::max(o.plan->prediction.stepSeconds, o.plan->prediction.updatesEndSeconds);
    } catch (const ConfigError&) {
      if (options.memory.offloadWeights) throw;  // the run's own way: as train would refuse it
    }
  }
  // The in-core plan (memory.weights = core; its profile is the one the planner measured).
  RunOptions inCore = options;
  inCore.memory.offloadWeights = false;
  ActivationMemory m = makeActivationMemory(inCore, setup.model, sample, /*alwaysPlan=*/true);
  CARAVAN_CHECK(m.profile.has_value(), "a plan without a profile");
  const ModelProfile& profile = *m.profile;
  // What sync.shard = parameters would gather in bf16 (whatever sync.shard the config says:
  // --recommend ranks it too).
  const std::set<const c10::TensorImpl*> bf16Gathered = bf16GatheredParameters(setup.model, sample);
  for (size_t i = 0; i < profile.blocks.size(); ++i) {
    const BlockProfile& b = profile.blocks[i];
    w.forwardSeconds.push_back(b.forwardSeconds);
    w.backwardSeconds.push_back(b.backwardSeconds);
    w.inputBytes.push_back(b.inputBytes);
    const std::vector<at::Tensor> params = setup.model->block(i).ptr()->parameters();
    w.parameterBytes.push_back(tensorBytes(params));
    w.gatherBytes.push_back(gatherBytes(params, bf16Gathered));
    w.planner.savedBytes.push_back(b.savedBytes);
    w.planner.keepBackwardSeconds.push_back(b.backwardSeconds);
  }
  // How the times shrink with the batch (micro-batches, perMicroBatch): profiles at a sixteenth
  // and a quarter of it, each time as a share of the full batch's.
  for (const int64_t examples : {sample.size() / 16, sample.size() / 4}) {
    if (examples < 1 || (!w.smallerBatches.empty() &&
                         w.smallerBatches.back().examples >= static_cast<double>(examples))) {
      continue;
    }
    const Batch small{sample.input.narrow(0, 0, examples), sample.target.narrow(0, 0, examples)};
    const ModelProfile q = profileModel(setup.model, small, repeats);
    auto share = [](double atPart, double atFull) { return atFull > 0.0 ? atPart / atFull : 1.0; };
    Workload::BatchShare point;
    point.examples = static_cast<double>(examples);
    for (size_t i = 0; i < profile.blocks.size(); ++i) {
      point.forward.push_back(share(q.blocks[i].forwardSeconds, profile.blocks[i].forwardSeconds));
      point.backward.push_back(
          share(q.blocks[i].backwardSeconds, profile.blocks[i].backwardSeconds));
    }
    point.loss = share(q.lossSeconds, profile.lossSeconds);
    w.smallerBatches.push_back(std::move(point));
  }
  w.planner.measured = true;
  w.planner.lossSavedBytes = profile.lossSavedBytes;
  w.planner.tierWriteBytesPerSecond = m.bandwidth.writeBytesPerSecond;
  w.planner.tierReadBytesPerSecond = m.bandwidth.readBytesPerSecond;
  w.gradientBytes = blockGradientBytes(*setup.model);
  w.lossSeconds = profile.lossSeconds;
  // The run's memory plan: its predicted peak, and its timeline's cost in the step. Blocks that
  // recompute rerun their forward in backward; what the plan predicts beyond that (waits for the
  // tier) is spread over the backward times.
  // memory.policy = auto: the plan's own prediction (with the write backpressure its run gets);
  // a given policy: predicted with the whole room as its limit, as the run drains at.
  if (!options.memory.offloadWeights) refuseIfNoPlanFits(m);
  const int64_t limit = options.memory.budget > 0 ? options.memory.budget - m.persistent : 0;
  const Prediction plan =
      options.memory.automatic()
          ? m.plan->prediction
          : predict(profile, m.policies, m.bandwidth, static_cast<int>(options.memory.prefetch),
                    nullptr, std::max<int64_t>(limit, 0));
  w.activationPeakBytes = plan.peakBytes;
  for (size_t i = 0; i < m.policies.size(); ++i) {
    if (m.policies[i] == BlockPolicy::kRecompute || m.policies[i] == BlockPolicy::kSwapInput) {
      w.backwardSeconds[i] += w.forwardSeconds[i];
    }
  }
  const double backward = std::accumulate(w.backwardSeconds.begin(), w.backwardSeconds.end(), 0.0);
  if (plan.stepSeconds > w.computeSeconds() && backward > 0.0) {
    const double scale = 1.0 + (plan.stepSeconds - w.computeSeconds()) / backward;
    for (double& b : w.backwardSeconds) b *= scale;
  }

  // The optimizer's step over every parameter: the median of five after one warm-up.
  std::vector<torch::Tensor> params = setup.model->parameters();
  for (auto& p : params) p.mutable_grad() = torch::full_like(p, 1e-3);
  const auto optimizer = makeOptimizer(options.optim, params);
  std::vector<double> times;
  for (int i = 0; i < 6; ++i) {
    const auto start = std::chrono::steady_clock::now();
    optimizer->step();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  times.erase(times.begin());
  std::sort(times.begin(), times.end());
  w.updateSeconds = times[times.size() / 2];
  w.optimizerStateBytes = optimizerStateBytes(*optimizer);  // as stepped: its state exists
  if (w.offload.measured) {
    w.offload.extraSeconds =
        std::max(0.0, offloadStepSeconds - (w.computeSeconds() + w.updateSeconds));
  }
  return w;
}

void checkWorkloadIsTheConfigs(const Workload& w, const Config& config, const std::string& source) {
  RunSetup setup = RunSetup::forInspection(config);
  std::vector<int64_t> bytes;
  for (size_t i = 0; i < setup.model->numBlocks(); ++i) {
    bytes.push_back(tensorBytes(setup.model->block(i).ptr()->parameters()));
  }
  if (w.model == setup.model->modelName() && w.parameterBytes == bytes &&
      (w.gradientBytes.empty() || w.gradientBytes == blockGradientBytes(*setup.model))) {
    return;
  }
  const auto total = [](const std::vector<int64_t>& v) {
    return formatBytes(std::accumulate(v.begin(), v.end(), int64_t{0}));
  };
  throw ConfigError(fmt::format(
      "{} was profiled on another model ({}, {} blocks, {} of parameters) than the config's "
      "({}, {} blocks, {}); profile again (drop --workload) or pass that model's config",
      source, w.model, w.parameterBytes.size(), total(w.parameterBytes), setup.model->modelName(),
      bytes.size(), total(bytes)));
}

std::string workloadJson(const Workload& w) {
  nlohmann::json j = {{"format", "caravan-workload-2"},
                      {"model", w.model},
                      {"batch_per_worker", w.batchPerWorker},
                      {"threads", w.threads},
                      {"forward_s", w.forwardSeconds},
                      {"backward_s", w.backwardSeconds},
                      {"parameter_bytes", w.parameterBytes},
                      {"gather_bytes", w.gatherBytes},
                      {"gradient_bytes", w.gradientBytes},
                      {"input_bytes", w.inputBytes},
                      {"loss_s", w.lossSeconds},
                      {"update_s", w.updateSeconds},
                      {"optimizer_state_bytes", w.optimizerStateBytes},
                      {"activation_peak_bytes", w.activationPeakBytes},
                      {"epoch_examples", w.epochExamples}};
  if (w.offload.measured) {
    j["offload"] = {{"extra_s", w.offload.extraSeconds},
                    {"window_bytes", w.offload.windowBytes},
                    {"activation_peak_bytes", w.offload.activationPeakBytes}};
  }
  for (const Workload::BatchShare& p : w.smallerBatches) {
    j["smaller_batches"].push_back({{"examples", p.examples},
                                    {"forward_share", p.forward},
                                    {"backward_share", p.backward},
                                    {"loss_share", p.loss}});
  }
  if (w.planner.measured) {
    j["planner"] = {{"saved_bytes", w.planner.savedBytes},
                    {"keep_backward_s", w.planner.keepBackwardSeconds},
                    {"loss_saved_bytes", w.planner.lossSavedBytes},
                    {"tier_write_bps", w.planner.tierWriteBytesPerSecond},
                    {"tier_read_bps", w.planner.tierReadBytesPerSecond}};
  }
  return j.dump(1) + "\n";
}

Workload workloadFromJson(const std::string& text, const std::string& source) {
  Workload w;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    // caravan-workload-1 (before gradient_bytes) is read with Workload::gradientBytes empty:
    // the simulator takes each block's parameters as one tensor then (gradientBuckets).
    const std::string format = j.value("format", "");
    if (format != "caravan-workload-2" && format != "caravan-workload-1") {
      throw ConfigError(
          fmt::format("{} is not a workload caravan simulate wrote (no format "
                      "caravan-workload-2 or -1)",
                      source));
    }
    if (format == "caravan-workload-2") {
      w.gradientBytes = j.at("gradient_bytes").get<std::vector<std::vector<int64_t>>>();
    }
    w.model = j.at("model").get<std::string>();
    w.batchPerWorker = j.at("batch_per_worker").get<int64_t>();
    w.threads = j.at("threads").get<int>();
    w.forwardSeconds = j.at("forward_s").get<std::vector<double>>();
    w.backwardSeconds = j.at("backward_s").get<std::vector<double>>();
    w.parameterBytes = j.at("parameter_bytes").get<std::vector<int64_t>>();
    // Absent from a workload written before bf16 gathers: the parameters' bytes then.
    if (j.contains("gather_bytes")) {
      w.gatherBytes = j.at("gather_bytes").get<std::vector<int64_t>>();
    }
    w.inputBytes = j.at("input_bytes").get<std::vector<int64_t>>();
    w.lossSeconds = j.at("loss_s").get<double>();
    w.updateSeconds = j.at("update_s").get<double>();
    w.optimizerStateBytes = j.at("optimizer_state_bytes").get<int64_t>();
    w.activationPeakBytes = j.at("activation_peak_bytes").get<int64_t>();
    w.epochExamples = j.at("epoch_examples").get<int64_t>();
    if (j.contains("offload")) {  // optional: workloads written before it have none
      const nlohmann::json& o = j.at("offload");
      w.offload.measured = true;
      w.offload.extraSeconds = o.at("extra_s").get<double>();
      w.offload.windowBytes = o.at("window_bytes").get<int64_t>();
      w.offload.activationPeakBytes = o.at("activation_peak_bytes").get<int64_t>();
    }
    if (j.contains("smaller_batches")) {  // optional: workloads before it shrink in proportion
      for (const nlohmann::json& p : j.at("smaller_batches")) {
        w.smallerBatches.push_back(
            {p.at("examples").get<double>(), p.at("forward_share").get<std::vector<double>>(),
             p.at("backward_share").get<std::vector<double>>(), p.at("loss_share").get<double>()});
      }
    } else if (j.contains("fixed")) {  // the earlier form: the times at 0 examples
      const nlohmann::json& f = j.at("fixed");
      auto share = [](double fixed, double full) {
        return full > 0.0 ? std::min(1.0, fixed / full) : 0.0;
      };
      Workload::BatchShare zero;
      const auto forward = f.at("forward_s").get<std::vector<double>>();
      const auto backward = f.at("backward_s").get<std::vector<double>>();
      if (forward.size() != w.forwardSeconds.size() ||
          backward.size() != w.backwardSeconds.size()) {
        throw ConfigError(fmt::format(
            "{}: the workload's fixed times are not one per block; write it again with caravan "
            "simulate -o DIR",
            source));
      }
      for (size_t b = 0; b < forward.size(); ++b) {
        zero.forward.push_back(share(forward[b], w.forwardSeconds[b]));
        zero.backward.push_back(share(backward[b], w.backwardSeconds[b]));
      }
      zero.loss = share(f.at("loss_s").get<double>(), w.lossSeconds);
      w.smallerBatches.push_back(std::move(zero));
    }
    if (j.contains("planner")) {  // optional: workloads written before the layout search
      const nlohmann::json& p = j.at("planner");
      w.planner.measured = true;
      w.planner.savedBytes = p.at("saved_bytes").get<std::vector<int64_t>>();
      w.planner.keepBackwardSeconds = p.at("keep_backward_s").get<std::vector<double>>();
      w.planner.lossSavedBytes = p.at("loss_saved_bytes").get<int64_t>();
      w.planner.tierWriteBytesPerSecond = p.at("tier_write_bps").get<double>();
      w.planner.tierReadBytesPerSecond = p.at("tier_read_bps").get<double>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError(
        fmt::format("{}: not a readable workload ({}); write one with caravan "
                    "simulate -o DIR",
                    source, e.what()));
  }
  const size_t n = w.forwardSeconds.size();
  bool finite = std::isfinite(w.lossSeconds) && w.lossSeconds >= 0.0 &&
                std::isfinite(w.updateSeconds) && w.updateSeconds >= 0.0 &&
                w.optimizerStateBytes >= 0 && w.activationPeakBytes >= 0 && w.epochExamples >= 0 &&
                std::isfinite(w.offload.extraSeconds) && w.offload.extraSeconds >= 0.0 &&
                w.offload.windowBytes >= 0 && w.offload.activationPeakBytes >= 0;
  finite =
      finite && w.planner.lossSavedBytes >= 0 && std::isfinite(w.planner.tierWriteBytesPerSecond) &&
      w.planner.tierWriteBytesPerSecond >= 0.0 && std::isfinite(w.planner.tierReadBytesPerSecond) &&
      w.planner.tierReadBytesPerSecond >= 0.0;
  for (int64_t v : w.planner.savedBytes) finite = finite && v >= 0;
  for (const auto* times :
       {&w.forwardSeconds, &w.backwardSeconds, &w.planner.keepBackwardSeconds}) {
    for (double v : *times) finite = finite && std::isfinite(v) && v >= 0.0;
  }
  // Smaller batches: ascending, each below the workload's batch, its shares finite.
  bool sharesFit = true;
  for (size_t i = 0; i < w.smallerBatches.size(); ++i) {
    const Workload::BatchShare& p = w.smallerBatches[i];
    sharesFit = sharesFit && p.forward.size() == n && p.backward.size() == n && p.examples >= 0.0 &&
                p.examples < static_cast<double>(w.batchPerWorker) &&
                (i == 0 || p.examples > w.smallerBatches[i - 1].examples);
    for (const std::vector<double>* shares : {&p.forward, &p.backward}) {
      for (double v : *shares) finite = finite && std::isfinite(v) && v >= 0.0;
    }
    finite = finite && std::isfinite(p.loss) && p.loss >= 0.0;
  }
  for (const auto* sizes : {&w.parameterBytes, &w.inputBytes}) {
    for (int64_t v : *sizes) finite = finite && v >= 0;
  }
  for (size_t b = 0; b < w.gatherBytes.size() && b < n; ++b) {
    finite = finite && w.gatherBytes[b] >= 0 && w.gatherBytes[b] <= w.parameterBytes[b];
  }
  // A block's gradients are some of its parameters (those that take one).
  for (size_t b = 0; b < w.gradientBytes.size() && b < n; ++b) {
    int64_t sum = 0;
    for (int64_t v : w.gradientBytes[b]) {
      finite = finite && v >= 0;
      sum += v;
    }
    finite = finite && sum <= w.parameterBytes[b];
  }
  if (n == 0 || w.backwardSeconds.size() != n || w.parameterBytes.size() != n ||
      (!w.gatherBytes.empty() && w.gatherBytes.size() != n) ||
      (!w.gradientBytes.empty() && w.gradientBytes.size() != n) || w.inputBytes.size() != n ||
      !sharesFit ||
      (w.planner.measured &&
       (w.planner.savedBytes.size() != n || w.planner.keepBackwardSeconds.size() != n)) ||
      w.threads < 1 || w.batchPerWorker < 1 || !finite) {
    throw ConfigError(
        fmt::format("{}: the workload's per-block lists disagree or are empty; "
                    "write it again with caravan simulate -o DIR",
                    source));
  }
  return w;
}

std::vector<std::vector<int64_t>> blockGradientBytes(BlockModelImpl& model) {
  std::vector<std::vector<int64_t>> out;
  for (size_t i = 0; i < model.numBlocks(); ++i) {
    std::vector<int64_t>& bytes = out.emplace_back();
    for (const auto& p : model.block(i).ptr()->parameters()) {
      if (p.requires_grad()) bytes.push_back(p.numel() * static_cast<int64_t>(p.element_size()));
    }
  }
  return out;
}

}  // namespace caravan::sim
