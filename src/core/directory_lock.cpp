// DirectoryLock over flock(2), the holder read from /proc/locks (see directory_lock.h).
#include "core/directory_lock.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <fmt/format.h>

#include "core/errors.h"

namespace caravan {
namespace {

// The pid /proc/locks gives for a FLOCK lock on the file with `st`'s device and inode. Lines
// read "1: FLOCK  ADVISORY  WRITE 1234 fe:00:10953209 0 EOF" (major:minor in hex).
std::optional<pid_t> flockHolder(const struct stat& st) {
  const std::string id = fmt::format("{:02x}:{:02x}:{}", major(st.st_dev), minor(st.st_dev),
                                     static_cast<unsigned long>(st.st_ino));
  std::ifstream locks("/proc/locks");
  for (std::string line; std::getline(locks, line);) {
    std::istringstream in(line);
    std::string ordinal, type, mode, access, where;
    long pid = 0;
    if (!(in >> ordinal >> type >> mode >> access >> pid >> where)) continue;
    if (type == "FLOCK" && where == id && pid > 0) return static_cast<pid_t>(pid);
  }
  return std::nullopt;
}

}  // namespace

DirectoryLock::DirectoryLock(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd_ < 0) {
    throw IoError(
        fmt::format("cannot open the directory {} to lock it: {}", path_, std::strerror(errno)));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) {
    held_ = true;
    return;
  }
  const int err = errno;
  struct stat st {};
  const bool stated = ::fstat(fd_, &st) == 0;
  ::close(fd_);
  fd_ = -1;
  if (err != EWOULDBLOCK) {
    throw IoError(fmt::format("cannot lock the directory {}: {}", path_, std::strerror(err)));
  }
  if (stated) holder_ = flockHolder(st);
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

std::optional<pid_t> directoryLockHolder(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return flockHolder(st);
}

}  // namespace caravan
