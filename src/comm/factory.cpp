// makeCommunicator (see factory.h).
#include "comm/factory.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdlib>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/comm_util.h"
#include "comm/gloo_communicator.h"
#include "comm/hierarchical_communicator.h"
#include "comm/mpi_communicator.h"
#include "comm/shm_communicator.h"
#include "core/errors.h"
#include "core/log.h"

namespace caravan {

bool isLoopbackAddress(const std::string& address) {
  return address == "localhost" || address == "::1" || address.rfind("127.", 0) == 0;
}

std::string localAddressToward(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) {
    return "";
  }
  std::string out;
  for (addrinfo* a = found; a != nullptr && out.empty(); a = a->ai_next) {
    // Connecting a UDP socket sends nothing: it only asks the kernel for a route.
    const int fd = ::socket(a->ai_family, SOCK_DGRAM, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    char text[INET6_ADDRSTRLEN] = {0};
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        ::getnameinfo(reinterpret_cast<sockaddr*>(&local), len, text, sizeof(text), nullptr, 0,
                      NI_NUMERICHOST) == 0) {
      out = text;
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return out;
}

std::unique_ptr<Communicator> makeCommunicator(const std::string& backend, const WorldInfo& world,
                                               c10::intrusive_ptr<c10d::Store> store,
                                               std::chrono::milliseconds timeout,
                                               std::chrono::milliseconds joinTimeout,
                                               int connections) {
  if (timeout.count() <= 0) {
    throw ConfigError(fmt::format("communication timeout must be positive, got {} ms",
                                  timeout.count()));
  }
  if (connections < 1) {
    throw ConfigError(fmt::format("dist.connections must be at least 1, got {}", connections));
  }
  if (backend == "gloo") {
    CARAVAN_CHECK(store, "the gloo backend needs a rendezvous store");
    GlooOptions options;
    options.timeout = timeout;
    options.joinTimeout = joinTimeout;
    options.connections = connections;
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname) {
      options.interface = ifname;
    } else if (isLoopbackAddress(world.masterAddr)) {
      options.hostname = world.masterAddr == "::1" ? "::1" : "127.0.0.1";
    } else {
      // The address this host reaches the master from, which the other hosts can reach too
      // (this host's name may resolve to a loopback address, as on Debian's default hosts).
      options.hostname = localAddressToward(world.masterAddr, world.masterPort);
    }
    return std::make_unique<GlooCommunicator>(std::move(store), world.rank, world.worldSize,
                                              options);
  }
  if (backend == "shm" || backend == "auto") {
    CARAVAN_CHECK(store, "the {} backend needs a rendezvous store", backend);
    // Its own keys, so that it can share a store with another communicator of the same ranks.
    auto own = c10::make_intrusive<c10d::PrefixStore>("caravan/shm", store);
    const std::vector<std::string> hosts = exchangeHostIdentities(
        *own, world.rank, world.worldSize, joinTimeout.count() > 0 ? joinTimeout : timeout);
    std::vector<int> elsewhere;
    for (int r = 0; r < world.worldSize; ++r) {
      if (hosts[r] != hosts[0]) elsewhere.push_back(r);
    }
    if (!elsewhere.empty() && backend == "shm") {
      throw ConfigError(fmt::format(
          "dist.backend = shm needs every rank on one host, but {} run{} on another host than "
          "rank 0 (or in another network namespace); use dist.backend = auto or gloo",
          comm::formatRanks(elsewhere), elsewhere.size() == 1 ? "s" : ""));
    }
    // One rank alone: Gloo as a gloo job would make it (same keys).
    if (backend == "auto" && world.worldSize == 1) {
      return makeCommunicator("gloo", world, std::move(store), timeout, joinTimeout, connections);
    }
    ShmOptions options;
    options.timeout = timeout;
    options.joinTimeout = joinTimeout;
    options.token = world.token;
    // What /dev/shm cannot hold, said with the ways out.
    const auto noSegment = [&](const ShmUnavailable& e) {
      return ShmUnavailable(
          fmt::format("dist.backend = {}: {}; make /dev/shm writable with room, "
                      "or use dist.backend = {}",
                      backend, e.what(), backend == "shm" ? "auto or gloo" : "gloo"));
    };
    if (!elsewhere.empty()) {
      // Several hosts: shared memory inside each, Gloo among one leader per host, and Gloo of
      // every rank (with a gloo job's keys) for the rest (hierarchical_communicator.h). A host
      // whose /dev/shm cannot hold its segment stops the job (no fallback across hosts yet).
      std::shared_ptr<Communicator> flat =
          makeCommunicator("gloo", world, store, timeout, joinTimeout, connections);
      try {
        return makeHierarchical(hosts, world.rank, std::move(flat), own, options,
                                [&](c10::intrusive_ptr<c10d::Store> leaders, int rank, int size) {
                                  WorldInfo among = world;
                                  among.rank = rank;
                                  among.worldSize = size;
                                  return makeCommunicator("gloo", among, std::move(leaders),
                                                          timeout, joinTimeout, connections);
                                });
      } catch (const ShmUnavailable& e) {
        throw noSegment(e);
      }
    }
    // One host: everything through shared memory, or (auto) Gloo when /dev/shm cannot hold
    // the segment; every rank learns that from rank 0 and falls back alike.
    try {
      return std::make_unique<ShmCommunicator>(own, world.rank, world.worldSize, options);
    } catch (const ShmUnavailable& e) {
      if (backend == "shm") throw noSegment(e);
      if (world.rank == 0) {
        logLine(
            fmt::format("dist.backend = auto: /dev/shm cannot hold the job's "
                        "segment ({}); using gloo instead",
                        e.what()));
      }
      return makeCommunicator("gloo", world, std::move(store), timeout, joinTimeout, connections);
    }
  }
  if (backend == "mpi") {
    MpiOptions options;
    options.timeout = timeout;
    auto comm = makeMpiCommunicator(options);
    if (world.launcher != "none" &&
        (comm->size() != world.worldSize || comm->rank() != world.rank)) {
      throw ConfigError(fmt::format(
          "backend mpi: MPI says rank {} of {}, but the {} launcher said rank {} of {}; start "
          "the job with mpirun -np N or srun so MPI and the launcher agree",
          comm->rank(), comm->size(), world.launcher, world.rank, world.worldSize));
    }
    return comm;
  }
  throw ConfigError(fmt::format(
      "unknown communication backend \"{}\"; use \"auto\", \"shm\", \"gloo\" or \"mpi\"", backend));
}

}  // namespace caravan
