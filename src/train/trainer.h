// `caravan train` on this process: validates the config for the job, rendezvouses (a job),
// builds the run through RunSetup (run_setup.h) and runs the training loop: data -> the step
// engine RunSetup::attach returns (train/step_engine.h: forward, backward, the exchange between
// ranks, the update) -> metrics, with evaluation, progress, checkpoints and exact resume. The
// loop never asks which engine it drives. The loop's pieces (trainer.cpp): StopState (signals, the
// time limit, the per-step agreement between ranks), MetricsWindow (metrics_window.h) and the end
// of the run (final evaluation, checkpoint, model.pt, summary.json).
//
// Jobs (world size > 1): every rank runs this loop on its shard of each epoch (the engine keeps
// the replicas together); rank 0 alone writes the run directory and the terminal. Ranks agree every
// step on the reported loss and on stopping (signal, time limit), so they always leave the loop at
// the same step. A run directory holds: config.toml (the resolved config), metrics.jsonl,
// checkpoints/, model.pt (final weights for Python's torch.load) and summary.json. Threading: run()
// is called once, from one thread; the loader uses one background thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "comm/world.h"
#include "core/config.h"
#include "train/layout_setup.h"
#include "train/run_directory.h"

namespace caravan {

struct TrainerOptions {
  std::string runDir;                 // created if missing
  bool resume = false;                // continue from the newest checkpoint in runDir
  int64_t stopAtStep = 0;             // >0: stop after this step with a checkpoint, as if
                                      // interrupted (for splitting runs; used by tests)
  const std::atomic<bool>* stopRequested = nullptr;  // set by a signal handler: checkpoint, stop
  std::FILE* terminal = stderr;       // progress and summary
  bool tty = false;                   // draw a progress bar instead of periodic lines
  bool quiet = false;                 // print nothing (metrics are still written)
  WorldInfo world;                    // this process's rank; a world > 1 trains data-parallel
  std::string tracePath;              // non-empty: write a Chrome-trace timeline here
  LayoutChooser chooseLayout;         // parallel.layout = auto's search (the CLI's; empty: refused)
};

struct TrainSummary {
  int64_t steps = 0;
  int64_t epochs = 0;
  double finalTrainLoss = 0.0;
  double evalLoss = 0.0;
  double evalAccuracy = 0.0;
  double trainSeconds = 0.0;
  double samplesPerSecond = 0.0;
  bool stoppedEarly = false;  // stopAtStep or a stop request: resume to continue
  std::string lastCheckpoint;
};

// Runs training. Throws Error subclasses for user-facing problems (exit codes in errors.h).
TrainSummary train(const Config& config, const TrainerOptions& options);

}  // namespace caravan
