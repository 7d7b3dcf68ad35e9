// `caravan simulate`: training steps of a job on a cluster it does not run on, predicted from
// one worker's measured profile (sim/workload.h) and a cluster description (sim/cluster.h).
//
// The model, per sync mode (docs/simulate.md has it with its blind spots):
//   compute  each worker's forward, loss, backward and (where the worker updates) optimizer
//            step, as profiled on one core, times its host's contention: max(1, threads of the
//            processes computing on the host (or on the shared cores) / its cores), times a
//            lognormal straggler factor per worker and step (cluster.straggler_cv; mean 1).
//   links    every host has one outgoing and one incoming link; a transfer holds the sender's
//            outgoing and the receiver's incoming link from when both are free, for
//            latency + bytes / (rate x efficiency), first come first served. Processes of one
//            host exchange through memory (shm_gbps).
//   allreduce  gradient buckets as AllReduceStrategy forms them (gradientBuckets: the same
//            rule over the same parameters, in backward order) start when the slowest worker
//            produced them, one after the other; a bucket is a ring all-reduce between
//            hosts (2(H-1) steps of latency + bytes/H) after a reduction inside each host;
//            fp16/bf16 halve the bytes, top-k is an all-gather of (index, value) pairs. Then
//            every worker updates.
//   ps-bsp/asp/ssp  workers push each server its shard (compressed as configured) and pull it
//            back (float32); a server updates its shard once all pushes of a step arrived (bsp)
//            or on each push (asp, ssp), and answers an ssp pull when the reader is within the
//            staleness bound of that server's slowest clock (each server keeps its own). Servers
//            sit on hosts of their own when the cluster has them, else beside workers.
//   osp      stage 1 is ps-bsp on the stage-1 fraction of each shard; stage 2 (the rest) is
//            pushed as the next step's compute starts, and a step's stage 1 leaves only once the
//            previous step's stage 2 is back; the LGP update runs on the worker. `auto` picks
//            the fraction on a 0.05 grid that the simulation finds fastest.
//   local-sgd  H local steps (the worker updates), then a ring all-reduce of the parameters.
//   gossip   a step's parameters go to both ring neighbours as the step starts, overlapped
//            with its compute; the step ends once the neighbours' parameters are in.
//   allreduce with sync.shard  one unit per block: a block's reduce-scatter as its backward ends,
//            the update of a 1/W slice, then all-gathers (every block's after the update, the
//            next forward waiting for each; parameters: each block's before its forward and its
//            backward, one ahead), all through one queue of collectives; each moves half an
//            all-reduce's bytes. Memory: ZeRO's accounting (+ two gathered blocks).
//   memory.weights = offload  (sync.shard = none, one stage) the compute as above plus
//            Workload::offload's extra seconds on backward (the planner's prediction of the
//            tier's cost, with its update overlapped; the exchange is not overlapped with the
//            update here); memory: the planner's window and activations. Offload with sync.shard
//            or pipeline stages is not simulated.
//   pipeline K stages cut as the run cuts them (parallel.partition), M micro-batches, the
//            configured schedule (pipeline/schedule.h simulateSchedule), activations between
//            hosts; then the stage's gradients all-reduced across the data-parallel replicas.
// Threading: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sim/cluster.h"
#include "train/run_options.h"

namespace caravan::sim {

// One worker's training step as profiled on this host (sim/workload.h measures it).
struct Workload {
  std::string model;
  int64_t batchPerWorker = 0;
  int threads = 1;  // per worker process
  // Per block, in forward order: seconds on one process at `threads` threads.
  std::vector<double> forwardSeconds, backwardSeconds;
  std::vector<int64_t> parameterBytes;  // float32 bytes of each block's parameters
  // What a sync.shard = parameters gather of each block moves (gatherBytes: its weights that a
  // bf16 block gathers in bf16 at 2 bytes). Empty (a workload written before): parameterBytes.
  std::vector<int64_t> gatherBytes;
  std::vector<int64_t> inputBytes;  // each block's input (what crosses a pipeline cut)
  // Per block: the bytes of each of its parameters that takes a gradient, in registration
  // order (what AllReduceStrategy buckets; gradientBuckets). Empty: not profiled (a
  // caravan-workload-1 file), each block's parameterBytes taken as one tensor.
  std::vector<std::vector<int64_t>> gradientBytes;
  double lossSeconds = 0.0;
  double updateSeconds = 0.0;       // the optimizer's step over every parameter
  int64_t optimizerStateBytes = 0;  // of the whole model
  int64_t activationPeakBytes = 0;  // the memory plan's predicted activation peak
  int64_t epochExamples = 0;        // the training split's examples (0: unknown)
  // memory.weights = offload (each block's weights, gradients and optimizer state on
  // memory.tier while unused), as the run's planner predicts it on this host for one worker
  // (train/memory_setup.h; under memory.budget the window it would take): `extraSeconds`, what
  // a step takes beyond the in-core compute and update (the tier's reads and writes that the
  // overlapped update does not hide; added to backward); `windowBytes`, the weights, gradients
  // and state its window holds in memory at most; `activationPeakBytes`, its plan's. Not
  // `measured`: a workload file from before, or a model the planner could not plan offloaded.
  struct Offload {
    bool measured = false;
    double extraSeconds = 0.0;
    int64_t windowBytes = 0;
    int64_t activationPeakBytes = 0;
  } offload;
  // What the layout search (sim/layout.h) plans each layout's activations from, as the run's
  // planner would (memory/planner.h): per block the bytes its forward saves and its backward as
  // profiled (before the config's memory.policy added recomputation), the loss's saves, and the
  // tier's measured rates (0: not measured, no policy could swap). Not `measured`: a workload
  // file from before it.
  struct Planner {
    bool measured = false;
    std::vector<int64_t> savedBytes;
    std::vector<double> keepBackwardSeconds;
    int64_t lossSavedBytes = 0;
    double tierWriteBytesPerSecond = 0.0, tierReadBytesPerSecond = 0.0;
  } planner;

  // How each block's forward and backward times (and the loss's) shrink with its batch
  // (micro-batches): profiles at smaller batches, each time as a share of this batch's. A
  // micro-batch of b examples takes t times the share on the line through the two profiles around
  // b (this batch is the point (batchPerWorker, 1); below the smallest profile, the line through
  // the two smallest). Small batches cost more per example than a line through the full batch
  // and a quarter of it says (each operator's fixed cost, smaller matrix products), so the
  // profiles are at a quarter and a sixteenth of the batch. Empty: every time shrinks in
  // proportion. A workload file with the earlier "fixed" times reads as one profile at 0 examples.
  struct BatchShare {
    double examples = 0.0;
    std::vector<double> forward, backward;  // per block
    double loss = 1.0;
  };
  std::vector<BatchShare> smallerBatches;  // ascending examples, each below batchPerWorker

  // The blocks train.precision ran in bf16 when profiled on this host (not kept in a workload
  // file: 0 when read from one).
  int bf16Blocks = 0;

  int64_t parameterTotal() const;
  double computeSeconds() const;  // forward + loss + backward
  // The optimizer's state per weight byte (AdamW 2, SGD with momentum 1), rounded.
  int stateFactor() const;
};

// The first block of each of the job's pipeline stages, then the number of blocks: the cut the
// run makes (pipeline/partition.h, parallel.partition) from the profiled block times per
// micro-batch, with no memory budget. ConfigError when there are more stages than blocks.
std::vector<size_t> pipelineCut(const Workload& workload, const PipelineOptions& pipeline);

// The workload of one micro-batch of M (a pipeline's, or gradient accumulation's): each time at
// batchPerWorker / M examples (Workload::smallerBatches), each activation size / M; parameters,
// update and epoch as they are. M = 1: the workload itself.
Workload perMicroBatch(const Workload& workload, int microBatches);

// One all-reduce bucket of a workload, as AllReduceStrategy forms it (gradientBuckets).
struct GradientBucket {
  size_t tensors = 0;     // parameters in it
  int64_t bytes = 0;      // float32 bytes
  size_t readyBlock = 0;  // the block whose backward completes it (its last parameter's)
};

// The all-reduce's buckets over the workload's gradients, in launch order: bucketStarts
// (sync/buckets.h, the rule AllReduceStrategy::layBuckets lays its buckets by) over each
// parameter's bytes, the last registered first, with `options`' caps. Per parameter where the
// workload has Workload::gradientBytes; else (a caravan-workload-1 file, a hand-made workload)
// each block's parameterBytes as one tensor. Tests: Buckets.*.
std::vector<GradientBucket> gradientBuckets(const Workload& workload,
                                            const AllReduceOptions& options);

// What the simulator reads of a job's options (RunOptions::read, or a --recommend candidate):
// `sync`, `pipeline` and memory.weights (offload: Workload::offload's step and memory); every
// other field is the run's and ignored here.
// A short name: "allreduce", "ps-ssp(3)", "osp(auto)", "local-sgd(H=4)", "allreduce+fp16",
// "allreduce+offload".
std::string label(const RunOptions& job);
// "" when the job's mode and keys can be simulated, else why not (one line).
std::string unsupported(const RunOptions& job);
// The compression the job's mode sends with (each strategy reads its own copy of
// sync.compression): gradients in allreduce, pushes in the server modes, parameter changes in
// local-sgd and diloco; none in gossip (it sends parameters as they are).
Compression sentCompression(const SyncOptions& sync);

struct SimOptions {
  int workers = 1;  // data-parallel workers (pipelines: stages x replicas processes)
  int64_t steps = 100;
  uint64_t seed = 1;
};

struct SimResult {
  int workers = 0;
  std::string mode;
  double stepSeconds = 0.0;  // mean over the simulated steps
  double samplesPerSecond = 0.0;
  double scalingEfficiency = 0.0;   // samples/s over workers x one worker alone on one host
  double bytesSentPerStep = 0.0;    // per worker, mean (a local-sgd exchange spread over H)
  double computeUtilisation = 0.0;  // the workers' compute time over their wall time
  double linkUtilisation = 0.0;     // the busiest host link's busy time over the wall time
  double computeScale = 1.0;        // the contention factor applied to compute
  double ospFraction = -1.0;        // osp: the stage-1 fraction used (auto: the one chosen)
  std::vector<int64_t> staleness;   // asp/ssp: pushes by clock gap (index = gap)
  int64_t memoryPeakBytes = 0;      // per worker: weights, gradients, its optimizer state,
                                    // activations (pipelines: 0, not modelled)
  std::string placement;            // "4 workers on 4 hosts, 1 server on its own host"
};

// ConfigError when the cluster cannot hold the job (no host for a process) or the job is
// unsupported; steps >= 1. Reads job.sync and job.pipeline.
SimResult simulate(const Workload& workload, const RunOptions& job, const ClusterSpec& cluster,
                   const SimOptions& options);

// One worker's weights, gradients and optimizer state in a job of one pipeline stage on
// `workers` (SimResult::memoryPeakBytes without the activations): ZeRO's accounting with two
// gathered blocks for sync.shard, the offload window for memory.weights = offload, else the
// weights and gradients plus the optimizer state where the worker updates.
int64_t modelStateBytes(const Workload& workload, const RunOptions& job, int workers);

// The mean of gap x count over a staleness histogram (0 when empty).
double meanStaleness(const std::vector<int64_t>& histogram);

}  // namespace caravan::sim
