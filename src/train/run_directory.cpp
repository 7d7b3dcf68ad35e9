// Claiming a run directory (see run_directory.h).
#include "train/run_directory.h"

#include <unistd.h>

#include <filesystem>

#include <fmt/format.h>

#include "core/errors.h"
#include "train/checkpoint.h"

namespace caravan {
namespace fs = std::filesystem;

std::optional<std::string> checkRunDirectory(const std::string& runDir, bool resume) {
  const CheckpointDir checkpoints(runDir, 1);
  const std::optional<std::string> latest = checkpoints.latest();
  // A run that stopped before its first checkpoint can be neither continued nor overwritten:
  // both messages say so, and the same way out.
  const bool startedWithoutCheckpoint = !latest && fs::exists(fs::path(runDir) / "metrics.jsonl");
  // A run that another process is running (it holds the directory's lock; not this process,
  // nor its launcher) is never to be removed: say that a job runs there. A rank of a job
  // that holds no lock of its own (rank > 0) meets this when it joins a live run.
  if (resume ? startedWithoutCheckpoint : (startedWithoutCheckpoint || latest)) {
    const std::optional<pid_t> holder = directoryLockHolder(runDir);
    if (holder && *holder != ::getpid() && *holder != ::getppid()) {
      throw ConfigError(fmt::format(
          "{} is in use by process {}: a job is running in it (if this process was to join "
          "it, its rank is taken: give each process its own rank); wait for it to end, or "
          "choose another --run-dir",
          runDir, *holder));
    }
  }
  if (resume) {
    if (startedWithoutCheckpoint) {
      throw CheckpointError(fmt::format(
          "nothing to resume in {}: its run stopped before its first checkpoint (set "
          "checkpoint.every for earlier ones); start it again with another --run-dir, or "
          "remove {} once no job runs in it",
          runDir, runDir));
    }
    if (!latest) {
      throw CheckpointError(
          fmt::format("nothing to resume in {}: it has no checkpoints/ "
                      "(start a new run with another --run-dir)",
                      runDir));
    }
    return latest;
  }
  if (startedWithoutCheckpoint) {
    throw ConfigError(
        fmt::format("{} already holds a run, which stopped before its first "
                    "checkpoint: there is nothing to --resume; start it again with "
                    "another --run-dir, or remove {} once no job runs in it",
                    runDir, runDir));
  }
  if (latest) {
    throw ConfigError(
        fmt::format("{} already holds a run; continue it with --resume {} or "
                    "choose another --run-dir",
                    runDir, runDir));
  }
  // A new run writes config.toml, model.pt, ... into its directory: one that holds anything
  // else is someone's (a symbolic link to /, a directory of the user's files), not a run's.
  // What a refused start leaves (workers' logs, the file store) does not count.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(runDir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool leftByARefusedStart =
        name == "rendezvous" || (name.rfind("rank-", 0) == 0 && entry.path().extension() == ".log");
    if (!leftByARefusedStart) {
      throw ConfigError(
          fmt::format("{} is not empty ({} and maybe more) and holds no run; a new "
                      "run needs a new or empty --run-dir",
                      runDir, name));
    }
  }
  return std::nullopt;
}

std::unique_ptr<DirectoryLock> lockRunDirectory(const std::string& runDir,
                                                std::optional<pid_t> launcher) {
  auto lock = std::make_unique<DirectoryLock>(runDir);
  if (!lock->held() && launcher && lock->holder() == launcher) return nullptr;  // it holds it
  if (!lock->held()) {
    const std::string who =
        lock->holder() ? fmt::format("process {}", *lock->holder()) : "another process";
    throw ConfigError(
        fmt::format("{} is in use by {} (a caravan train on it is still running); "
                    "wait for it to end or stop it, or choose another --run-dir",
                    runDir, who));
  }
  return lock;
}

RunDirectoryClaim claimRunDirectory(const std::string& runDir, bool resume, bool lock,
                                    std::optional<pid_t> launcher) {
  RunDirectoryClaim claim;
  if (!resume || fs::is_directory(runDir)) {
    std::error_code ec;
    fs::create_directories(runDir, ec);
    if (ec) throw IoError(fmt::format("cannot create run directory {}: {}", runDir, ec.message()));
    if (lock) {
      claim.lock = lockRunDirectory(runDir, launcher);
      if (claim.lock) CheckpointDir(runDir, 1).removeStaleTemporaries();
    }
  }
  claim.resumeFrom = checkRunDirectory(runDir, resume);
  return claim;
}

}  // namespace caravan
