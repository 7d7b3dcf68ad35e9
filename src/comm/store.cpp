// makeStore: StoreOptions -> TcpStore or c10d::FileStore (see store.h).
#include "comm/store.h"

#include <filesystem>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/FileStore.hpp>

#include "comm/comm_util.h"
#include "comm/tcp_store.h"
#include "core/errors.h"

namespace caravan {

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
    try {
      auto store = c10::make_intrusive<c10d::FileStore>(options.filePath, world.worldSize);
      store->setTimeout(options.timeout);
      return store;
    } catch (const std::exception& e) {
      throw IoError(fmt::format("cannot open the store file {}: {}", options.filePath,
                                comm::errorLine(e)));
    }
  }
  throw ConfigError(fmt::format("unknown store kind \"{}\"; use \"tcp\" or \"file\"",
                                options.kind));
}

}  // namespace caravan
