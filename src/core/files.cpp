// Regular files only, opened without blocking; files written atomically (see files.h).
#include "core/files.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "core/errors.h"
#include "core/scope_guard.h"

namespace caravan {

namespace fs = std::filesystem;

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

void writeAll(int fd, const char* data, size_t size, const std::string& path) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::write(fd, data + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw IoError(fmt::format("cannot write {}: {} (free disk space and retry)", path,
                                std::strerror(errno)));
    }
    done += static_cast<size_t>(n);
  }
}

void writeFileAtomic(const std::string& path, const std::string& bytes) {
  writeFileAtomic(
      path, [&](int fd, const std::string& tmp) { writeAll(fd, bytes.data(), bytes.size(), tmp); });
}

void writeFileAtomic(const std::string& path,
                     const std::function<void(int fd, const std::string& tmp)>& fill) {
  fs::path target(path);
  fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::string tmpl = (dir / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  int fd = ::mkstemp(name.data());
  if (fd < 0) {
    throw IoError(
        fmt::format("cannot create a file in {}: {} (check the directory exists and "
                    "is writable)",
                    dir.string(), std::strerror(errno)));
  }
  std::string tmp(name.data());
  try {
    fill(fd, tmp);
    if (::fsync(fd) != 0) {
      throw IoError(fmt::format("cannot sync {}: {}", tmp, std::strerror(errno)));
    }
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw IoError(fmt::format("cannot rename {} to {}: {}", tmp, path, std::strerror(err)));
  }
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

}  // namespace caravan
