// Regular files only, opened without blocking (see files.h).
#include "core/files.h"

#include <cerrno>
#include <cstring>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/scope_guard.h"

namespace caravan {

int openRegularFile(const std::string& path, std::string* why, bool allowDevices) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    *why = errno == ENOENT ? "does not exist" : std::strerror(errno);
    return -1;
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || (allowDevices && S_ISCHR(st.st_mode)))) {
    *why =
        S_ISDIR(st.st_mode) ? "is a directory" : "is not a regular file (a FIFO, socket or device)";
    ::close(fd);
    return -1;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    *why = std::strerror(errno);
    ::close(fd);
    return -1;
  }
  return fd;
}

std::optional<std::string> readRegularFile(const std::string& path, std::string* why,
                                           bool allowDevices, size_t maxBytes) {
  const int fd = openRegularFile(path, why, allowDevices);
  if (fd < 0) return std::nullopt;
  const auto closeFd = onScopeExit([fd] { ::close(fd); });
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n == 0) return out;
    if (n < 0) {
      if (errno == EINTR) continue;
      *why = std::strerror(errno);
      return std::nullopt;
    }
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > maxBytes) {
      *why = "is larger than " + std::to_string(maxBytes) + " bytes";
      return std::nullopt;
    }
  }
}

OwnedFd::~OwnedFd() {
  if (fd_ >= 0) ::close(fd_);
}

bool preadFully(int fd, void* buffer, size_t bytes, int64_t offset) {
  auto* at = static_cast<char*>(buffer);
  while (bytes > 0) {
    const ssize_t n = ::pread(fd, at, bytes, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += n;
    bytes -= static_cast<size_t>(n);
    offset += n;
  }
  return true;
}

}  // namespace caravan
