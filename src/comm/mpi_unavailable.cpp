// The MPI backend's entry points in a build without MPI (CARAVAN_WITH_MPI=OFF).
#include "comm/mpi_communicator.h"

namespace caravan {

bool mpiBackendAvailable() { return false; }

void finalizeMpi() {}

std::unique_ptr<Communicator> makeMpiCommunicator(const MpiOptions&) {
  throw ConfigError("this build has no MPI backend; install libopenmpi-dev and rebuild");
}

}  // namespace caravan
