// OpenMP's idle workers. LibTorch's intra-op pool is libgomp's, which reads OMP_WAIT_POLICY
// once, as it loads (before main). Unset, its idle workers spin for about 300000 iterations
// after each parallel region; when the run uses every core (train.threads = 2 on 2 cores) they
// spin on the core that OpenBLAS's own thread needs for the next matrix product. Measured on
// brown-gpt (bench/README.md, "Two threads"): 2 threads ran at 0.6x one thread's samples/s
// with spinning workers, 1.4x with passive ones; Python PyTorch the same.
//
// A run whose matrix products go through oneDNN (bf16 on a CPU with bf16 instructions) runs
// every parallel region on OpenMP's pool: OpenBLAS's threads have nothing to do, so
// applyRuntimeOptions (train/setup.h) holds OpenBLAS to one thread and, when the process is
// alone on its host, the workers keep libgomp's default (spin a while, then sleep). Passive
// workers there cost a futex wake-up per region, which the short elementwise kernels between
// products do not repay: measured on brown-gpt bf16 (bench/README.md, "Two threads in bf16"),
// 2 threads ran 1.37x one thread with passive workers and two OpenBLAS threads, 1.68-1.80x with
// spinning workers and one. Processes that share a host (several local ranks by caravan's
// launcher, torchrun, mpirun or srun) keep passive workers: theirs would spin on each other's
// cores. A bf16 run whose timed choice leaves every block float32 (train/precision.h) gives
// OpenBLAS its threads back, but its workers spin: train.precision = float32 suits that model
// better.
//
// Nothing that runs in the process can set the variable before libgomp reads it (the C
// library's environment is not set up yet when an executable's .preinit_array runs), so a
// process that will run more than one compute thread sets it and starts itself again.
#pragma once

#include <string>

namespace caravan {

// Which pool runs a run's matrix products (see above).
enum class MatrixProducts { kOpenBlas, kOneDnn };

// When `computeThreads` (train.threads; 0 = LibTorch's default: OMP_NUM_THREADS, else every
// core) means more than one thread, OMP_WAIT_POLICY is unset and the products run on OpenBLAS
// or the process shares its host with other local processes (`localProcesses`, the launcher's
// count: comm/world.h's localWorldSize):
// sets OMP_WAIT_POLICY=PASSIVE and CARAVAN_OMP_SET=1 and replaces the process with
// /proc/self/exe `argv` (same arguments; about half a second of loading LibTorch again).
// Returns otherwise, and when the exec fails (one warning line). A user's OMP_WAIT_POLICY
// (ACTIVE) is kept. Child processes inherit the variable; a worker of `caravan train --workers`
// runs one thread unless train.threads says more (cli/launch.h), and restarts itself only then.
void restartWithPassiveOpenMpWaits(char** argv, int64_t computeThreads, MatrixProducts products,
                                   int localProcesses);

// Whether OMP_WAIT_POLICY is set (by the user, or by the restart above); unset, libgomp's idle
// workers spin a while.
bool openMpWaitPolicySet();

// The policy libgomp read: "PASSIVE (caravan's default)", "<value> (from the environment)" or
// "unset (libgomp's default: spin)".
std::string openMpWaitPolicy();

}  // namespace caravan
