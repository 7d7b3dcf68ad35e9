// DirectoryLock: an exclusive advisory lock (flock) on a directory itself, held for the
// object's life. Nothing is written into the directory: a refused process finds the holder's
// pid in /proc/locks (by the directory's device and inode).
//
// The kernel releases the lock when the holder's descriptor closes, so a holder that is killed
// (even with SIGKILL) leaves nothing locked. The descriptor is close-on-exec: processes the
// holder starts do not hold the lock.
//
// Errors: a directory that cannot be opened -> IoError.
// Threading: one object per process and directory; not for locking between threads.
#pragma once

#include <optional>
#include <string>

#include <sys/types.h>

namespace caravan {

class DirectoryLock {
 public:
  // Takes the lock without waiting. held() says whether it was taken; if not, holder() is the
  // holding process (nullopt when /proc/locks does not say).
  explicit DirectoryLock(std::string path);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

  bool held() const { return held_; }
  std::optional<pid_t> holder() const { return holder_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  bool held_ = false;
  std::optional<pid_t> holder_;
};

// The process that holds the lock on the directory `path` (a DirectoryLock in it), read from
// /proc/locks without taking the lock; nullopt when no process does (or /proc/locks does not
// say).
std::optional<pid_t> directoryLockHolder(const std::string& path);

}  // namespace caravan
