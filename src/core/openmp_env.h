// OpenMP's idle workers. LibTorch's intra-op pool is libgomp's, which reads OMP_WAIT_POLICY and
// GOMP_SPINCOUNT once, as it loads (before main). Unset, an idle worker spins for 300000
// iterations (a few milliseconds) after each parallel region before it sleeps; PASSIVE, it
// sleeps at once, and each region pays a futex wake-up; GOMP_SPINCOUNT=N spins N iterations.
//
// What suits a run depends on who runs its matrix products and who else wants its cores:
// - A BLAS with a pool of its own (OpenBLAS's pthreads: Debian's LibTorch 1.13): spinning
//   OpenMP workers take the core OpenBLAS's thread needs for the next product. Measured on
//   brown-gpt (bench/README.md, "Two threads"): 2 threads ran at 0.6x one thread's samples/s
//   with spinning workers, 1.4x with passive ones. Such a run gets PASSIVE.
// - Products on OpenMP's own pool: MKL (the torch 2.13 wheel's BLAS) in float32, oneDNN in
//   bf16 on a CPU with bf16 instructions. Every parallel region, products and elementwise
//   kernels alike, runs on the same workers, and passive workers pay a wake-up per region,
//   which a small model's short kernels do not repay. Such a run, alone on its host, gets a
//   short spin, GOMP_SPINCOUNT=3000 (kOpenMpSpinCount). Measured on issue 49's small GPT in
//   float32 at 2 threads (bench/README.md, "Two threads on OpenMP's pool"): 1.4-1.7x the
//   samples/s of passive workers on a quiet machine (1.58x in the interleaved comparison).
//   Longer spins are as fast alone but slow down badly when another busy process shares the
//   cores (libgomp's default 0.44-0.58 of passive's speed, 10000-30000 0.2-0.4); 3000 kept
//   0.61-0.88 of it there.
// - Processes that share a host (several local ranks by caravan's launcher, torchrun, mpirun or
//   srun) get PASSIVE: their workers would spin on each other's cores.
// A user's OMP_WAIT_POLICY or GOMP_SPINCOUNT is kept: PASSIVE suits a run that shares its cores
// with other work (a build, another job).
//
// Nothing that runs in the process can set the variables before libgomp reads them (the C
// library's environment is not set up yet when an executable's .preinit_array runs), so a
// process that will run more than one compute thread sets them and starts itself again.
#pragma once

#include <cstdint>
#include <string>

namespace caravan {

// Which threads run a run's matrix products (see above).
enum class MatrixProducts {
  kBlasThreads,  // a BLAS's own pool (OpenBLAS built with pthreads), float32
  kOpenMpPool,   // OpenMP's pool: MKL (the torch wheel's BLAS) in float32, oneDNN in bf16
};

// The spin count of a run alone on its host whose products run on OpenMP's pool (see above).
inline constexpr int64_t kOpenMpSpinCount = 3000;

// When `computeThreads` (train.threads; 0 = LibTorch's default: OMP_NUM_THREADS, else every
// core) means more than one thread and neither OMP_WAIT_POLICY nor GOMP_SPINCOUNT is set: sets
// GOMP_SPINCOUNT=kOpenMpSpinCount when the products run on OpenMP's pool and the process is
// alone on its host (`localProcesses`, the launcher's count: comm/world.h's localWorldSize),
// OMP_WAIT_POLICY=PASSIVE otherwise, marks them with CARAVAN_OMP_SET=1 and replaces the process
// with /proc/self/exe `argv` (same arguments; about half a second of loading LibTorch again).
// Returns otherwise, and when the exec fails (one warning line). Child processes inherit the
// variables; a worker of `caravan train --workers` runs one thread unless train.threads says
// more (cli/launch.h), and restarts itself only then.
void restartWithOpenMpWaits(char** argv, int64_t computeThreads, MatrixProducts products,
                            int localProcesses);

// Whether OMP_WAIT_POLICY or GOMP_SPINCOUNT is set (by the user, or by the restart above).
bool openMpWaitPolicySet();

// Whether libgomp's idle workers spin at all: not OMP_WAIT_POLICY=PASSIVE nor GOMP_SPINCOUNT=0.
bool openMpWorkersSpin();

// The waits libgomp read, for summary.json: "PASSIVE (caravan's default)", "spin 3000 (caravan's
// default)", "<OMP_WAIT_POLICY> (from the environment)", "spin <N> (GOMP_SPINCOUNT from the
// environment)" or "unset (libgomp's default: spin)".
std::string openMpWaitPolicy();

}  // namespace caravan
