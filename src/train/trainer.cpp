// The training loop (see trainer.h).
#include "train/trainer.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/clock.h"
#include "core/errors.h"
#include "data/loader.h"
#include "memory/accounting.h"
#include "memory/executor.h"
#include "memory/host_allocator.h"
#include "memory/saved_tensors.h"
#include "memory/tracker.h"
#include "memory/weights.h"
#include "models/model.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/timeline.h"
#include "train/memory_setup.h"
#include "train/metrics.h"
#include "train/setup.h"
#include "train/step.h"

namespace caravan {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

// The sampler position after the batch drawn at `p`.
SamplerPosition nextPosition(SamplerPosition p, int64_t batchesPerEpoch) {
  if (++p.batchInEpoch == batchesPerEpoch) {
    ++p.epoch;
    p.batchInEpoch = 0;
  }
  return p;
}

TrainSummary runTraining(const Config& config, const TrainerOptions& options,
                         CheckpointDir& checkpoints, const std::optional<std::string>& resumeFrom,
                         const std::string& metricsPath, Distributed* dist) {
  Communicator* comm = dist ? dist->comm.get() : nullptr;
  const bool isRoot = options.world.rank == 0;
  DatasetSplits data = makeDatasets(config);
  const DataShape shape = data.train->shape();

  torch::manual_seed(static_cast<uint64_t>(config.i64("seed.init")));
  BlockModel model = buildModel(makeModelSpec(config), shape);
  auto optimizer = makeOptimizer(config, model);

  // Data is sharded over the workers (parameter servers read none).
  const int workers = comm != nullptr ? comm->size() : 1;
  const SamplerOptions samplerOptions =
      makeSamplerOptions(config, data.train->size(), comm != nullptr ? comm->rank() : 0, workers);
  Loader loader(data.train, samplerOptions, config.i64("data.prefetch"));
  const int64_t perEpoch = loader.batchesPerEpoch();
  const int64_t totalSteps = config.i64("train.max_steps") > 0
                                 ? config.i64("train.max_steps")
                                 : config.i64("train.epochs") * perEpoch;
  const ScheduleOptions schedule = makeScheduleOptions(config, totalSteps);
  const nlohmann::json identity = runIdentity(config);

  TrainingState state;
  state.meta = identity;
  double elapsedBefore = 0.0;  // training seconds of earlier processes of this run
  std::string reshardNote;
  if (resumeFrom) {
    state = loadCheckpoint(*resumeFrom, *model, *optimizer, identity);
    setDefaultRngState(state.rngState);
    if (state.batchSize == 0) state.batchSize = samplerOptions.batchSize;  // older checkpoints
    if (state.workers == 0) state.workers = workers;
    if (state.workers != workers || state.batchSize != samplerOptions.batchSize) {
      // Resharding: the position counts samples of the epoch (loader.h).
      const SamplerPosition saved = state.position;
      state.position = reshardPosition(saved, state.workers * state.batchSize,
                                       workers * samplerOptions.batchSize, perEpoch);
      reshardNote = fmt::format(
          "caravan: the checkpoint was written by {} workers x batch {} (epoch {} batch {}); "
          "continuing with {} x {} at epoch {} batch {}",
          state.workers, state.batchSize, saved.epoch + 1, saved.batchInEpoch, workers,
          samplerOptions.batchSize, state.position.epoch + 1, state.position.batchInEpoch);
    }
    loader.seek(state.position);
    elapsedBefore = state.elapsedSeconds;
  } else {
    torch::manual_seed(static_cast<uint64_t>(config.i64("seed.dropout")));
  }
  // Per-block policies (memory.policy; planned under the budget for auto) and their executor:
  // before anything is written, so a run that cannot fit leaves nothing behind, and before the
  // strategy attaches, so the profile's backward passes start no gradient exchange.
  Batch sample;
  if (config.str("memory.policy") == "auto") {
    std::vector<int64_t> first;
    for (int64_t i = 0; i < std::min(samplerOptions.batchSize, data.train->size()); ++i) {
      first.push_back(i);
    }
    sample = data.train->get(first);
  }
  ActivationMemory activations = makeActivationMemory(config, model, sample, /*plan=*/false);
  // Out-of-core weights exchange and update gradients per block: the strategy's groups.
  const bool offload = offloadsWeights(config);
  Strategy* strategy = nullptr;
  if (dist) {
    strategy = dist->attach(*model, *optimizer, resumeFrom ? &state : nullptr,
                            offload ? blockParameters(model)
                                    : std::vector<std::vector<at::Tensor>>{});
    state.strategy.clear();  // handed to the strategy
  }
  Timeline timeline(options.tracePath, options.world.rank);
  if (dist) dist->observeCommunication(timeline.enabled() ? &timeline : nullptr);
  struct ForgetTimeline {  // the strategy (and its event sink) outlives this function
    Distributed* dist;
    ~ForgetTimeline() {
      if (dist) dist->forgetTimeline();
    }
  } forgetTimeline{dist};

  std::unique_ptr<MetricsSink> metrics;
  if (isRoot) {
    writeFileAtomic((fs::path(options.runDir) / "config.toml").string(), config.toToml());
    metrics = std::make_unique<MetricsSink>(metricsPath, resumeFrom ? state.step : -1);
  }

  const int64_t params = [&] {
    int64_t n = 0;
    for (const auto& p : model->parameters()) n += p.numel();
    return n;
  }();
  Progress progress(options.terminal, options.tty, options.quiet || !isRoot, totalSteps,
                    config.i64("train.log_every"));
  progress.line(fmt::format(
      "caravan: {} ({} blocks, {:.2f}M parameters) on {} ({} train / {} eval examples), "
      "{} steps of batch {}{}{}",
      model->modelName(), model->numBlocks(), static_cast<double>(params) / 1e6,
      data.train->name(), data.train->size(), data.test->size(), totalSteps,
      samplerOptions.batchSize,
      dist ? fmt::format(" per worker x {} workers ({}, {})", workers, comm->backend(),
                         config.str("sync.mode"))
           : "",
      resumeFrom ? fmt::format(", resuming at step {} from {}", state.step, *resumeFrom) : ""));
  if (!reshardNote.empty()) progress.line(reshardNote);

  // Memory accounting (memory/): activations through the saved-tensor hooks while the scope
  // lives, the other categories measured after each step.
  const std::vector<at::Tensor> parameterList = model->parameters();
  const int64_t budget = parseBytes(config.str("memory.budget"), "memory.budget");
  MemoryTracker memory;
  // Out-of-core weights (memory.weights = offload): after the strategy attached (it broadcast
  // rank 0's parameters), the blocks move to the tier; the store counts what is in memory.
  std::unique_ptr<OutOfCoreWeights> weights;
  if (offload) {
    weights = std::make_unique<OutOfCoreWeights>(
        model, *optimizer,
        [&config](std::vector<at::Tensor> ps) { return makeOptimizer(config, std::move(ps)); },
        *activations.tier, &memory, strategy, weightOptions(config));
    activations.executor->setWeights(weights.get());
  } else {
    memory.set(MemoryCategory::kWeights, tensorBytes(parameterList));
    memory.set(MemoryCategory::kGradients, gradientBytes(parameterList));
    memory.set(MemoryCategory::kOptimizerState, optimizerStateBytes(*optimizer));
  }
  memory.resetPeaks();
  // Weights and buffers (batch norm's running statistics) saved by ops are not activations
  // (out-of-core weights move between storages: the executor asks the store).
  std::vector<at::Tensor> modelState = offload ? std::vector<at::Tensor>{} : parameterList;
  for (const auto& b : model->buffers()) modelState.push_back(b);
  SavedTensorScope savedTensors(memory, modelState);
  {
    std::istringstream report(activations.report);
    for (std::string line; std::getline(report, line);) progress.line(line);
  }
  if (isRoot && activations.plan) {
    writeFileAtomic((fs::path(options.runDir) / "memory_plan.txt").string(), activations.report);
  }
  releaseFreeHeap();
  std::vector<double> forwardBackward;  // per step, for measured vs predicted
  int64_t runActivationPeak = 0, runTrackedPeak = 0;

  const Clock::time_point start = Clock::now();
  auto trainSeconds = [&] { return elapsedBefore + secondsSince(start); };
  const double maxSeconds = config.f64("train.max_minutes") * 60.0;
  const int64_t logEvery = config.i64("train.log_every");
  const int64_t evalEvery = config.i64("train.eval_every");
  const int64_t checkpointEvery = config.i64("checkpoint.every");
  const int64_t evalBatchSize = config.i64("data.eval_batch_size");
  const int64_t evalBatches = config.i64("train.eval_batches");
  const double gradClip = config.f64("optim.grad_clip");
  // train.nonfinite_skips: steps with a non-finite loss or gradient skipped before stopping.
  const int64_t nonfiniteSkips = config.i64("train.nonfinite_skips");
  if (nonfiniteSkips > 0 && (offload || (strategy != nullptr && strategy->updatesParameters()))) {
    throw ConfigError(fmt::format(
        "train.nonfinite_skips needs the update after backward; {} updates before it can be "
        "checked: set train.nonfinite_skips = 0",
        offload ? "memory.weights = offload" : "sync.mode = " + config.str("sync.mode")));
  }
  int64_t skippedSteps = 0;

  TrainSummary summary;
  int64_t lastEvalStep = -1;
  int64_t epoch = state.position.epoch + 1;  // 1-based epoch of the latest step
  // Strategies that let replicas drift (local SGD, gossip) average them first, so evaluation
  // and checkpoints see one model; the spread they had is reported.
  auto consolidate = [&] { return strategy != nullptr ? strategy->consolidate() : 0.0; };
  // `distance`: the consensus distance when the caller consolidated already.
  auto runEval = [&](std::optional<double> distance = std::nullopt) {
    const double consensus = distance ? *distance : consolidate();
    EvalResult r = evaluate(model, *data.test, evalBatchSize, evalBatches, comm);
    nlohmann::json rec = {{"kind", "eval"}, {"step", state.step}, {"epoch", epoch},
                          {"loss", r.loss}, {"accuracy", r.accuracy},
                          {"examples", r.examples}, {"time_s", trainSeconds()}};
    if (strategy != nullptr) rec["consensus_distance"] = consensus;
    if (metrics) metrics->write(rec);
    progress.line(fmt::format("eval  step {} epoch {}: loss {:.4f} accuracy {:.2f}%", state.step,
                              epoch, r.loss, 100.0 * r.accuracy));
    summary.evalLoss = r.loss;
    summary.evalAccuracy = r.accuracy;
    lastEvalStep = state.step;
  };
  // `collected`: the strategy's state when the caller consolidated and collected it already.
  auto writeCheckpoint = [&](std::map<std::string, at::Tensor>* collected = nullptr) {
    if (collected != nullptr) {
      state.strategy = std::move(*collected);
    } else {
      consolidate();
      if (strategy != nullptr) state.strategy = strategy->saveState();
    }
    state.workers = workers;
    state.batchSize = samplerOptions.batchSize;
    state.rngState = defaultRngState();
    state.elapsedSeconds = trainSeconds();
    if (isRoot) {
      auto save = [&] { summary.lastCheckpoint = checkpoints.save(*model, *optimizer, state); };
      if (weights) {
        weights->withAllResident(save);  // the in-core format (weights.h)
      } else {
        save();
      }
    } else {
      summary.lastCheckpoint = checkpoints.pathFor(state.step);
    }
    state.strategy.clear();
    // The servers' optimizer state came into this optimizer for the file only.
    if (strategy != nullptr && strategy->updatesParameters()) optimizer->state().clear();
  };

  model->train();
  double windowSamples = 0.0;
  // Per-step means over the log window (rank 0): forward + backward + optimizer, and the time
  // blocked on synchronization (gradient exchange after backward, the strategy's afterStep).
  double windowCompute = 0.0, windowSync = 0.0;
  int64_t windowSteps = 0;
  ByteCount windowBytes = dist ? dist->bytes() : ByteCount{};
  std::vector<RankWindow> rankWindows;  // every worker's, from the agreement of a log step
  Clock::time_point windowStart = Clock::now();
  double lastLoss = std::nan("");
  while (state.step < totalSteps) {
    LoadedBatch lb = loader.next();
    epoch = lb.position.epoch + 1;
    const double lr = learningRate(schedule, state.step);
    setLearningRate(*optimizer, lr);
    if (strategy != nullptr) strategy->setLearningRate(lr);
    const auto stepStart = Clock::now();
    StepResult r =
        trainStep(model, *optimizer, lb.batch, gradClip, strategy, state.step, weights.get(),
                  /*skipNonFinite=*/nonfiniteSkips > 0);
    if (!weights) {
      memory.set(MemoryCategory::kGradients, gradientBytes(parameterList));
      memory.set(MemoryCategory::kOptimizerState, optimizerStateBytes(*optimizer));
    }
    // What every later step needs: this step's activation peak on top of everything that
    // persists (weights, gradients and optimizer state exist from the first step on).
    const int64_t needed = std::max(
        memory.totalPeak(), memory.peak(MemoryCategory::kActivations) +
                                memory.live(MemoryCategory::kWeights) +
                                memory.live(MemoryCategory::kGradients) +
                                memory.live(MemoryCategory::kOptimizerState));
    if (budget > 0 && needed > budget) {
      // The policies are fixed for the run, so this is what every step needs.
      throw ConfigError(fmt::format(
          "memory.budget = {} is below what step {} needs: {} tracked (activations {}, weights "
          "{}, gradients {}, optimizer state {}); the smallest budget that works for this "
          "model, batch and memory.policy = {} is {} ({} bytes){}{}",
          formatBytes(budget), state.step + 1, formatBytes(needed),
          formatBytes(memory.peak(MemoryCategory::kActivations)),
          formatBytes(memory.live(MemoryCategory::kWeights)),
          formatBytes(memory.live(MemoryCategory::kGradients)),
          formatBytes(memory.live(MemoryCategory::kOptimizerState)),
          config.str("memory.policy"), formatBytes(needed), needed,
          config.str("memory.policy") == "auto"
              ? "; the plan's prediction was short: see memory_plan.txt"
              : "; or set memory.policy = auto to recompute or swap blocks within the budget",
          offload ? "" : " (memory.weights = offload keeps weights and optimizer state on the tier)"));
    }
    runActivationPeak = std::max(runActivationPeak, memory.peak(MemoryCategory::kActivations));
    runTrackedPeak = std::max(runTrackedPeak, needed);
    if (state.step > 0 || resumeFrom) {  // the first step allocates; it is not typical
      forwardBackward.push_back(std::chrono::duration<double>(r.backwardEnd - stepStart).count());
    }
    timeline.complete("forward", stepStart, r.forwardEnd);
    timeline.complete("backward", r.forwardEnd, r.backwardEnd);
    if (strategy != nullptr) timeline.complete("gradient sync wait", r.backwardEnd, r.syncEnd);
    timeline.complete("optimizer", r.syncEnd, r.optimizerEnd);
    if (strategy != nullptr) timeline.complete("after-step sync", r.optimizerEnd, r.stepEnd);
    auto seconds = [](Clock::time_point a, Clock::time_point b) {
      return std::chrono::duration<double>(b - a).count();
    };
    windowCompute += seconds(stepStart, r.syncEnd) - seconds(r.backwardEnd, r.syncEnd) +
                     seconds(r.syncEnd, r.optimizerEnd);
    windowSync += seconds(r.backwardEnd, r.syncEnd) + seconds(r.optimizerEnd, r.stepEnd);
    ++windowSteps;
    bool interrupted = (options.stopAtStep > 0 && state.step + 1 >= options.stopAtStep) ||
                       (options.stopRequested != nullptr && options.stopRequested->load());
    bool timeUp = maxSeconds > 0 && trainSeconds() >= maxSeconds;
    if (dist) {
      // One small all-reduce: the mean loss over ranks, and whether any rank must stop. Under
      // an asynchronous strategy only every log_every steps and at the end, so it does not
      // hold fast workers back; a stop waits for the next agreement.
      const bool agreeNow = strategy->lockstep() || (state.step + 1) % logEvery == 0 ||
                            state.step + 1 == totalSteps;
      if (agreeNow) {
        // On the steps that write a train record, every worker's window comes along.
        const bool logNow = (state.step + 1) % logEvery == 0 || state.step + 1 == totalSteps;
        const RankWindow own{windowCompute / windowSteps, windowSync / windowSteps};
        Agreement a = dist->agree(r.loss, interrupted, timeUp, logNow ? &own : nullptr,
                                  &rankWindows);
        r.loss = a.meanLoss;
        interrupted = a.interrupted;
        timeUp = a.timeUp;
      } else {
        interrupted = timeUp = false;
      }
    }
    // Non-finite here, or (local SGD, gossip: gradients are per rank) on another rank: every
    // rank sees the mean loss, so they count alike.
    const bool nonFinite = r.skipped || !std::isfinite(r.loss);
    if (nonFinite && skippedSteps < nonfiniteSkips) {
      ++skippedSteps;
      progress.line(fmt::format("step {}: loss {}, a non-finite loss or gradient; update "
                                "skipped ({} of train.nonfinite_skips = {})",
                                state.step + 1, r.loss, skippedSteps, nonfiniteSkips));
    } else if (nonFinite) {
      throw NonFiniteError(fmt::format(
          "loss became {} at step {} (epoch {}){}; the last good checkpoint is {}; lower optim.lr "
          "or set optim.grad_clip",
          r.loss, state.step + 1, epoch,
          nonfiniteSkips > 0
              ? fmt::format(" after {} skipped steps (train.nonfinite_skips)", skippedSteps)
              : "",
          checkpoints.latest().value_or("(none: set checkpoint.every)")));
    }
    ++state.step;
    if (dist) dist->stepDone(state.step);
    state.position = nextPosition(lb.position, perEpoch);
    lastLoss = r.loss;
    windowSamples += static_cast<double>(lb.batch.size() * workers);
    const double windowS = secondsSince(windowStart);
    const double samplesPerS = windowS > 0 ? windowSamples / windowS : 0.0;
    progress.update(state.step, epoch, r.loss, lr, samplesPerS);
    if (state.step % logEvery == 0 || state.step == totalSteps) {
      nlohmann::json rec = {{"kind", "train"}, {"step", state.step}, {"epoch", epoch},
                            {"loss", r.loss}, {"lr", lr}, {"samples_per_s", samplesPerS},
                            {"compute_s", windowCompute / windowSteps},
                            {"sync_wait_s", windowSync / windowSteps},
                            {"time_s", trainSeconds()}, {"workers", workers}};
      // Tracked memory over the window (peaks) and the process's resident set now.
      rec["mem_activations_peak"] = memory.peak(MemoryCategory::kActivations);
      rec["mem_weights"] = memory.live(MemoryCategory::kWeights);
      rec["mem_gradients"] = memory.live(MemoryCategory::kGradients);
      rec["mem_optimizer_state"] = memory.live(MemoryCategory::kOptimizerState);
      rec["mem_tracked_peak"] = memory.totalPeak();
      if (nonfiniteSkips > 0) rec["skipped_steps"] = skippedSteps;  // so far in this process
      rec["rss_bytes"] = residentBytes();
      const HeapBytes heap = heapBytes();
      rec["heap_in_use_bytes"] = heap.inUse;
      rec["heap_free_bytes"] = heap.free;
      if (HostAllocator::installed()) {
        const HostAllocator::Stats h = HostAllocator::instance().stats();
        rec["host_mapped_bytes"] = h.mapped;
        rec["host_cached_bytes"] = h.cached;
      }
      memory.resetPeaks();
      if (activations.executor) {
        const ExecutorStats x = activations.executor->takeStats();
        rec["offloaded_bytes"] = static_cast<double>(x.bytesOffloaded) / windowSteps;
        rec["recompute_s"] = x.recomputeSeconds / windowSteps;
        rec["swap_stall_s"] = x.stallSeconds / windowSteps;
      }
      if (weights) {
        const WeightStats w = weights->takeStats();
        rec["weights_read_bytes"] = static_cast<double>(w.bytesRead) / windowSteps;
        rec["weights_written_bytes"] = static_cast<double>(w.bytesWritten) / windowSteps;
        rec["weights_update_s"] = w.updateSeconds / windowSteps;
        rec["weights_stall_s"] = w.stallSeconds / windowSteps;
      }
      if (dist) {
        // This rank's bytes per step over the window, and the strategy's own numbers.
        const ByteCount b = dist->bytes();
        rec["sent_bytes"] = static_cast<double>(b.sent - windowBytes.sent) / windowSteps;
        rec["recv_bytes"] = static_cast<double>(b.received - windowBytes.received) / windowSteps;
        windowBytes = b;
        for (const auto& [key, value] : strategy->takeMetrics()) rec[key] = value;
        // Time with an exchange outstanding per step (hidden behind compute or not).
        if (const auto outstanding = dist->takeOutstandingSeconds()) {
          rec["comm_outstanding_s"] = *outstanding / windowSteps;
        }
        if (rankWindows.size() == static_cast<size_t>(workers)) {
          std::vector<double> compute, wait;
          for (const RankWindow& w : rankWindows) {
            compute.push_back(w.computeS);
            wait.push_back(w.syncWaitS);
          }
          rec["rank_compute_s"] = compute;
          rec["rank_sync_wait_s"] = wait;
        }
        rankWindows.clear();
      }
      if (metrics) metrics->write(rec);
      windowSamples = 0.0;
      windowCompute = windowSync = 0.0;
      windowSteps = 0;
      windowStart = Clock::now();
    }
    const bool epochEnd = state.position.batchInEpoch == 0;
    // Evaluations and checkpoints are not training: the throughput window leaves them out
    // (samples_per_s dipped at every evaluation).
    const Clock::time_point pauseStart = Clock::now();
    if ((evalEvery > 0 && state.step % evalEvery == 0) || (evalEvery == 0 && epochEnd)) {
      runEval();
    }
    if ((interrupted || timeUp) && state.step < totalSteps) {
      // Time up is a normal end (evaluate, export); an interruption only checkpoints.
      summary.stoppedEarly = !timeUp;
      if (timeUp) progress.line(fmt::format("train.max_minutes reached at step {}", state.step));
      break;
    }
    if (checkpointEvery > 0 && state.step % checkpointEvery == 0 && state.step < totalSteps) {
      writeCheckpoint();
    }
    windowStart += Clock::now() - pauseStart;
  }
  progress.finish();
  // One model from here on, and the final checkpoint's strategy state collected while the
  // servers still serve: finish() says goodbye to them.
  const double finalDistance = consolidate();
  std::map<std::string, at::Tensor> finalStrategyState;
  if (strategy != nullptr) {
    finalStrategyState = strategy->saveState();
    strategy->finish();
  }
  double measuredFwdBwd = 0.0;
  if (!forwardBackward.empty()) {
    std::vector<double> sorted = forwardBackward;
    std::sort(sorted.begin(), sorted.end());
    measuredFwdBwd = sorted[sorted.size() / 2];
  }
  if (activations.plan && measuredFwdBwd > 0) {
    const Prediction& p = activations.plan->prediction;
    progress.line(fmt::format(
        "memory plan: forward+backward measured {:.1f} ms (median) vs predicted {:.1f} ms "
        "({:+.1f}%); activation peak measured {} vs predicted {}",
        measuredFwdBwd * 1e3, p.stepSeconds * 1e3,
        (measuredFwdBwd / p.stepSeconds - 1.0) * 100.0, formatBytes(runActivationPeak),
        formatBytes(p.peakBytes)));
  }
  if (!summary.stoppedEarly && lastEvalStep != state.step) runEval(finalDistance);
  writeCheckpoint(&finalStrategyState);
  summary.steps = state.step;
  summary.epochs = epoch;
  summary.finalTrainLoss = lastLoss;
  summary.trainSeconds = trainSeconds();
  summary.samplesPerSecond =
      summary.trainSeconds > 0
          ? static_cast<double>(state.step * samplerOptions.batchSize * workers) /
                summary.trainSeconds
          : 0.0;
  timeline.flush();
  if (!isRoot) return summary;
  if (!summary.stoppedEarly) {
    auto save = [&] { exportStateDict((fs::path(options.runDir) / "model.pt").string(), *model); };
    if (weights) {
      weights->withAllResident(save);
    } else {
      save();
    }
  }
  nlohmann::json sj = {{"steps", summary.steps},
                       {"epochs", summary.epochs},
                       {"final_train_loss", summary.finalTrainLoss},
                       {"eval_loss", summary.evalLoss},
                       {"eval_accuracy", summary.evalAccuracy},
                       {"train_seconds", summary.trainSeconds},
                       {"samples_per_s", summary.samplesPerSecond},
                       {"stopped_early", summary.stoppedEarly},
                       {"memory_policy", formatPolicies(activations.policies)},
                       {"memory_weights", config.str("memory.weights")},
                       {"skipped_steps", skippedSteps},
                       {"fwd_bwd_s", measuredFwdBwd},
                       {"activation_peak_bytes", runActivationPeak},
                       {"tracked_peak_bytes", runTrackedPeak},
                       {"checkpoint", summary.lastCheckpoint}};
  if (activations.plan) {
    sj["predicted_fwd_bwd_s"] = activations.plan->prediction.stepSeconds;
    sj["predicted_activation_peak_bytes"] = activations.plan->prediction.peakBytes;
  }
  writeFileAtomic((fs::path(options.runDir) / "summary.json").string(), sj.dump(2) + "\n");
  return summary;
}

}  // namespace

std::optional<std::string> checkRunDirectory(const std::string& runDir, bool resume) {
  const CheckpointDir checkpoints(runDir, 1);
  if (resume) {
    std::optional<std::string> latest = checkpoints.latest();
    if (!latest) {
      throw CheckpointError(fmt::format("nothing to resume in {}: it has no checkpoints/ "
                                        "(start a new run with another --run-dir)",
                                        runDir));
    }
    return latest;
  }
  if (checkpoints.latest() || fs::exists(fs::path(runDir) / "metrics.jsonl")) {
    throw ConfigError(fmt::format("{} already holds a run; continue it with --resume {} or "
                                  "choose another --run-dir",
                                  runDir, runDir));
  }
  return std::nullopt;
}

TrainSummary train(const Config& config, const TrainerOptions& options) {
  std::error_code ec;
  fs::create_directories(options.runDir, ec);
  if (ec) {
    throw IoError(fmt::format("cannot create run directory {}: {}", options.runDir, ec.message()));
  }
  CheckpointDir checkpoints(options.runDir, config.i64("checkpoint.keep"));
  const std::string metricsPath = (fs::path(options.runDir) / "metrics.jsonl").string();
  const std::optional<std::string> resumeFrom = checkRunDirectory(options.runDir, options.resume);
  if (options.world.rank == 0) checkpoints.removeStaleTemporaries();  // its only writer

  applyRuntimeConfig(config);
  installSavedTensorEngine();
  // Rendezvous after the checks above and before rank 0 writes anything, so every rank has
  // seen the run directory as it was.
  if (options.world.worldSize == 1) {
    return runTraining(config, options, checkpoints, resumeFrom, metricsPath, nullptr);
  }
  Distributed dist(config, options);
  try {
    if (dist.isServer()) {
      dist.serve();
      return TrainSummary{};
    }
    return runTraining(config, options, checkpoints, resumeFrom, metricsPath, &dist);
  } catch (const PeerError& e) {
    // Name the lost rank (from the heartbeats) rather than the socket that noticed.
    const std::string line = dist.explain(e.what());
    dist.leave(line);
    throw PeerError(line);
  } catch (const std::exception& e) {
    dist.leave(e.what());
    throw;
  }
}

}  // namespace caravan
