// makeCommunicator (see factory.h).
#include "comm/factory.h"

#include <cstdlib>

#include <fmt/format.h>

#include "comm/gloo_communicator.h"
#include "comm/mpi_communicator.h"
#include "core/errors.h"

namespace caravan {

bool isLoopbackAddress(const std::string& address) {
  return address == "localhost" || address == "::1" || address.rfind("127.", 0) == 0;
}

std::unique_ptr<Communicator> makeCommunicator(const std::string& backend,
                                               const WorldInfo& world,
                                               c10::intrusive_ptr<c10d::Store> store,
                                               std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) {
    throw ConfigError(fmt::format("communication timeout must be positive, got {} ms",
                                  timeout.count()));
  }
  if (backend == "gloo") {
    CARAVAN_CHECK(store, "the gloo backend needs a rendezvous store");
    GlooOptions options;
    options.timeout = timeout;
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname != nullptr && *ifname) {
      options.interface = ifname;
    } else if (isLoopbackAddress(world.masterAddr)) {
      options.hostname = world.masterAddr == "::1" ? "::1" : "127.0.0.1";
    }
    return std::make_unique<GlooCommunicator>(std::move(store), world.rank, world.worldSize,
                                              options);
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
  throw ConfigError(fmt::format("unknown communication backend \"{}\"; use \"gloo\" or \"mpi\"",
                                backend));
}

}  // namespace caravan
