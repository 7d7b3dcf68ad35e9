// makeCommunicator: the communicator a job's config names ("auto", "shm", "gloo" or "mpi") for
// this process.
//
// auto: shm when every rank runs on this host (the host identities the ranks publish in the
//       store agree, shm_communicator.h); on several hosts, hierarchical (shared memory inside
//       each host, Gloo between them, hierarchical_communicator.h); one rank alone: gloo.
// shm:  collectives and send/recv through shared memory; ConfigError naming the ranks on
//       another host when they are not all on one.
// gloo: rendezvous through `store` with the launcher's rank and world size; the Gloo endpoint
//       listens on the interface named by GLOO_SOCKET_IFNAME when set, else on the loopback
//       address when the master is local, else on this host's address on the route to the
//       master (not what the host name resolves to: Debian maps it to 127.0.1.1).
// mpi:  rank and size come from MPI (the store is not used); they must agree with what the
//       launcher said, else ConfigError. A build without MPI throws ConfigError saying so.
//
// `timeout` bounds every wait on a peer after the rendezvous; `joinTimeout` (zero: `timeout`)
// the rendezvous itself. `connections`: TCP connections per pair of ranks for Gloo's large
// all-reduces and broadcasts (striping, gloo_communicator.h; dist.connections).
// Threading: blocks the calling thread through the rendezvous (at most `joinTimeout`). Every rank
// calls it concurrently.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/communicator.h"
#include "comm/world.h"

namespace caravan {

std::unique_ptr<Communicator> makeCommunicator(const std::string& backend, const WorldInfo& world,
                                               c10::intrusive_ptr<c10d::Store> store,
                                               std::chrono::milliseconds timeout,
                                               std::chrono::milliseconds joinTimeout = {},
                                               int connections = 1);

// True for 127.0.0.0/8, ::1 and "localhost".
bool isLoopbackAddress(const std::string& address);
// This host's address on the route to host:port (numeric), "" when there is none. Sends
// nothing.
std::string localAddressToward(const std::string& host, int port);

}  // namespace caravan
