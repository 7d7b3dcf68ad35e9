// makeStore: StoreOptions -> TcpStore or c10d::FileStore (see store.h).
#include "comm/store.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/comm_util.h"
#include "comm/communicator.h"
#include "comm/shm_channels.h"
#include "comm/shm_communicator.h"
#include "comm/tcp_store.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/scope_guard.h"

namespace caravan {
namespace {

// An existing file at a file store's path must be one: c10d's FileStore is a log of
// length-prefixed strings (a uint32 length, then the bytes), and on anything else it reads a
// garbage length and spins. Empty is a store no rank wrote yet. Read under a shared flock, as
// the writers append under an exclusive one.
void checkStoreFile(const std::string& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (ec || status.type() == std::filesystem::file_type::not_found) return;
  if (status.type() == std::filesystem::file_type::directory) {
    throw ConfigError(
        fmt::format("dist.store_path {} is a directory; name a file in it (a fresh "
                    "one per job)",
                    path));
  }
  const auto notAStore = [&](const std::string& why) {
    return ConfigError(
        fmt::format("dist.store_path {} {}, not a rendezvous store file; name a "
                    "fresh file per job",
                    path, why));
  };
  std::string why;
  const int fd = openRegularFile(path, &why);
  if (fd < 0) throw notAStore(why);
  const auto closeFd = onScopeExit([fd] { ::close(fd); });
  ::flock(fd, LOCK_SH);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw notAStore(std::strerror(errno));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint64_t at = 0;
  while (at < size) {
    uint32_t length = 0;
    if (size - at < sizeof(length) ||
        ::pread(fd, &length, sizeof(length), static_cast<off_t>(at)) !=
            static_cast<ssize_t>(sizeof(length)) ||
        length > size - at - sizeof(length)) {
      throw notAStore(fmt::format("holds something else (byte {} of {})", at, size));
    }
    at += sizeof(length) + length;
  }
}

}  // namespace

c10::intrusive_ptr<c10d::Store> makeStore(const WorldInfo& world, const StoreOptions& options) {
  if (options.timeout.count() <= 0) {
    throw ConfigError(fmt::format("store timeout must be positive, got {} ms",
                                  options.timeout.count()));
  }
  if (options.kind == "tcp") {
    TcpStoreOptions o;
    o.host = world.masterAddr;
    o.port = world.masterPort;
    o.isServer = world.rank == 0;
    o.listenFd = world.storeFd;
    o.timeout = options.timeout;
    o.connectTimeout = options.connectTimeout;
    o.token = options.token;
    return c10::make_intrusive<TcpStore>(o);
  }
  if (options.kind == "file") {
    if (options.filePath.empty()) {
      throw ConfigError("store kind \"file\" needs a file path on a file system every rank sees");
    }
    const auto dir = std::filesystem::path(options.filePath).parent_path();
    std::error_code ec;
    if (!dir.empty() && !std::filesystem::is_directory(dir, ec)) {
      throw ConfigError(fmt::format("store file {}: directory {} does not exist; create it on a "
                                    "file system every rank sees",
                                    options.filePath, dir.string()));
    }
    checkStoreFile(options.filePath);
    // c10d opens the file at each operation: one it cannot write failed inside the first one.
    if (const int fd =
            ::open(options.filePath.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
        fd >= 0) {
      ::close(fd);
    } else {
      throw ConfigError(
          fmt::format("the store file {} cannot be written ({}); name a file on a "
                      "writable file system every rank sees",
                      options.filePath, std::strerror(errno)));
    }
    try {
      // Under a start's prefix the file is shared with other starts: no rank may remove it
      // (c10d removes it when `numWorkers` ranks have closed it, counted over every start).
      auto file = c10::make_intrusive<c10d::FileStore>(options.filePath,
                                                       world.start.empty() ? world.worldSize : -1);
      file->setTimeout(options.timeout);
      if (world.start.empty()) return file;
      return c10::make_intrusive<c10d::PrefixStore>("start/" + world.start, std::move(file));
    } catch (const std::exception& e) {
      throw IoError(fmt::format("cannot open the store file {}: {}", options.filePath,
                                comm::errorLine(e)));
    }
  }
  throw ConfigError(fmt::format("unknown store kind \"{}\"; use \"tcp\" or \"file\"",
                                options.kind));
}

// Every rank's `key(r)` is in the store within `timeout`; otherwise PeerError naming the ranks
// whose key is missing: "rank R: K of N ranks <done> within T; rank M did not (...)".
void claimRank(c10d::Store& store, int rank, int size) {
  const std::string key = fmt::format("claim/{}", rank);
  // Who claimed it: this host's identity and the claimant's pid.
  const std::string host = hostIdentity();  // reads /proc: once
  const std::string me = fmt::format("{}\n{}", host, static_cast<long>(::getpid()));
  if (store.add(key, 1) == 1) {
    store.set(key + "/by", std::vector<uint8_t>(me.begin(), me.end()));
    return;
  }
  std::string by;
  try {
    if (store.check({key + "/by"})) {
      const std::vector<uint8_t> v = store.get(key + "/by");
      by.assign(v.begin(), v.end());
    }
  } catch (const std::exception&) {
    by.clear();  // not known: say it is taken
  }
  const size_t newline = by.rfind('\n');
  const long pid = newline == std::string::npos ? 0 : std::atol(by.c_str() + newline + 1);
  if (newline != std::string::npos && by.substr(0, newline) == host && pid > 0 &&
      comm::processExited(pid)) {
    throw ConfigError(fmt::format(
        "rank {} of {}: the rendezvous store holds an earlier job's keys (rank {} was claimed by "
        "process {} on this host, which has ended); start with a fresh store: remove its file "
        "(dist.store_path, or RUN_DIR/rendezvous) or name a new one per job",
        rank, size, rank, pid));
  }
  throw ConfigError(fmt::format(
      "rank {} of {} is taken: another process joined this job as rank {} first; give each "
      "process its own rank (RANK, SLURM_PROCID or OMPI_COMM_WORLD_RANK) and the world "
      "size, or use a fresh store",
      rank, size, rank));
}

void waitForRanks(c10d::Store& store, int rank, int size,
                  const std::function<std::string(int)>& key, std::chrono::milliseconds timeout,
                  const std::string& done, const std::string& what) {
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  try {
    store.wait(keys, timeout);
  } catch (const std::exception& e) {
    std::vector<int> missing;
    try {
      for (int r = 0; r < size; ++r) {
        if (!store.check({key(r)})) missing.push_back(r);
      }
    } catch (const std::exception&) {
      missing.clear();  // the store itself is gone: say that instead
    }
    if (missing.empty()) {
      throw PeerError(fmt::format("rank {}: {} failed: {}", rank, what, comm::errorLine(e)));
    }
    throw PeerError(
        fmt::format("rank {}: {} of {} ranks {} within {}; {} did not (start every rank with the "
                    "same world size and store, check the missing ranks' logs, or raise "
                    "fault.rendezvous_timeout)",
                    rank, size - static_cast<int>(missing.size()), size, done,
                    comm::formatDuration(timeout), comm::formatRanks(missing)));
  }
}

}  // namespace caravan
