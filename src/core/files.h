// Reading files that come from the user (datasets, configs, checkpoints) without blocking on
// what is not a regular file: open(2) of a FIFO waits for a writer forever, a device may never
// end. openRegularFile opens non-blocking, checks what it opened, and only then hands back a
// normal (blocking, close-on-exec) descriptor.
// Writing files atomically (writeFileAtomic: checkpoints, run files, reports): a temporary
// file in the same directory, fsync, rename, fsync of the directory.
//
// The readers return errors, not throw them: each caller says what the file is for in its own
// error. The writers throw IoError.
// Threading: free functions; any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace caravan {

// The descriptor of the regular file at `path` (or, with `allowDevices`, a character device
// such as /dev/null), or -1 with `why` saying what is wrong ("does not exist", "is a
// directory", "is not a regular file (a FIFO, socket or device)", or the system's reason).
int openRegularFile(const std::string& path, std::string* why, bool allowDevices = false);

// The whole file at `path` (as openRegularFile), at most `maxBytes`; or nullopt with `why`
// (also "is larger than N bytes" and read errors).
std::optional<std::string> readRegularFile(const std::string& path, std::string* why,
                                           bool allowDevices = false,
                                           size_t maxBytes = size_t{1} << 30);

// An open descriptor, closed when its owner goes; share it with std::shared_ptr<const OwnedFd>
// (pread needs no lock: datasets read it from the loader thread and the trainer's).
class OwnedFd {
 public:
  explicit OwnedFd(int fd) : fd_(fd) {}
  ~OwnedFd();
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// Reads exactly `bytes` at `offset` (retrying short reads and EINTR); false on an error or
// the end of the file first.
bool preadFully(int fd, void* buffer, size_t bytes, int64_t offset);

// Writes all `size` bytes of `data` to `fd` (retrying short writes and EINTR). Throws IoError
// naming `path` on a failed write.
void writeAll(int fd, const char* data, size_t size, const std::string& path);

// Writes `bytes` to `path` atomically (tmp + fsync + rename + fsync dir). Throws IoError.
void writeFileAtomic(const std::string& path, const std::string& bytes);
// The same, with the bytes written by `fill` into the open temporary file `tmp` (fd); fill
// throws IoError on a failed write.
void writeFileAtomic(const std::string& path,
                     const std::function<void(int fd, const std::string& tmp)>& fill);

}  // namespace caravan
