// The job's rendezvous store: a c10d::Store every rank reaches, used by the Gloo communicator
// to exchange addresses and by strategies for small shared state (keys, counters).
//
// kind "tcp":  rank 0 serves a TcpStore on the master address and port (loopback unless the
//              launcher says otherwise); other ranks connect to it, retrying until `timeout`.
// kind "file": a c10d::FileStore at `filePath` on a file system every rank sees (NFS, Lustre).
//              The file outlives its job: with WorldInfo::start (every start of `caravan train
//              --workers`) the start's keys live under "start/<start>/", apart from those an
//              earlier start or job left. Without it (other launchers) use a fresh path per
//              job: claimRank names a file left by a job whose processes have ended.
//
// Errors: an unreachable master -> PeerError naming address:port and what to check; a port
// rank 0 cannot bind, an unknown kind or a missing file path -> ConfigError.
//
// Threading: makeStore blocks (at most `connectTimeout` while connecting) on the calling thread.
// The returned store is thread-safe.
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/world.h"

namespace caravan {

inline constexpr std::chrono::milliseconds kDefaultStoreTimeout{30000};

struct StoreOptions {
  std::string kind = "tcp";  // tcp | file
  std::string filePath;      // kind "file" only
  std::chrono::milliseconds timeout = kDefaultStoreTimeout;  // requests, default waits
  // tcp, ranks other than 0: how long to retry reaching rank 0's store; zero: `timeout`.
  std::chrono::milliseconds connectTimeout{0};
  std::string token;  // tcp: every rank must present the same token (empty is a valid token)
};

c10::intrusive_ptr<c10d::Store> makeStore(const WorldInfo& world, const StoreOptions& options);

// Waits until every rank's `key(r)` is in `store`; otherwise PeerError: "rank R: K of N ranks
// <done> within T; rank M did not (...)", or "rank R: <what> failed: ..." when the store itself
// failed.
void waitForRanks(c10d::Store& store, int rank, int size,
                  const std::function<std::string(int)>& key, std::chrono::milliseconds timeout,
                  const std::string& done, const std::string& what = "rendezvous");

// Claims `rank` in `store` (a job's first rendezvous calls it): ConfigError naming the rank when
// another process claimed it first, before this one touches the job; when that process was on
// this host and has ended, the store is an earlier job's and the message says to use a fresh
// one.
void claimRank(c10d::Store& store, int rank, int size);

}  // namespace caravan
