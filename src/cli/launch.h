// The pure parts of caravan's local launcher (`caravan train --workers N`): each worker's
// environment and command line, the rank log paths, a free loopback port, and the supervisor's
// one-line report of a failed worker. Starting and supervising the processes is
// cli/launcher.cpp; everything here is a function of its arguments, so it is unit-tested
// directly (tests/test_launcher.cpp).
//
// Threading: free functions without shared state; any thread may call them.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

#include "comm/world.h"
#include "core/errors.h"

namespace caravan {

// A worker process of a local launch failed (non-zero exit or a signal). The message names the
// rank, its pid, how it ended and where its log is; the exit code and `saidAbove` are
// launcherExit's.
class WorkerError : public Error {
 public:
  explicit WorkerError(const std::string& m, ExitCode code = ExitCode::kWorkerFailed,
                       bool saidAbove = false)
      : Error(code, m), saidAbove_(saidAbove) {}
  bool saidAbove() const { return saidAbove_; }

 private:
  bool saidAbove_;
};

// How the supervisor ends when the worker `causeRank`, whose wait status is `cause`, stopped the
// job and rank 0 (which shares the supervisor's terminal) ended with `rank0`. When rank 0 exited
// with the cause's own error code (not a lost peer, not an interrupt), the job ends with that
// code, as one process would; and rank 0's line is the only one (`saidAbove`) when rank 0 is
// the cause or the code is a config refusal (every rank checks the same config), while a cause
// elsewhere keeps the supervisor's line pointing at its log. Otherwise kConfig when the cause
// refused the config or command (exit 2: a check only a worker makes, such as a pipeline's
// partition or a memory budget; a restart would be refused again), else kWorkerFailed.
struct LauncherExit {
  ExitCode code = ExitCode::kWorkerFailed;
  bool saidAbove = false;
};
LauncherExit launcherExit(int causeRank, int cause, int rank0);

constexpr const char* kLocalMasterAddr = "127.0.0.1";
constexpr const char* kCaravanLauncher = "caravan";  // CARAVAN_LAUNCHER's value for our workers

// `base` plus what a worker of a local launch needs: RANK, WORLD_SIZE, LOCAL_RANK (= RANK, one
// machine), MASTER_ADDR=127.0.0.1, MASTER_PORT, CARAVAN_LAUNCHER=caravan. Unless
// `threadsConfigured` (train.threads > 0), OMP_NUM_THREADS and OPENBLAS_NUM_THREADS are set to
// 1 where `base` does not set them already, so N workers do not each start one thread per
// core. RANK/WORLD_SIZE take precedence over other launchers' variables, so
// worldFromEnvironment() of the result is exactly this worker.
Environment workerEnvironment(const Environment& base, int rank, int worldSize, int masterPort,
                              bool threadsConfigured, const std::string& token);

// A new job token: 128 random bits (getrandom) as 32 hex digits.
std::string newJobToken();

// "KEY=VALUE" strings for execve().
std::vector<std::string> environmentStrings(const Environment& env);

// A worker's arguments (without argv[0]) from the supervisor's: `--workers N`, `--workers=N`
// and `--max-restarts K` removed; `--run-dir RUN_DIR` appended when `addRunDir` is non-empty (the
// supervisor chose the default run directory, so every rank must be told the same one);
// `--quiet` appended for ranks > 0 (only rank 0 draws on the terminal).
// The supervisor's arguments for a restart after a failure (--max-restarts): the same flags
// and --workers, with `--resume RUN_DIR` in place of --config/-c, --run-dir, --resume, --set
// (RUN_DIR/config.toml has them). --stop-at-step stays: the failure came before that step, and
// a restart without it ran on to train.max_steps.
std::vector<std::string> restartArguments(const std::vector<std::string>& supervisorArgs,
                                          const std::string& runDir);

std::vector<std::string> workerArguments(const std::vector<std::string>& supervisorArgs, int rank,
                                         const std::string& addRunDir);

// RUN_DIR/rank-<r>.log: where rank r > 0 writes its stdout and stderr.
std::string rankLogPath(const std::string& runDir, int rank);

// The rendezvous port of a local launch, held from the moment it is picked: a TCP socket
// listening on 127.0.0.1 at a port the kernel chose, close-on-exec. The supervisor keeps it for
// the whole start and hands it to rank 0 as CARAVAN_STORE_FD, whose store serves on it instead
// of binding MASTER_PORT: no other process can take the port in between (a port that was only
// free a moment ago was taken so by a job started at the same time, and both failed). The
// caller owns `fd`. Throws IoError when no socket can be bound.
struct LoopbackListener {
  int fd = -1;
  int port = 0;
};
LoopbackListener listenOnLoopback();

// How a waitpid() status ended: "exited with code 4", "was killed by signal 9 (SIGKILL)".
std::string describeExit(int waitStatus);

// The supervisor's one-line report of the first failed worker, e.g.
// "rank 2 (pid 1234) was killed by signal 9 (SIGKILL); stopped the other 3 ranks; see
// runs/x/rank-2.log". `stopped` is how many other ranks were still running and were stopped;
// rank 0 has no log (it writes to the terminal), so its hint points at the output above.
std::string workerFailureMessage(int rank, pid_t pid, int waitStatus, int stopped, int worldSize,
                                 const std::string& runDir);

}  // namespace caravan
