// The local launcher and supervisor behind `caravan train --config F --workers N`.
//
// The `caravan` process becomes a supervisor: it picks a free loopback port, starts N copies
// of its own executable (/proc/self/exe) with the same arguments minus `--workers` and the
// environment of cli/launch.h (RANK, WORLD_SIZE, MASTER_ADDR/PORT, CARAVAN_LAUNCHER=caravan),
// and waits for them. Rank 0 keeps the terminal; rank r > 0 runs with --quiet and its stdout
// and stderr appended to RUN_DIR/rank-<r>.log.
//
// Failure: when a worker exits non-zero or is killed, the others get SIGTERM (they write a
// checkpoint and stop), SIGKILL after `stopGrace`, and superviseWorkers throws WorkerError
// naming the first failed rank. Interruption: SIGINT, SIGTERM or SIGHUP to the supervisor is
// forwarded to every worker as SIGTERM (workers stop at a checkpoint and exit 130; SIGTERM and
// not SIGINT because a Ctrl-C on the terminal already reached every worker of the foreground
// process group, and a worker treats a second SIGINT as "stop now"); a second interrupt sends
// SIGKILL. Workers get PR_SET_PDEATHSIG(SIGTERM), so none outlives a supervisor that died.
//
// Threading: call superviseWorkers once, from the main thread of a process that has no other
// children and no other threads that fork; it blocks SIGINT, SIGTERM, SIGHUP and SIGCHLD in
// the calling thread while it runs (restored on return) and waits for them with sigtimedwait.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace caravan {

// How long stopped workers get to checkpoint and exit before SIGKILL.
constexpr std::chrono::milliseconds kStopGrace{10'000};      // after another worker failed
constexpr std::chrono::milliseconds kInterruptGrace{60'000}; // after an interrupt (a second
                                                             // interrupt kills at once)
// How long to wait for the kernel to report workers killed with SIGKILL before giving up.
constexpr std::chrono::milliseconds kReapGrace{5'000};

struct LaunchOptions {
  int workers = 1;
  std::string program = "caravan";  // argv[0] for the workers
  std::vector<std::string> args;    // this process's argv[1..] (contains --workers)
  std::string runDir;             // the run directory every rank uses
  bool addRunDir = false;         // pass --run-dir runDir: it was not on the command line
  bool threadsConfigured = false; // train.threads > 0: leave OMP/OpenBLAS variables alone
  std::chrono::milliseconds stopGrace = kStopGrace;
  std::chrono::milliseconds interruptGrace = kInterruptGrace;
};

// Runs the workers to the end. Returns 0 when every worker exited 0, 130 (kInterrupted) when
// the supervisor was interrupted; throws WorkerError (kWorkerFailed) when a worker failed and
// IoError when the run directory, a log file, the port or a process cannot be created (workers
// already started are stopped first). Never returns while a worker it started still runs,
// except when a SIGKILLed worker is not reaped within kReapGrace.
int superviseWorkers(const LaunchOptions& options);

}  // namespace caravan
