// A run directory claimed for a job: checked (a new run's must be new or empty, a --resume's
// must hold a checkpoint), locked by whoever starts the job (core/directory_lock.h), and cleared
// of a killed writer's temporaries. The launcher (`caravan train --workers`) and train() claim it
// in the same order.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>

#include "core/directory_lock.h"

namespace caravan {

// The checkpoint to continue from (`resume`: the newest, CheckpointError when there is none),
// or nothing for a new run (ConfigError when the directory already holds a run). The
// launcher checks before it starts workers; train() checks again.
std::optional<std::string> checkRunDirectory(const std::string& runDir, bool resume);

// Claims the existing directory `runDir` for this process's job: locks the directory itself
// (core/directory_lock.h; nothing is written into it) or throws ConfigError naming the process
// that holds it. Whoever starts the job holds it for the run's life: the `--workers`
// launcher, else rank 0 (train() does it for every launcher but caravan's own). A killed
// holder releases it.
// `launcher`: a process whose hold counts as ours (Caravan's launcher, for its workers; then
// nullptr is returned).
std::unique_ptr<DirectoryLock> lockRunDirectory(const std::string& runDir,
                                                std::optional<pid_t> launcher = std::nullopt);

// `runDir` claimed for a job, in the one order the launcher and train() both need: a new run's
// directory is created (a --resume's must exist), locked when `lock` (by whoever starts the
// job), cleared of checkpoint temporaries a killed writer left (every writer holds the lock,
// so with it held they are stale), then checked (checkRunDirectory). Hold `lock` for the
// run's life.
struct RunDirectoryClaim {
  std::unique_ptr<DirectoryLock> lock;
  std::optional<std::string> resumeFrom;  // the checkpoint to continue from (--resume)
};
RunDirectoryClaim claimRunDirectory(const std::string& runDir, bool resume, bool lock,
                                    std::optional<pid_t> launcher = std::nullopt);

}  // namespace caravan
