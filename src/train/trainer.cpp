// The training loop (see trainer.h).
#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/clock.h"
#include "core/errors.h"
#include "core/openmp_env.h"
#include "data/loader.h"
#include "memory/accounting.h"
#include "memory/executor.h"
#include "memory/saved_tensors.h"
#include "memory/tracker.h"
#include "memory/weights.h"
#include "models/model.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/layout_setup.h"
#include "train/metrics.h"
#include "train/metrics_window.h"
#include "train/run_setup.h"
#include "train/setup.h"
#include "train/step.h"
#include "train/step_engine.h"
#include "train/timeline.h"

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

// Why the loop ends before its last step.
enum class StopReason {
  kNone,
  kInterrupted,  // a signal or --stop-at-step: checkpoint and stop, resume to continue
  kTimeUp,       // train.max_minutes: a normal end (evaluate, checkpoint, export)
};

// Whether this rank must stop after a step and, in a job, what every rank agreed: the mean
// loss and the most pressing reason of any rank. Asynchronous strategies agree only every
// train.log_every steps and at the last one, so they do not hold fast workers back; a stop
// then waits for the next agreement.
class StopState {
 public:
  StopState(const TrainerOptions& options, const LoopOptions& loop, int64_t totalSteps)
      : options_(options), loop_(loop), totalSteps_(totalSteps) {}

  // After step `step` (0-based) with `loss`; `trainSeconds` of training so far. Returns the
  // loss to report (the workers' mean in a job). On steps that write a record, this rank's
  // `window` goes along and every worker's comes back into window.ranks().
  double afterStep(int64_t step, double loss, double trainSeconds, Distributed* dist,
                   const StepEngine& engine, MetricsWindow& window) {
    scheduleSeconds_ = trainSeconds;
    bool interrupted = (options_.stopAtStep > 0 && step + 1 >= options_.stopAtStep) ||
                       (options_.stopRequested != nullptr && options_.stopRequested->load());
    bool timeUp = loop_.maxSeconds > 0 && trainSeconds >= loop_.maxSeconds;
    if (dist != nullptr) {
      const bool logNow = writesRecord(step + 1);
      if (engine.lockstep() || logNow) {
        // On the steps that write a train record, every worker's window comes along.
        const RankWindow own = window.own();
        const Agreement a = dist->agree(loss, interrupted, timeUp, trainSeconds,
                                        logNow ? &own : nullptr, window.ranks());
        loss = a.meanLoss;
        scheduleSeconds_ = a.meanTrainSeconds;
        interrupted = a.interrupted;
        timeUp = a.timeUp;
      } else {
        interrupted = timeUp = false;
      }
    }
    reason_ = timeUp        ? StopReason::kTimeUp
              : interrupted ? StopReason::kInterrupted
                            : StopReason::kNone;
    return loss;
  }
  // Whether the step that makes `stepsDone` steps writes a train record.
  bool writesRecord(int64_t stepsDone) const {
    return stepsDone % loop_.logEvery == 0 || stepsDone == totalSteps_;
  }
  StopReason reason() const { return reason_; }
  // The training seconds the next step's learning rate counts (schedule.horizon = time): the
  // workers' mean where they agreed after the last step (every step in lockstep modes, so
  // replicas take the same rate), else this rank's own.
  double scheduleSeconds() const { return scheduleSeconds_; }
  void setScheduleSeconds(double seconds) { scheduleSeconds_ = seconds; }

 private:
  const TrainerOptions& options_;
  const LoopOptions& loop_;
  int64_t totalSteps_;
  StopReason reason_ = StopReason::kNone;
  double scheduleSeconds_ = 0.0;
};

// One run's training loop on this rank, from a prepared and attached RunSetup.
class Trainer {
 public:
  Trainer(RunSetup& setup, StepEngine& engine, const TrainerOptions& options,
          CheckpointDir& checkpoints, Distributed* dist)
      : s_(setup),
        engine_(engine),
        loop_(setup.options.loop),
        options_(options),
        checkpoints_(checkpoints),
        dist_(dist),
        isRoot_(options.world.rank == 0),
        progress_(options.terminal, options.tty, options.quiet || !isRoot_, setup.totalSteps,
                  loop_.logEvery),
        timeline_(options.tracePath, options.world.rank),
        stop_(options, loop_, setup.totalSteps),
        window_(dist),
        sourceSamples_(setup.data.train->sourceLabels().size(), 0) {}
  ~Trainer() {
    if (dist_ != nullptr) dist_->setTimeline(nullptr);  // the exchanges outlive the timeline
  }

  TrainSummary run();

 private:
  void begin();
  void commitRunDirectory();
  void trainOneStep();
  void accountMemory();
  void checkNonFinite(const StepResult& r);
  void writeTrainRecord(double lr, double samplesPerS);
  void evaluateNow(std::optional<double> distance = std::nullopt);
  void checkpointNow(std::map<std::string, at::Tensor>* collected = nullptr,
                     bool alsoExportModel = false);
  void exportModel(bool streamed);
  void finish();
  void writeSummary(double measuredFwdBwd);
  double trainSeconds() const { return elapsedBefore_ + secondsSince(start_); }

  RunSetup& s_;
  StepEngine& engine_;
  const LoopOptions& loop_;
  const TrainerOptions& options_;
  CheckpointDir& checkpoints_;
  Distributed* dist_;
  const bool isRoot_;
  Progress progress_;
  Timeline timeline_;
  StopState stop_;
  MetricsWindow window_;
  std::unique_ptr<MetricsSink> metrics_;  // rank 0, from commitRunDirectory()
  bool committed_ = false;
  std::unique_ptr<SavedTensorScope> savedTensors_;

  TrainSummary summary_;
  int64_t epoch_ = 1;  // 1-based epoch of the latest step
  int64_t lastEvalStep_ = -1;
  int64_t skippedSteps_ = 0;  // train.nonfinite_skips used so far in this process
  std::vector<int64_t> sourceSamples_;  // data.sources: samples of each since the last record
  double lastLoss_ = std::nan("");
  double elapsedBefore_ = 0.0;  // training seconds of earlier processes of this run
  Clock::time_point start_;
  std::vector<double> forwardBackward_;  // per step, for measured vs predicted
  int64_t runActivationPeak_ = 0, runTrackedPeak_ = 0;
};

TrainSummary Trainer::run() {
  begin();
  TrainingState& state = s_.state;
  while (state.step < s_.totalSteps) {
    trainOneStep();
    const bool epochEnd = state.position.batchInEpoch == 0;
    // Evaluations and checkpoints are not training: the throughput window leaves them out.
    const Clock::time_point pauseStart = Clock::now();
    if ((loop_.evalEvery > 0 && state.step % loop_.evalEvery == 0) ||
        (loop_.evalEvery == 0 && epochEnd)) {
      evaluateNow();
    }
    if (stop_.reason() != StopReason::kNone && state.step < s_.totalSteps) {
      summary_.stoppedEarly = stop_.reason() == StopReason::kInterrupted;
      if (stop_.reason() == StopReason::kTimeUp) {
        progress_.line(fmt::format("train.max_minutes reached at step {}", state.step));
      }
      break;
    }
    if (loop_.checkpointEvery > 0 && state.step % loop_.checkpointEvery == 0 &&
        state.step < s_.totalSteps) {
      checkpointNow();
    }
    window_.exclude(Clock::now() - pauseStart);
  }
  finish();
  return summary_;
}

void Trainer::trainOneStep() {
  TrainingState& state = s_.state;
  LoadedBatch lb = s_.loader->next();
  epoch_ = lb.position.epoch + 1;
  if (!sourceSamples_.empty()) {
    for (int64_t i : lb.indices) ++sourceSamples_[s_.data.train->sourceOf(i)];
  }
  const double lr = learningRate(s_.schedule, state.step, stop_.scheduleSeconds());
  engine_.setLearningRate(lr);
  const auto stepStart = Clock::now();
  StepResult r = engine_.step(lb.batch, state.step);
  accountMemory();
  if (state.step > 0 || s_.resumedFrom) {  // the first step allocates; it is not typical
    forwardBackward_.push_back(std::chrono::duration<double>(r.backwardEnd - stepStart).count());
  }
  engine_.addSpans(timeline_, r, stepStart);
  window_.addStep(r, lb.batch.size() * s_.workers);
  r.loss = stop_.afterStep(state.step, r.loss, trainSeconds(), dist_, engine_, window_);
  checkNonFinite(r);
  if (!committed_) commitRunDirectory();
  ++state.step;
  if (dist_ != nullptr) dist_->stepDone(state.step);
  state.position = nextPosition(lb.position, s_.batchesPerEpoch);
  lastLoss_ = r.loss;
  const double samplesPerS = window_.samplesPerSecond();
  progress_.update(state.step, epoch_, r.loss, lr, samplesPerS,
                   loop_.maxSeconds > 0 ? loop_.maxSeconds - trainSeconds()
                                        : std::numeric_limits<double>::infinity());
  if (stop_.writesRecord(state.step)) writeTrainRecord(lr, samplesPerS);
  // The engine's own records (a strategy's events, the stages' timeline; docs/metrics.md).
  for (nlohmann::json& rec : engine_.takeRecords(state.step, r, stepStart, trainSeconds())) {
    if (metrics_) metrics_->write(rec);
  }
}

// Everything between an attached setup and the first step: the banner, memory accounting's
// scope, the memory plan. Nothing is written to the run directory yet (commitRunDirectory).
void Trainer::begin() {
  TrainingState& state = s_.state;
  if (dist_ != nullptr) dist_->setTimeline(timeline_.enabled() ? &timeline_ : nullptr);
  progress_.line(fmt::format(
      "caravan: {} ({} blocks, {:.2f}M parameters) on {} ({} train / {} eval examples), "
      "{} steps of batch {}{}{}",
      s_.model->modelName(), s_.model->numBlocks(), static_cast<double>(s_.parameterCount()) / 1e6,
      s_.data.train->name(), s_.data.train->size(), s_.data.test->size(), s_.totalSteps,
      s_.sampler.batchSize, engine_.describe(),
      s_.resumedFrom ? fmt::format(", resuming at step {} from {}", state.step, *s_.resumedFrom)
                     : ""));
  if (!s_.reshardNote.empty()) progress_.line(s_.reshardNote);
  // Weights and buffers (batch norm's running statistics) saved by ops are not activations
  // (out-of-core weights move between storages: the executor asks the store).
  savedTensors_ = std::make_unique<SavedTensorScope>(s_.memory, s_.model->buffers(),
                                                     engine_.modelStateTensors());
  for (const std::string& line : s_.precision.report) progress_.line(line);
  {
    std::istringstream report(s_.activations.report);
    for (std::string line; std::getline(report, line);) progress_.line(line);
  }
  releaseFreeHeap();
  epoch_ = state.position.epoch + 1;
  elapsedBefore_ = state.elapsedSeconds;
  stop_.setScheduleSeconds(state.elapsedSeconds);  // a resumed schedule goes on from there
  start_ = Clock::now();
  s_.model->train();
  window_ = MetricsWindow(dist_);
}

// The run directory changes only once the first step has run: everything that can refuse the
// run (its keys, the checkpoint, the memory plan, the budget the first step is checked
// against, the first loss) has been checked, so a refused run, new or a --resume with other
// settings, leaves the directory as it was and a plain --resume still works.
void Trainer::commitRunDirectory() {
  committed_ = true;
  if (!isRoot_) return;
  const fs::path dir(options_.runDir);
  // The metrics first: it reads what is there and may refuse it (not a regular file), before
  // config.toml changes.
  metrics_ = std::make_unique<MetricsSink>((dir / "metrics.jsonl").string(),
                                           s_.resumedFrom ? s_.state.step : -1);
  writeFileAtomic((dir / "config.toml").string(), s_.config.toToml());
  for (const auto& [name, text] : s_.planFiles()) writeFileAtomic((dir / name).string(), text);
}

// Memory accounting after a step: what persists measured, and memory.budget checked against
// what every later step needs (the policies are fixed for the run).
void Trainer::accountMemory() {
  MemoryTracker& memory = s_.memory;
  engine_.accountModelState(memory);
  // This step's activation peak on top of everything that persists (weights, gradients and
  // optimizer state exist from the first step on).
  const int64_t needed = std::max(
      memory.totalPeak(),
      memory.peak(MemoryCategory::kActivations) + memory.live(MemoryCategory::kWeights) +
          memory.live(MemoryCategory::kGradients) + memory.live(MemoryCategory::kOptimizerState));
  const MemoryOptions& mo = s_.options.memory;
  if (mo.budget > 0 && needed > mo.budget) {
    throw ConfigError(fmt::format(
        "memory.budget = {} is below what step {} needs: {} tracked (activations {}, weights "
        "{}, gradients {}, optimizer state {}); the smallest budget that works for this "
        "model, batch and memory.policy = {} is {} ({} bytes){}",
        formatBytes(mo.budget), s_.state.step + 1, formatBytes(needed),
        formatBytes(memory.peak(MemoryCategory::kActivations)),
        formatBytes(memory.live(MemoryCategory::kWeights)),
        formatBytes(memory.live(MemoryCategory::kGradients)),
        formatBytes(memory.live(MemoryCategory::kOptimizerState)), mo.policy,
        formatBytesAtLeast(needed), needed,
        // (The run directory is not written before the first step: the plan is not there.)
        mo.automatic()
            ? fmt::format("; the plan's prediction was short{} (caravan plan with the same "
                          "settings prints the plan)",
                          s_.activations.plan
                              ? fmt::format(": it predicted {} of activations",
                                            formatBytes(s_.activations.plan->prediction.peakBytes))
                              : "")
            : engine_.memoryAdvice()));
  }
  runActivationPeak_ = std::max(runActivationPeak_, memory.peak(MemoryCategory::kActivations));
  runTrackedPeak_ = std::max(runTrackedPeak_, needed);
  window_.addMemoryPeak(needed);
}

// A non-finite loss or gradient here, or (local SGD, gossip: gradients are per rank) on
// another rank: every rank sees the mean loss, so they count alike. Skipped while
// train.nonfinite_skips lasts, then the run stops (NonFiniteError).
void Trainer::checkNonFinite(const StepResult& r) {
  if (!r.skipped && std::isfinite(r.loss)) return;
  const int64_t step = s_.state.step + 1;
  if (skippedSteps_ < loop_.nonfiniteSkips) {
    ++skippedSteps_;
    progress_.line(
        fmt::format("step {}: loss {}, a non-finite loss or gradient; update "
                    "skipped ({} of train.nonfinite_skips = {})",
                    step, r.loss, skippedSteps_, loop_.nonfiniteSkips));
    return;
  }
  const std::string lower = "lower " + engine_.rateKeys();
  throw NonFiniteError(fmt::format(
      "loss became {} at step {} (epoch {}){}; the last good checkpoint is {}; {} or set "
      "optim.grad_clip",
      r.loss, step, epoch_,
      loop_.nonfiniteSkips > 0
          ? fmt::format(" after {} skipped steps (train.nonfinite_skips)", skippedSteps_)
          : "",
      checkpoints_.latest().value_or("(none: set checkpoint.every)"), lower));
}

void Trainer::writeTrainRecord(double lr, double samplesPerS) {
  nlohmann::json rec = {{"kind", "train"},
                        {"step", s_.state.step},
                        {"epoch", epoch_},
                        {"loss", lastLoss_},
                        {"lr", lr},
                        {"samples_per_s", samplesPerS},
                        {"time_s", trainSeconds()},
                        {"workers", s_.workers}};
  if (loop_.nonfiniteSkips > 0) rec["skipped_steps"] = skippedSteps_;  // in this process
  if (!sourceSamples_.empty()) {
    // This worker's samples from each source since the last train record.
    const std::vector<std::string> labels = s_.data.train->sourceLabels();
    nlohmann::json counts = nlohmann::json::object();
    for (size_t k = 0; k < labels.size(); ++k) counts[labels[k]] = sourceSamples_[k];
    rec["source_samples"] = counts;
    std::fill(sourceSamples_.begin(), sourceSamples_.end(), 0);
  }
  rec = window_.close(std::move(rec), s_.memory, s_.activations.executor.get(), s_.weights.get(),
                      engine_.takeMetrics());
  if (metrics_) metrics_->write(rec);
}

// `distance`: the consensus distance when the caller consolidated already.
void Trainer::evaluateNow(std::optional<double> distance) {
  const double consensus = distance ? *distance : engine_.consolidate();
  const EvalResult r =
      engine_.evaluate(*s_.data.test, s_.options.data.evalBatchSize, loop_.evalBatches);
  nlohmann::json rec = {{"kind", "eval"},          {"step", s_.state.step},
                        {"epoch", epoch_},         {"loss", r.loss},
                        {"accuracy", r.accuracy},  {"examples", r.examples},
                        {"time_s", trainSeconds()}};
  if (engine_.reportsConsensus()) rec["consensus_distance"] = consensus;
  if (metrics_) metrics_->write(rec);
  progress_.line(fmt::format("eval  step {} epoch {}: loss {:.4f}{}", s_.state.step, epoch_, r.loss,
                             accuracyText(r.accuracy)));
  summary_.evalLoss = r.loss;
  summary_.evalAccuracy = r.accuracy;
  lastEvalStep_ = s_.state.step;
}

// The model's parameters as model.pt: rank 0's within withWholeModel (every stage's, every
// block's in memory), or (`streamed`) the engine's exportModel, called by every rank.
void Trainer::exportModel(bool streamed) {
  const std::string path = (fs::path(options_.runDir) / "model.pt").string();
  const ExportNames names = [this](const std::string& n) { return s_.model->exportNames(n); };
  if (streamed) {
    engine_.exportModel(path, *s_.model, names);
  } else {
    exportStateDict(path, *s_.model, names);
  }
}

// `collected`: the strategy's state when the caller consolidated and collected it already.
// `alsoExportModel`: rank 0 writes model.pt too.
void Trainer::checkpointNow(std::map<std::string, at::Tensor>* collected, bool alsoExportModel) {
  TrainingState& state = s_.state;
  if (collected != nullptr) {
    state.strategy = std::move(*collected);
  } else {
    engine_.consolidate();
    state.strategy = engine_.strategyState();
  }
  state.workers = s_.workers;
  state.batchSize = s_.sampler.batchSize;
  summary_.lastCheckpoint = checkpoints_.pathFor(state.step);
  // A sharded engine's set: each rank its own slices, no gather; model.pt then streams.
  state.rngState = defaultRngState();
  state.elapsedSeconds = trainSeconds();
  if (const auto path = engine_.writeShardedCheckpoint(checkpoints_, state)) {
    summary_.lastCheckpoint = *path;
    if (alsoExportModel) exportModel(/*streamed=*/true);
  } else {
    engine_.withWholeModel([&] {
      state.rngState = defaultRngState();
      state.elapsedSeconds = trainSeconds();  // with the time the whole model took to come
      summary_.lastCheckpoint = checkpoints_.save(*s_.model, *s_.optimizer, state);
      if (alsoExportModel) exportModel(/*streamed=*/false);
    });
  }
  state.strategy.clear();
}

// The end of the run: one model, the final evaluation and checkpoint, and on rank 0 model.pt
// (unless stopped early) and summary.json.
void Trainer::finish() {
  if (!committed_) commitRunDirectory();  // no step ran (a resume at the last step)
  progress_.finish();
  // The final checkpoint's strategy state is collected while the servers still serve:
  // finish() says goodbye to them.
  const double finalDistance = engine_.consolidate();
  std::map<std::string, at::Tensor> finalStrategyState = engine_.strategyState();
  engine_.finish();
  double measuredFwdBwd = 0.0;
  if (!forwardBackward_.empty()) {
    std::vector<double> sorted = forwardBackward_;
    std::sort(sorted.begin(), sorted.end());
    measuredFwdBwd = sorted[sorted.size() / 2];
  }
  if (s_.activations.plan && measuredFwdBwd > 0) {
    const Prediction& p = s_.activations.plan->prediction;
    progress_.line(fmt::format(
        "memory plan: forward+backward measured {:.1f} ms (median) vs predicted {:.1f} ms "
        "({:+.1f}%); activation peak measured {} vs predicted {}",
        measuredFwdBwd * 1e3, p.stepSeconds * 1e3, (measuredFwdBwd / p.stepSeconds - 1.0) * 100.0,
        formatBytes(runActivationPeak_), formatBytes(p.peakBytes)));
  }
  if (!summary_.stoppedEarly && lastEvalStep_ != s_.state.step) evaluateNow(finalDistance);
  // model.pt with the final checkpoint (unless stopped early): the whole model comes once.
  checkpointNow(&finalStrategyState, /*alsoExportModel=*/!summary_.stoppedEarly);
  summary_.steps = s_.state.step;
  summary_.epochs = epoch_;
  summary_.finalTrainLoss = lastLoss_;
  summary_.trainSeconds = trainSeconds();
  summary_.samplesPerSecond =
      summary_.trainSeconds > 0
          ? static_cast<double>(s_.state.step * s_.sampler.batchSize * s_.workers) /
                summary_.trainSeconds
          : 0.0;
  timeline_.flush();
  if (!isRoot_) return;
  writeSummary(measuredFwdBwd);
}

void Trainer::writeSummary(double measuredFwdBwd) {
  nlohmann::json sj = {{"steps", summary_.steps},
                       {"epochs", summary_.epochs},
                       {"final_train_loss", summary_.finalTrainLoss},
                       {"eval_loss", summary_.evalLoss},
                       {"eval_accuracy", summary_.evalAccuracy},
                       {"train_seconds", summary_.trainSeconds},
                       {"samples_per_s", summary_.samplesPerSecond},
                       {"stopped_early", summary_.stoppedEarly},
                       {"memory_policy", formatPolicies(s_.activations.policies)},
                       {"memory_weights", s_.options.memory.offloadWeights ? "offload" : "core"},
                       {"skipped_steps", skippedSteps_},
                       {"fwd_bwd_s", measuredFwdBwd},
                       {"activation_peak_bytes", runActivationPeak_},
                       {"tracked_peak_bytes", runTrackedPeak_},
                       {"checkpoint", summary_.lastCheckpoint},
                       {"compute_threads", at::get_num_threads()},
                       {"openmp_wait_policy", openMpWaitPolicy()},
                       {"blas_threads", blasThreads()},
                       {"precision", s_.precision.requested}};
  sj["precision_blocks"] = s_.precision.blocksJson(*s_.model);
  if (s_.activations.plan) {
    sj["predicted_fwd_bwd_s"] = s_.activations.plan->prediction.stepSeconds;
    sj["predicted_activation_peak_bytes"] = s_.activations.plan->prediction.peakBytes;
  }
  writeFileAtomic((fs::path(options_.runDir) / "summary.json").string(), sj.dump(2) + "\n");
}

}  // namespace

TrainSummary train(const Config& given, const TrainerOptions& options) {
  const RunOptions givenOptions = RunOptions::read(given);
  validate(givenOptions, options.world.worldSize);
  // Rank 0 locks the directory; under Caravan's own launcher the launcher (our parent) holds it
  // for its workers, and any other holder is refused (CARAVAN_LAUNCHER=caravan set by hand used
  // to skip the lock).
  const RunDirectoryClaim claim = claimRunDirectory(
      options.runDir, options.resume, options.world.rank == 0,
      options.world.launcher == "caravan" ? std::optional<pid_t>(::getppid()) : std::nullopt);
  const std::optional<std::string>& resumeFrom = claim.resumeFrom;
  // parallel.layout = auto: the keys rank 0's search chose, over the config's (through the job's
  // store, which the rendezvous then uses).
  const bool laidOut = layoutIsAuto(given);
  c10::intrusive_ptr<c10d::Store> store;
  if (laidOut && options.world.worldSize > 1) {
    store = makeJobStore(givenOptions, options.world, options.runDir);
  }
  const Config config = laidOut
                            ? resolveLayout(given, options.world, options.runDir, options.resume,
                                            store.get(), options.chooseLayout, !options.quiet)
                            : given;
  const RunOptions runOptions = laidOut ? RunOptions::read(config) : givenOptions;
  if (laidOut) validate(runOptions, options.world.worldSize);  // checked as the given keys were
  CheckpointDir checkpoints(options.runDir, runOptions.loop.checkpointKeep);

  applyRuntimeOptions(runOptions.runtime);
  installSavedTensorEngine();
  auto trainHere = [&](Distributed* dist) {
    RunSetup setup(config, runOptions, dist);
    setup.prepareTraining(resumeFrom, options.world.localWorldSize);
    const std::unique_ptr<StepEngine> engine = setup.attach(dist);
    return Trainer(setup, *engine, options, checkpoints, dist).run();
  };
  // Rendezvous after the checks above and before rank 0 writes anything, so every rank has
  // seen the run directory as it was.
  if (options.world.worldSize == 1) return trainHere(nullptr);
  Distributed dist(runOptions, options.world, options.runDir, jobSignature(config), store);
  try {
    if (dist.isServer()) {
      dist.serve();
      return TrainSummary{};
    }
    return trainHere(&dist);
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
