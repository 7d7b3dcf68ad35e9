// caravan: the command-line entry point. Parses arguments, installs signal handlers, owns the
// terminal, and maps errors to one-line messages and exit codes (see core/errors.h).
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iostream>
#include <new>
#include <optional>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <torch/version.h>
#include <CLI/CLI.hpp>

#include "caravan_version.h"
#include "cli/export_model.h"
#include "cli/launch.h"
#include "cli/launcher.h"
#include "cli/simulate.h"
#include "comm/world.h"
#include "core/config.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/openmp_env.h"
#include "core/output_path.h"
#include "data/text.h"
#include "memory/accounting.h"
#include "memory/saved_tensors.h"
#include "memory/tracker.h"
#include "report/report.h"
#include "sim/choose_layout.h"
#include "train/checkpoint.h"
#include "train/distributed.h"
#include "train/memory_setup.h"
#include "train/run_options.h"
#include "train/run_setup.h"
#include "train/setup.h"
#include "train/step.h"
#include "train/trainer.h"

namespace fs = std::filesystem;
using namespace caravan;

namespace {

std::atomic<bool> gStopRequested{false};

void onSignal(int sig) {
  gStopRequested.store(true);
  std::signal(sig, SIG_DFL);  // a second signal ends the process at once
}

std::string defaultRunDir(const std::string& configPath) {
  std::time_t now = std::time(nullptr);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%Y%m%d-%H%M%S", std::localtime(&now));
  return (fs::path("runs") / (fs::path(configPath).stem().string() + "-" + stamp)).string();
}

// The flags of `caravan train`, as parsed.
struct TrainCommand {
  std::string configPath;              // --config
  std::vector<std::string> overrides;  // --set
  std::string runDir;                  // --run-dir
  std::string resumeDir;               // --resume
  int64_t stopAtStep = 0;              // --stop-at-step
  bool quiet = false;                  // --quiet
  bool trace = false;                  // --trace
  int workers = 0;                     // --workers
  int maxRestarts = 0;                 // --max-restarts
};

// The config of `caravan train`: --config FILE, or RUN_DIR/config.toml of --resume RUN_DIR.
Config loadTrainConfig(const TrainCommand& cmd) {
  if (!cmd.resumeDir.empty()) {
    if (!cmd.configPath.empty()) {
      throw ConfigError("--resume takes the config from RUN_DIR/config.toml; drop --config "
                        "(use --set to change a key)");
    }
    const std::string saved = (fs::path(cmd.resumeDir) / "config.toml").string();
    if (!fs::exists(saved)) {
      throw CheckpointError(
          fmt::format("cannot resume {}: it has no config.toml (is it a "
                      "Caravan run directory?)",
                      cmd.resumeDir));
    }
    return Config::fromFile(saved, cmd.overrides);
  }
  if (cmd.configPath.empty()) {
    throw ConfigError("caravan train needs --config FILE or --resume RUN_DIR");
  }
  return Config::fromFile(cmd.configPath, cmd.overrides);
}

int runTrain(char** argv, const TrainCommand& cmd) {
  TrainerOptions options;
  const Config config = loadTrainConfig(cmd);
  // Our rank: from the variables of caravan's own launcher (--workers), torchrun, srun or
  // mpirun; none of them: a world of one.
  options.world = worldFromEnvironment(processEnvironment());
  // Before anything else starts: this may replace the process with itself (core/openmp_env.h).
  restartWithOpenMpWaits(argv, config.i64("train.threads"),
                         matrixProductsFor(config.str("train.precision")),
                         options.world.localWorldSize);
  if (!cmd.resumeDir.empty()) {
    options.runDir = cmd.resumeDir;
    options.resume = true;
  } else {
    options.runDir = cmd.runDir.empty() ? defaultRunDir(cmd.configPath) : cmd.runDir;
  }
  options.stopAtStep = cmd.stopAtStep;
  if (cmd.trace) {
    options.tracePath = (fs::path(options.runDir) /
                         fmt::format("trace-rank{}.json", options.world.rank)).string();
  }
  options.stopRequested = &gStopRequested;
  options.terminal = stderr;
  options.tty = isatty(STDERR_FILENO) != 0;
  options.quiet = cmd.quiet;
  options.chooseLayout = sim::chooseLayoutKeys;
  // A closed terminal (SIGHUP) stops the run as SIGINT and SIGTERM do: a checkpoint first.
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) std::signal(sig, onSignal);

  TrainSummary s = train(config, options);
  if (!cmd.quiet) {
    std::fprintf(stderr,
                 "%s after %lld steps (%lld epochs) in %.1f s, %.1f samples/s: train loss %.4f, "
                 "eval loss %.4f%s\nrun directory: %s\n",
                 s.stoppedEarly ? "stopped" : "done", static_cast<long long>(s.steps),
                 static_cast<long long>(s.epochs), s.trainSeconds, s.samplesPerSecond,
                 s.finalTrainLoss, s.evalLoss, accuracyText(s.evalAccuracy, "eval ").c_str(),
                 options.runDir.c_str());
  }
  if (s.stoppedEarly) {
    if (!cmd.quiet) {
      const std::string workers = options.world.launcher == "caravan"
                                      ? fmt::format(" --workers {}", options.world.worldSize -
                                                                         serverCount(config))
                                      : "";
      std::fprintf(stderr, "checkpoint %s written; continue with: caravan train --resume %s%s\n",
                   s.lastCheckpoint.c_str(), options.runDir.c_str(), workers.c_str());
    }
    if (gStopRequested.load()) return static_cast<int>(ExitCode::kInterrupted);
  }
  return 0;
}

// `caravan train --workers N`: this process supervises N local workers (cli/launcher.h).
int launchTrain(int argc, char** argv, const TrainCommand& cmd) {
  const WorldInfo world = worldFromEnvironment(processEnvironment());
  if (world.launcher != "none") {
    const char* vars = world.launcher == "openmpi" ? "OMPI_COMM_WORLD_*"
                       : world.launcher == "slurm" ? "SLURM_PROCID/SLURM_NTASKS"
                                                   : "RANK/WORLD_SIZE";
    throw ConfigError(fmt::format(
        "--workers starts its own worker processes, but {} are set: this process is already "
        "rank {} of {} under {}; drop --workers (the launcher decides) or unset them",
        vars, world.rank, world.worldSize, world.launcher));
  }
  // Check the config here, once, rather than in N workers: every key, and every combination
  // of keys for this job's size, before any worker starts.
  const Config config = loadTrainConfig(cmd);
  LaunchOptions launch;
  // Parameter-server modes: N workers plus sync.servers server processes.
  launch.workers = cmd.workers + serverCount(config);
  const RunOptions options = RunOptions::read(config);
  validate(options, launch.workers);
  launch.program = argv[0];
  launch.args.assign(argv + 1, argv + argc);
  if (!cmd.resumeDir.empty()) {
    launch.runDir = cmd.resumeDir;
  } else if (!cmd.runDir.empty()) {
    launch.runDir = cmd.runDir;
  } else {
    launch.runDir = defaultRunDir(cmd.configPath);  // chosen once, so every rank agrees
    launch.addRunDir = true;
  }
  launch.threadsConfigured = options.runtime.threads > 0;
  // Before any worker starts (and writes its log into the directory): the directory is this
  // job's until the launcher returns, and holds what a new run or --resume expects.
  const RunDirectoryClaim claim =
      claimRunDirectory(launch.runDir, !cmd.resumeDir.empty(), /*lock=*/true);
  // --max-restarts K: after a failed worker, the job starts again from the run's newest
  // checkpoint (the workers that were stopped wrote one if they could), K times at most.
  for (int restart = 1;; ++restart) {
    // This launcher starts every rank: the run directory's own file store, if there, holds
    // the keys (rank claims among them) of a job that is over. (A dist.store_path is the
    // user's file: never removed; each start keeps its keys apart in it, comm/store.h.)
    if (options.sync.store == "file" && options.sync.storePath.empty()) {
      std::error_code ec;
      fs::remove(fs::path(launch.runDir) / "rendezvous", ec);
    }
    try {
      return superviseWorkers(launch);
    } catch (const WorkerError& e) {
      // Every worker has stopped: a checkpoint one was writing is a stale temporary.
      const CheckpointDir checkpoints(launch.runDir, options.loop.checkpointKeep);
      checkpoints.removeStaleTemporaries();
      // A refused config or command is refused again: no restart.
      if (restart > cmd.maxRestarts || e.code() == ExitCode::kConfig) throw;
      const std::optional<std::string> latest = checkpoints.latest();
      if (!latest) {
        throw WorkerError(fmt::format("{}; not restarted: {} has no checkpoint yet (set "
                                      "checkpoint.every to restart from one)",
                                      e.what(), launch.runDir),
                          e.code());
      }
      std::fprintf(stderr, "caravan: %s\ncaravan: restart %d of %d, from %s\n", e.what(), restart,
                   cmd.maxRestarts, latest->c_str());
      launch.args = restartArguments(launch.args, launch.runDir);
      launch.addRunDir = false;
    }
  }
}

// What caravan plan and caravan eval run under: the config's settings, in float32, as
// RunSetup::forInspection builds the model (so OpenBLAS keeps its threads).
RuntimeOptions inspectionRuntime(RuntimeOptions runtime) {
  runtime.precision = "float32";
  return runtime;
}

// caravan plan: profile the config's model on one batch, plan its blocks under memory.budget
// and print the plan; exit 2 if no plan fits.
int runPlan(const std::string& configPath, const std::vector<std::string>& overrides) {
  const Config config = configPath.empty() ? Config::fromString("", "<defaults>", overrides)
                                           : Config::fromFile(configPath, overrides);
  const RunOptions options = RunOptions::read(config);
  applyRuntimeOptions(inspectionRuntime(options.runtime));
  installSavedTensorEngine();
  RunSetup setup = RunSetup::forInspection(config);
  setup.model->train();
  const Batch sample = setup.sampleBatch();
  if (options.pipeline.active()) {  // the partition into stages: one worker's plan does not run
    const PipelinePlan plan = planPipeline(options, setup.model, sample);
    std::cout << fmt::format("{} ({} blocks), batch {} per pipeline\n", setup.model->modelName(),
                             setup.model->numBlocks(), sample.size());
    std::cout << plan.report;
    if (!plan.partition.fits) throw noPartitionFits(options, plan.partition.smallestBudget);
    return 0;
  }
  checkTrainingFitsMachine(options, setup.model, sample, setup.data.train->shape().seqLen, 1);
  ActivationMemory m = makeActivationMemory(options, setup.model, sample, /*alwaysPlan=*/true);
  std::cout << fmt::format("{} ({} blocks), batch {}\n", setup.model->modelName(),
                           setup.model->numBlocks(), sample.size());
  if (!setup.model->structureNote().empty()) {
    std::cout << (setup.model->numBlocks() == 1 ? "cannot plan per block: " : "blocks: ")
              << setup.model->structureNote() << "\n";
  }
  std::cout << m.report;
  {
    int64_t parameterBytes = 0, largestBlock = 0;
    for (const auto& block : blockParameters(setup.model)) {
      const int64_t bytes = tensorBytes(block);
      parameterBytes += bytes;
      largestBlock = std::max(largestBlock, bytes);
    }
    std::cout << shardingReport(parameterBytes, weightOptions(options).stateFactor, largestBlock,
                                {2, 4, 8});
  }
  if (!m.plan->fits) {
    const int64_t smallest = smallestPlannedBudget(*m.plan, m.persistent);
    throw ConfigError(
        fmt::format("no plan fits memory.budget = {}; the smallest budget the "
                    "planner can fit is {} ({} bytes)",
                    options.memory.budgetText, formatBytesAtLeast(smallest), smallest));
  }
  return 0;
}

// The config a run directory's run was trained with (RUN_DIR/config.toml, with `overrides`).
Config savedRunConfig(const std::string& runDir, const std::vector<std::string>& overrides) {
  const std::string saved = (fs::path(runDir) / "config.toml").string();
  if (!fs::exists(saved)) {
    throw CheckpointError(fmt::format("{} has no config.toml (is it a Caravan run directory?)",
                                      runDir));
  }
  return Config::fromFile(saved, overrides);
}

// A checkpoint (in-core, or a sharded set's manifest: every rank's slices put together) is
// read into the model of `setup` (and a throwaway optimizer: its state is not used here).
TrainingState loadWholeModel(const RunOptions& options, RunSetup& setup,
                             const std::string& checkpoint) {
  const auto optimizer = makeOptimizer(options.optim, setup.model->parameters());
  return loadCheckpoint(checkpoint, *setup.model, *optimizer, setup.identity);
}

int runEval(const std::string& runDir, std::string checkpoint,
            const std::vector<std::string>& overrides) {
  const Config config = savedRunConfig(runDir, overrides);
  const RunOptions options = RunOptions::read(config);
  applyRuntimeOptions(inspectionRuntime(options.runtime));
  if (checkpoint.empty()) {
    CheckpointDir dir(runDir, options.loop.checkpointKeep);
    auto latest = dir.latest();
    if (!latest) throw CheckpointError(fmt::format("{} has no checkpoints to evaluate", runDir));
    checkpoint = *latest;
  }
  RunSetup setup = RunSetup::forInspection(config);
  const TrainingState st = loadWholeModel(options, setup, checkpoint);
  EvalResult r = evaluate(setup.model, *setup.data.test, options.data.evalBatchSize, 0);
  nlohmann::json out = {{"checkpoint", checkpoint}, {"step", st.step}, {"loss", r.loss},
                        {"accuracy", r.accuracy}, {"examples", r.examples}};
  std::cout << out.dump() << std::endl;
  return 0;
}

// The flags of `caravan checkpoint consolidate`.
struct CheckpointCommands {
  CLI::App* consolidate = nullptr;
  CLI::Option* step = nullptr;
  std::string runDir, out;
  int64_t stepNumber = 0;
};

// caravan checkpoint consolidate RUN_DIR: the whole model of one of the run's checkpoints (a
// sharded set's slices put together, or an in-core checkpoint's) as the run's model.pt is
// written, with no worker running.
int runConsolidate(const CheckpointCommands& c) {
  const Config config = savedRunConfig(c.runDir, {});
  const RunOptions options = RunOptions::read(config);
  applyRuntimeOptions(inspectionRuntime(options.runtime));
  const CheckpointDir dir(c.runDir, options.loop.checkpointKeep);
  std::string checkpoint;
  if (c.step->count() > 0) {
    checkpoint = dir.pathFor(c.stepNumber);
    if (!fs::is_regular_file(checkpoint)) {
      std::vector<std::string> steps;
      for (const std::string& path : dir.list()) {
        steps.push_back(std::to_string(*CheckpointDir::stepOf(path)));
      }
      throw CheckpointError(fmt::format(
          "{} has no checkpoint of step {}; {}", c.runDir, c.stepNumber,
          steps.empty() ? std::string("it has none")
                        : fmt::format("pass --step {}, or leave --step out for the newest",
                                      fmt::join(steps, ", --step "))));
    }
  } else {
    const std::optional<std::string> latest = dir.latest();
    if (!latest) {
      throw CheckpointError(fmt::format("{} has no checkpoints to consolidate", c.runDir));
    }
    checkpoint = *latest;
  }
  std::string out = c.out;
  if (out.empty()) {
    // Beside the run's own model.pt, never over it.
    out = (fs::path(c.runDir) /
           fmt::format("model-step-{:08d}.pt", CheckpointDir::stepOf(checkpoint).value_or(0)))
              .string();
  } else {
    checkOutputPath({"--out", out}, {c.runDir, checkpoint});
  }
  RunSetup setup = RunSetup::forInspection(config);
  const TrainingState st = loadWholeModel(options, setup, checkpoint);
  exportStateDict(out, *setup.model,
                  [&setup](const std::string& n) { return setup.model->exportNames(n); });
  std::fprintf(stderr, "caravan: wrote %s: the model of %s (step %lld)\n", out.c_str(),
               checkpoint.c_str(), static_cast<long long>(st.step));
  return 0;
}

// caravan data tokenize ARGS: runs caravan-tokenize ARGS (beside this program) in its place.
int runTokenizer(const std::vector<std::string>& args) {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  const std::string program = (self.parent_path() / "caravan-tokenize").string();
  std::vector<char*> argv{const_cast<char*>(program.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  std::fflush(stdout);
  ::execv(program.c_str(), argv.data());
  throw IoError(fmt::format("cannot run {} ({}); build it (cmake --build build) or reinstall",
                            program, std::strerror(errno)));
}

int runReport(const std::vector<std::string>& sources, std::string output,
              const std::string& pngDir, const std::string& title) {
  if (output.empty() && pngDir.empty()) output = "report.html";
  if (!output.empty()) report::checkOutputIsNoInput(output, sources);
  if (!pngDir.empty()) checkOutputPath({"--png", pngDir, /*directory=*/true}, sources);
  const nlohmann::json data = report::collect(sources, title);
  const std::string html = report::renderHtml(data);
  if (!output.empty()) {
    writeFileAtomic(output, html);
    std::fprintf(stderr, "caravan: wrote %s (%zu runs, %zu bench results, %.1f MB)\n",
                 output.c_str(), data["runs"].size(), data["benches"].size(),
                 static_cast<double>(html.size()) / 1e6);
  }
  if (!pngDir.empty()) {
    const std::vector<std::string> files = report::writePngs(html, pngDir);
    std::fprintf(stderr, "caravan: wrote %zu charts to %s\n", files.size(), pngDir.c_str());
  }
  return 0;
}

// An allocation failed (the machine's memory, `ulimit -v`, a cgroup limit): one line that says
// so and what to lower, and its own exit code, instead of "internal error: std::bad_alloc".
int outOfMemory(const char* clearLine, const std::string& detail) {
  std::fprintf(stderr,
               "%scaravan: error: out of memory%s%s; lower data.batch_size (data.eval_batch_size "
               "when it ran out in evaluation), data.seq_len or the model's size, or fit it in "
               "less (memory.policy = auto with memory.budget, memory.weights = offload)\n",
               clearLine, detail.empty() ? "" : ": ", detail.c_str());
  return static_cast<int>(ExitCode::kOutOfMemory);
}

// `caravan train`'s flags, and those of them whose presence (not only value) matters.
struct TrainCli {
  TrainCommand cmd;
  CLI::App* app = nullptr;
  CLI::Option* runDir = nullptr;
  CLI::Option* stopAtStep = nullptr;
  CLI::Option* workers = nullptr;
  CLI::Option* maxRestarts = nullptr;
};

void addTrainCommand(CLI::App& app, TrainCli& t) {
  TrainCommand& c = t.cmd;
  t.app = app.add_subcommand("train", "train a model (config keys: caravan config --schema)");
  CLI::App* train = t.app;
  train->add_option("--config,-c", c.configPath, "TOML config file (see configs/)");
  train->add_option("--set", c.overrides,
                    "override a config key: --set optim.lr=0.05 (repeatable)");
  t.runDir = train->add_option("--run-dir", c.runDir,
                               "where config.toml, metrics.jsonl, checkpoints/ and model.pt go "
                               "(default runs/<config>-<time>)");
  train->add_option("--resume", c.resumeDir,
                    "continue the run in RUN_DIR from its newest checkpoint (exactly: same "
                    "losses as an uninterrupted run)");
  t.stopAtStep = train->add_option(
      "--stop-at-step", c.stopAtStep,
      "stop after step N with a checkpoint, as if interrupted; --resume continues");
  train->add_flag("--quiet,-q", c.quiet,
                  "print nothing to the terminal (metrics are still written)");
  train->add_flag("--trace", c.trace,
                  "write RUN_DIR/trace-rank<r>.json, a Chrome-trace timeline (forward, backward, "
                  "each gradient bucket's communication, waits) for Perfetto or chrome://tracing");
  t.workers = train
                  ->add_option("--workers", c.workers,
                               "spawn N local worker processes (data parallel); under "
                               "torchrun/srun/mpirun the launcher's variables decide instead")
                  ->check(CLI::Range(1, 1024));
  t.maxRestarts =
      train
          ->add_option("--max-restarts", c.maxRestarts,
                       "with --workers: after a worker fails, restart the job from the run's "
                       "newest checkpoint, at most K times (each restart is announced)")
          ->check(CLI::Range(0, 1000));
  train->footer("Config keys (TOML [section] key = value, or --set section.key=value):\n" +
                Config::schemaText());
}

// `caravan train`: the checks of flags that go together, then one process or a launcher.
int runTrainCommand(int argc, char** argv, const TrainCli& t) {
  const TrainCommand& c = t.cmd;
  if (t.stopAtStep->count() > 0 && c.stopAtStep < 1) {
    throw ConfigError(fmt::format("--stop-at-step {} must be a step, 1 or more", c.stopAtStep));
  }
  if (t.runDir->count() > 0 && !c.resumeDir.empty()) {
    throw ConfigError("--resume RUN_DIR names the run directory; drop --run-dir");
  }
  if (t.runDir->count() > 0 && c.runDir.empty()) {
    throw ConfigError(
        "--run-dir is empty; name a directory (or leave --run-dir out for "
        "runs/<config>-<time>)");
  }
  if (t.maxRestarts->count() > 0 && t.workers->count() == 0) {
    throw ConfigError(
        "--max-restarts restarts the workers of --workers N; under torchrun, "
        "srun or mpirun use the launcher's own restart policy");
  }
  if (t.workers->count() > 0) return launchTrain(argc, argv, c);
  return runTrain(argv, c);
}

// The flags of `caravan eval`.
struct EvalCommand {
  CLI::App* app = nullptr;
  std::string runDir, checkpoint;
  std::vector<std::string> overrides;
};

void addEvalCommand(CLI::App& app, EvalCommand& e) {
  e.app = app.add_subcommand("eval",
                             "evaluate a run's checkpoint on the test/validation set; "
                             "prints one JSON line");
  e.app->add_option("--run-dir", e.runDir, "the run directory")->required();
  e.app->add_option("--checkpoint", e.checkpoint, "checkpoint file (default: the run's newest)");
  e.app->add_option("--set", e.overrides, "override a config key (e.g. data.path)");
}

void addCheckpointCommands(CLI::App& app, CheckpointCommands& c) {
  auto* checkpoint =
      app.add_subcommand("checkpoint", "work with a run's checkpoints without its workers");
  checkpoint->require_subcommand(1);
  c.consolidate = checkpoint->add_subcommand(
      "consolidate",
      "write a checkpoint's whole model (a sharded checkpoint's slices put together) as "
      "model.pt, which loads into the model's own class in Python");
  c.consolidate->add_option("run", c.runDir, "the run directory")->required();
  c.step = c.consolidate->add_option("--step", c.stepNumber,
                                     "the checkpoint of step N (default: the newest)");
  c.step->check(CLI::Range(int64_t{0}, int64_t{999999999999999}));
  c.consolidate->add_option("--out,-o", c.out,
                            "the file to write (default RUN/model-step-<N>.pt, beside the run's "
                            "own model.pt)");
}

// The flags of `caravan plan` and of `caravan config`: a config and its overrides.
struct ConfigCommand {
  CLI::App* app = nullptr;
  std::string configPath;
  std::vector<std::string> overrides;
  bool schema = false;  // caravan config --schema
  // caravan plan --cluster: the layout search (sim/choose_layout.h).
  std::string clusterPath;
  int workers = 0;  // 0: the cluster's hosts (less the config's servers)
  std::string workloadPath;
  std::string layoutOut;
};

void addPlanCommand(CLI::App& app, ConfigCommand& p) {
  p.app = app.add_subcommand(
      "plan",
      "profile the model's blocks on one batch and print the per-block memory plan "
      "(keep/recompute/swap/swap-input) under memory.budget, with predicted peak and "
      "step time");
  p.app->add_option("--config,-c", p.configPath, "TOML config file");
  p.app->add_option("--set", p.overrides, "override a config key (e.g. memory.budget=1GiB)");
  CLI::Option* cluster = p.app->add_option(
      "--cluster", p.clusterPath,
      "search the job's layouts on this cluster (a TOML [cluster] file, caravan "
      "calibrate writes one): pipeline stages x replicas, micro-batches, sharding, "
      "memory policy and weights, sync mode; prints the five fastest that fit and "
      "the one parallel.layout = auto runs");
  p.app->add_option("--workers", p.workers, "workers to lay out (default: the cluster's hosts)")
      ->check(CLI::Range(1, 1 << 20))
      ->needs(cluster);
  p.app
      ->add_option("--workload", p.workloadPath,
                   "with --cluster: a workload.json caravan simulate -o wrote (no profiling)")
      ->needs(cluster);
  p.app
      ->add_option("--output,-o", p.layoutOut,
                   "with --cluster: write the chosen layout and the top five as JSON")
      ->needs(cluster);
}

CLI::App* addSimulateCommand(CLI::App& app, SimulateArgs& sim) {
  auto* simulate = app.add_subcommand(
      "simulate",
      "predict the config's job on a cluster you describe (--cluster FILE): step "
      "time, throughput, scaling, bytes and utilisation per worker count, from the "
      "model's profile on this host (docs/simulate.md); --recommend ranks the ways "
      "to run it");
  simulate->add_option("--config,-c", sim.configPath, "TOML config file");
  simulate->add_option("--set", sim.overrides, "override a config key (e.g. sync.mode=osp)");
  simulate
      ->add_option("--cluster", sim.clusterPath,
                   "the cluster's TOML file ([cluster]: hosts, link_mbit, ...; caravan "
                   "calibrate writes one)")
      ->required();
  simulate
      ->add_option("--workers", sim.workers,
                   "worker counts, e.g. --workers 2,4,8 (default 1, 2, 4, ... up to the "
                   "cluster's hosts)")
      ->delimiter(',')
      ->check(CLI::Range(1, 1 << 20));
  simulate->add_option("--steps", sim.steps, "steps simulated per point (default 100)")
      ->check(CLI::Range(1, 1000000));
  simulate->add_option(
      "--seed", sim.seed,
      "the random seed of the stragglers and (pipelines on hosts held to a CPU quota) of "
      "the quota periods' starts");
  simulate->add_option("--output,-o", sim.outDir,
                       "write DIR/predictions.jsonl (one JSON object per worker count and mode) "
                       "and DIR/charts.json (caravan report)");
  simulate->add_option("--workload", sim.workloadPath,
                       "the workload.json an earlier -o DIR wrote: simulate without profiling "
                       "again (the config's sync keys still apply)");
  simulate->add_flag("--recommend", sim.recommend,
                     "also simulate the other sync modes and rank them, one line of reasons each");
  return simulate;
}

CLI::App* addCalibrateCommand(CLI::App& app, CalibrateArgs& calib) {
  auto* calibrate =
      app.add_subcommand("calibrate",
                         "measure this host (cores, memory, disk) and write a cluster file for "
                         "caravan simulate; the link's rate and latency are given");
  calibrate->add_option("--output,-o", calib.output, "the cluster file to write (default: print)");
  calibrate->add_option("--hosts", calib.hosts, "hosts like this one")
      ->check(CLI::Range(1, 1000000));
  calibrate->add_option("--link-mbit", calib.linkMbit, "each host's link rate, Mbit/s")
      ->check(CLI::Range(1e-3, 1e7));
  calibrate->add_option("--latency-us", calib.latencyUs, "one message's fixed cost, microseconds")
      ->check(CLI::Range(0.0, 1e7));
  calibrate->add_option("--swap-dir", calib.swapDir,
                        "where to measure the disk (default /var/tmp)");
  return calibrate;
}

CLI::App* addExportCommand(CLI::App& app, ExportArgs& exportArgs) {
  auto* exportCmd = app.add_subcommand(
      "export",
      "trace a PyTorch model as it is (FILE.py:FACTORY returning (module, example_input)) into "
      "a TorchScript file for model.path, and print the blocks found in it (needs .venv)");
  exportCmd->add_option("factory", exportArgs.factory, "FILE.py:FACTORY")->required();
  exportCmd->add_option("--output,-o", exportArgs.output, "the TorchScript file to write")
      ->required();
  exportCmd->add_option("--blocks", exportArgs.blocks,
                        "the containers whose items are the blocks: auto, or paths "
                        "separated by commas");
  return exportCmd;
}

void addConfigCommand(CLI::App& app, ConfigCommand& c) {
  c.app = app.add_subcommand("config",
                             "print the resolved config of --config/--set, or "
                             "the schema with --schema");
  c.app->add_option("--config,-c", c.configPath, "TOML config file");
  c.app->add_option("--set", c.overrides, "override a config key");
  c.app->add_flag("--schema", c.schema, "print every key as a Markdown table");
}

// caravan config: the resolved config, or the schema.
int runConfig(const ConfigCommand& c) {
  if (c.schema) {
    std::cout << Config::schemaMarkdown();
  } else {
    Config config = c.configPath.empty() ? Config::fromString("", "<defaults>", c.overrides)
                                         : Config::fromFile(c.configPath, c.overrides);
    std::cout << config.toToml();
  }
  return 0;
}

// The flags of `caravan report`.
struct ReportCommand {
  CLI::App* app = nullptr;
  std::vector<std::string> sources;
  std::string output, png, title;
};

void addReportCommand(CLI::App& app, ReportCommand& r) {
  r.app = app.add_subcommand(
      "report",
      "one self-contained HTML page comparing runs and bench results (loss, accuracy, "
      "throughput, memory, time split, rank skew, configs); --png for the charts as "
      "PNG files");
  r.app
      ->add_option("sources", r.sources,
                   "run directories (caravan train --run-dir) and bench results "
                   "(charts.json, or a directory with one)")
      ->required();
  r.app->add_option("--output,-o", r.output,
                    "the HTML file to write (default report.html; none with only --png)");
  r.app->add_option("--png", r.png,
                    "also write every chart as DIR/NAME.png (renders in headless Chromium)");
  r.app->add_option("--title", r.title, "the page's title");
}

// The flags of `caravan data tokenize` and `caravan data inspect`.
struct DataCommands {
  CLI::App* tokenize = nullptr;
  CLI::App* inspect = nullptr;
  std::string inspectPath, inspectDtype;
};

void addDataCommands(CLI::App& app, DataCommands& d) {
  auto* data = app.add_subcommand("data",
                                  "prepare and check data: tokenize text into token "
                                  "files, inspect what a file holds");
  data->require_subcommand(1);
  d.tokenize = data->add_subcommand(
      "tokenize",
      "tokenize UTF-8 text into token files (train.bin, val.bin) for data.dataset = "
      "\"tokens\": trains a SentencePiece model, uses one (--model), or bytes; "
      "caravan data tokenize --help for its options");
  // Its options are caravan-tokenize's (a program of its own: src/data/tokenize.h).
  d.tokenize->prefix_command();
  d.tokenize->set_help_flag();
  d.inspect = data->add_subcommand(
      "inspect",
      "print what a data file or directory holds (format, dtype, shape, count, id "
      "range): .npy, token .bin, IDX, .txt");
  d.inspect->add_option("path", d.inspectPath, "a file or a directory")->required();
  d.inspect->add_option("--token-dtype", d.inspectDtype,
                        ".bin files: uint16 or uint32 (default: tokens.json's, else uint16)");
}

// caravan data inspect: what the file or directory holds; DataError when some cannot be read.
int runInspect(const DataCommands& d) {
  const InspectResult r = inspectData(d.inspectPath, d.inspectDtype);
  for (const auto& line : r.lines) std::cout << line << "\n";
  std::cout.flush();
  if (r.unreadable > 0) {
    throw DataError(fmt::format("{} file{} in {} cannot be read (said above)", r.unreadable,
                                r.unreadable == 1 ? "" : "s", d.inspectPath));
  }
  return 0;
}

// Every subcommand's flags, filled in by parsing.
struct Commands {
  TrainCli train;
  EvalCommand eval;
  CheckpointCommands checkpoint;
  ConfigCommand plan;
  SimulateArgs sim;
  CLI::App* simulate = nullptr;
  CalibrateArgs calib;
  CLI::App* calibrate = nullptr;
  ExportArgs exportArgs;
  CLI::App* exportCmd = nullptr;
  ConfigCommand config;
  ReportCommand report;
  DataCommands data;
};

// The subcommands, in the order --help lists them.
void addCommands(CLI::App& app, Commands& c) {
  addTrainCommand(app, c.train);
  addEvalCommand(app, c.eval);
  addCheckpointCommands(app, c.checkpoint);
  addPlanCommand(app, c.plan);
  c.simulate = addSimulateCommand(app, c.sim);
  c.calibrate = addCalibrateCommand(app, c.calib);
  c.exportCmd = addExportCommand(app, c.exportArgs);
  addConfigCommand(app, c.config);
  addReportCommand(app, c.report);
  addDataCommands(app, c.data);
}

// Runs the subcommand that was parsed; returns the exit code, throws the errors main reports.
int runCommand(int argc, char** argv, const Commands& c) {
  if (*c.train.app) return runTrainCommand(argc, argv, c.train);
  if (*c.eval.app) return runEval(c.eval.runDir, c.eval.checkpoint, c.eval.overrides);
  if (*c.checkpoint.consolidate) return runConsolidate(c.checkpoint);
  if (*c.plan.app && !c.plan.clusterPath.empty()) {
    return runPlanLayout({c.plan.configPath, c.plan.overrides, c.plan.clusterPath, c.plan.workers,
                          c.plan.workloadPath, c.plan.layoutOut});
  }
  if (*c.plan.app) return runPlan(c.plan.configPath, c.plan.overrides);
  if (*c.simulate) return runSimulate(c.sim);
  if (*c.calibrate) return runCalibrate(c.calib);
  if (*c.exportCmd) return runExport(c.exportArgs);
  if (*c.report.app) {
    return runReport(c.report.sources, c.report.output, c.report.png, c.report.title);
  }
  if (*c.data.tokenize) return runTokenizer(c.data.tokenize->remaining());
  if (*c.data.inspect) return runInspect(c.data);
  if (*c.config.app) return runConfig(c.config);
  return 0;
}

// A first word that is no subcommand is named (CLI11 would say only that one is required):
// the exit code then, nullopt otherwise.
std::optional<int> rejectUnknownCommand(CLI::App& app, int argc, char** argv) {
  if (argc <= 1 || argv[1][0] == '-') return std::nullopt;
  std::string names;
  bool known = false;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    known = known || sub->get_name() == argv[1];
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  if (known) return std::nullopt;
  std::fprintf(stderr,
               "caravan: error: unknown command '%s'; the commands are %s (see "
               "caravan --help)\n",
               argv[1], names.c_str());
  return static_cast<int>(ExitCode::kConfig);
}

// Parses the command line: nullopt, or the exit code when parsing ends the process (--help,
// --version, a usage error).
std::optional<int> parseCommandLine(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "caravan: error: %s (see caravan --help)\n", e.what());
    return static_cast<int>(ExitCode::kConfig);
  }
  return std::nullopt;
}

// The exception being handled, as one line on stderr and an exit code (called in a catch).
int reportFailure(const char* clearLine) {
  try {
    throw;
  } catch (const Error& e) {
    const auto* worker = dynamic_cast<const WorkerError*>(&e);
    if (worker == nullptr || !worker->saidAbove()) {
      std::fprintf(stderr, "%scaravan: error: %s\n", clearLine, e.what());
    }
    return e.exitCode();
  } catch (const std::bad_alloc&) {
    return outOfMemory(clearLine, "");
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    // LibTorch's CPU allocator: "DefaultCPUAllocator: not enough memory: you tried to ...".
    if (what.find("DefaultCPUAllocator") != std::string::npos) {
      return outOfMemory(clearLine, what.substr(what.find("DefaultCPUAllocator")));
    }
    std::fprintf(stderr, "%scaravan: internal error (LibTorch): %s\n", clearLine, what.c_str());
    return static_cast<int>(ExitCode::kInternal);
  } catch (const std::filesystem::filesystem_error& e) {
    // A path that cannot be looked at (a symlink loop, a directory without permission): the
    // path and the system's reason, as an I/O error.
    std::fprintf(stderr, "%scaravan: error: %s: %s\n", clearLine, e.path1().c_str(),
                 e.code().message().c_str());
    return static_cast<int>(ExitCode::kIo);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%scaravan: internal error: %s\n", clearLine, e.what());
    return static_cast<int>(ExitCode::kInternal);
  }
}

}  // namespace

int main(int argc, char** argv) {
  // A write past the file-size limit (ulimit -f) fails with EFBIG, which the writers report in
  // one line and clean up after, rather than killing the process with SIGXFSZ.
  std::signal(SIGXFSZ, SIG_IGN);
  // Gloo writes to its sockets with writev: a peer that died would kill this rank with SIGPIPE
  // (no message, no exit code) instead of the EPIPE that becomes a PeerError naming the peer.
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{
      "caravan: train deep networks on one process, data-parallel across processes and hosts "
      "(all-reduce, local SGD, DiLoCo, gossip, parameter servers, OSP), pipeline-parallel "
      "across stages (GPipe, 1F1B, ZB-H1) and beyond memory (per-block keep/recompute/swap, "
      "out-of-core weights).\nExit codes: 0 ok, 1 internal error, 2 bad "
      "usage or config, 3 dataset, 4 checkpoint, 5 file system, 6 non-finite loss, 7 lost peer, "
      "8 a worker process failed, 9 out of memory, 130 interrupted."};
  app.require_subcommand(1);
  // The LibTorch this binary runs on: a model saved by a newer torch may not load on it.
  app.set_version_flag("--version",
                       fmt::format("caravan {} (LibTorch {}.{}.{})", CARAVAN_VERSION,
                                   TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH));
  Commands commands;
  addCommands(app, commands);
  if (const std::optional<int> code = rejectUnknownCommand(app, argc, argv)) return *code;
  if (const std::optional<int> code = parseCommandLine(app, argc, argv)) return *code;

  // A failure is reported on a line of its own, even if a progress bar was being drawn.
  const char* clearLine = isatty(STDERR_FILENO) ? "\r\x1b[K" : "";
  try {
    return runCommand(argc, argv, commands);
  } catch (...) {
    return reportFailure(clearLine);
  }
}
