// The MPI backend: a Communicator directly on MPI (Open MPI), for jobs started by mpirun or
// srun. LibTorch's ProcessGroupMPI is not in Debian's build, so this talks to MPI itself.
//
// Rank and size come from MPI (MPI_COMM_WORLD, duplicated per communicator), not from a store.
// Every operation is nonblocking (MPI_Iallreduce, MPI_Ibcast, MPI_Iallgather,
// MPI_Ireduce_scatter_block, MPI_Isend/MPI_Irecv, MPI_Ibarrier); Work::wait polls MPI_Test
// (which also drives MPI's progress) until the timeout, then throws PeerError. A timed-out
// recv is cancelled; MPI cannot cancel a collective, so after any other timeout the process
// must exit. After any PeerError, exit skips MPI_Finalize (it synchronizes with every
// process and would wait for a hung peer); the launcher then ends the other processes.
//
// MPI has no bfloat16: reductions run on a float32 copy and round back once (like the Gloo
// backend); broadcast, allgather and send/recv move bfloat16 as 16-bit words, bit for bit.
// AVG is SUM then a division by size(). Zero-element operations complete at issue.
//
// MPI is process-wide: the first communicator initializes it with MPI_THREAD_MULTIPLE
// (autograd may issue from its own thread); should the library give less, every MPI call of
// this backend is serialized by one mutex. MPI_Finalize runs at process exit, or earlier
// through finalizeMpi().
//
// Threading: as communicator.h; wait() and isCompleted() may run on any thread.
#pragma once

#include <chrono>
#include <memory>

#include "comm/communicator.h"

namespace caravan {

struct MpiOptions {
  std::chrono::milliseconds timeout = kDefaultCommTimeout;  // default for waits
};

// True when this build has the MPI backend (CMake option CARAVAN_WITH_MPI).
bool mpiBackendAvailable();

// A communicator over every process of the MPI job. Collective over the job: all processes
// call it in the same order. Throws ConfigError when this build has no MPI backend.
std::unique_ptr<Communicator> makeMpiCommunicator(const MpiOptions& options);

// Ends MPI now, if this backend initialized it: collective, every process calls it, after its
// communicators are gone. For a program that wants a clean MPI shutdown even after a PeerError
// it recovered from (the tests); otherwise exit does it. No-op without MPI.
void finalizeMpi();

}  // namespace caravan
