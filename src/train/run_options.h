// A run's options, typed and read once from the Config (RunOptions::read), and the checks
// between keys (validate) that decide whether a job can start at all. Everything after the
// setup reads these structs; the string keys of the config live in run_options.cpp only.
//
// validate() runs in the launcher before it starts any worker (`caravan train --workers N`)
// and on every rank before it connects, so a combination that cannot work is one line and
// exit 2 on every path, never a hang or a failure after rendezvous.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "core/config.h"
#include "data/loader.h"
#include "memory/weights.h"
#include "models/model.h"
#include "pipeline/schedule.h"
#include "sync/allreduce.h"
#include "sync/diloco.h"
#include "sync/gossip.h"
#include "sync/local_sgd.h"
#include "sync/osp.h"
#include "sync/parameter_server.h"
#include "sync/sync_mode.h"
#include "train/schedule.h"

namespace caravan {

struct SeedOptions {
  uint64_t init = 0;     // seed.init: parameter initialization
  uint64_t data = 0;     // seed.data: the data order
  uint64_t dropout = 0;  // seed.dropout: dropout and other random ops in training
};

struct DataOptions {
  std::string dataset;     // fashion-mnist | brown | synthetic
  std::string path;        // empty: the dataset's default location
  int64_t batchSize = 64;  // per worker
  int64_t evalBatchSize = 500;
  int64_t seqLen = 128;
  std::string tokenDtype = "uint16";  // data.token_dtype (tokens)
  int64_t vocabSize = 0;              // data.vocab_size (tokens)
  double valFraction = 0.1;
  int64_t prefetch = 2;
  std::string syntheticTask;  // image | tokens
  int64_t syntheticSize = 512;
  std::vector<DataSource> sources;  // [[data.sources]]: a mixture (empty: data.dataset alone)
};

struct OptimizerOptions {
  std::string name = "sgd";  // sgd | adamw
  double lr = 0.01;
  double momentum = 0.9;
  bool nesterov = false;
  double weightDecay = 0.0;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double gradClip = 0.0;  // global L2 norm (0 = off)
};

// The training loop's own keys (train.*, checkpoint.*).
struct LoopOptions {
  int64_t epochs = 1;
  int64_t maxSteps = 0;     // 0: epochs decide
  double maxSeconds = 0.0;  // train.max_minutes in seconds (0 = no limit)
  int64_t evalEvery = 0;    // 0: every epoch
  int64_t evalBatches = 0;  // 0: the whole split
  int64_t logEvery = 50;
  int64_t nonfiniteSkips = 0;
  int64_t checkpointEvery = 0;
  int64_t checkpointKeep = 3;
};

// Process-wide settings (applyRuntimeOptions, train/setup.h).
struct RuntimeOptions {
  bool keepFreedMemory = true;
  int64_t freedMemoryCache = 0;  // bytes
  int64_t threads = 0;           // 0: the libraries' defaults
  std::string precision = "float32";  // float32 | bf16 | bf16-all (train/precision.h)
};

struct MemoryOptions {
  std::string policy = "keep";  // keep | recompute | swap | swap-input | auto | a list per block
  bool offloadWeights = false;  // memory.weights = offload
  std::string tier = "disk";
  std::string tierDtype = "float32";  // memory.tier_dtype: float32 | bf16 (memory/tier.h)
  std::string swapDir;
  int64_t prefetch = 1;
  int64_t profileRepeats = 3;
  int64_t budget = 0;      // bytes, 0 = none
  std::string budgetText;  // as written, for messages
  bool automatic() const { return policy == "auto"; }
};

struct SyncOptions {
  SyncMode mode = SyncMode::kAllReduce;
  int servers = 0;  // processes serving parameters: sync.servers in ps-* and osp, else 0
  std::string backend = "auto";
  int connections = 1;  // dist.connections: TCP connections per pair of ranks (Gloo striping)
  std::string store = "tcp";
  std::string storePath;
  std::chrono::milliseconds timeout{60000};            // fault.timeout
  std::chrono::milliseconds rendezvousTimeout{30000};  // fault.rendezvous_timeout
  std::chrono::milliseconds stallReport{20000};        // fault.stall_report
  std::string compressionName = "none";
  ShardLevel shard = ShardLevel::kNone;  // sync.shard (allreduce): ZeRO's stages
  AllReduceOptions allreduce;
  LocalSgdOptions localSgd;
  DilocoOptions diloco;
  GossipOptions gossip;
  PsOptions ps;  // ps-bsp, ps-asp, ps-ssp
  // diloco and ps-diloco read `diloco`.
  OspOptions osp;
  bool usesServers() const { return servers > 0; }
  // sync.compression = `name` in every strategy's copy (the all-reduce's gradients, the
  // servers' pushes, local SGD's and DiLoCo's parameter changes), as RunOptions::read sets them
  // from the one key. ConfigError for an unknown name.
  void setCompression(const std::string& name);
};

// parallel.*: pipeline stages and micro-batches.
struct PipelineOptions {
  int stages = 1;        // K
  int microBatches = 1;  // M (resolved: never 0)
  PipelineSchedule schedule = PipelineSchedule::kOneFOneB;
  std::string partition = "auto";  // parallel.partition
  // Whether the step runs through a PipelineStage: K > 1, or M > 1 (gradient accumulation).
  bool active() const { return stages > 1 || microBatches > 1; }
};

struct RunOptions {
  SeedOptions seed;
  DataOptions data;
  ModelSpec model;
  OptimizerOptions optim;
  ScheduleOptions schedule;  // totalSteps is the run's, set once the data is known
  LoopOptions loop;
  RuntimeOptions runtime;
  MemoryOptions memory;
  SyncOptions sync;
  PipelineOptions pipeline;
  // The data-parallel workers the model state is sharded over (sync.shard): not a key; set by
  // RunSetup for a job's worker (1 elsewhere: caravan plan prints each level for several).
  int workers = 1;

  // Reads every key once. Throws ConfigError for a value no key's schema catches alone (e.g.
  // a memory.budget that is not a size).
  static RunOptions read(const Config& config);
};

// How many of the world's processes are servers: sync.servers in those modes, else 0.
int serverCount(const Config& config);

// Refuses, with one line that says what to do (ConfigError), every combination of keys that
// cannot run in a world of `worldSize` processes (servers included): compression with a mode
// that cannot compress, clipping or non-finite skips where the update happens elsewhere,
// out-of-core weights with a strategy that cannot exchange per block, servers that leave no
// worker, and the like. One process trains alone and ignores the sync.* keys.
void validate(const RunOptions& options, int worldSize);
// The optimizer keys on their own (part of validate; also what makeOptimizer checks, for the
// paths that build one without training: caravan eval, the servers).
void validate(const OptimizerOptions& optim);
// The schedule keys on their own (part of validate): a time horizon needs train.max_minutes
// and a cosine (or constant) schedule.
void validate(const ScheduleOptions& schedule);

// The out-of-core store's options (memory.prefetch, optim.*).
WeightOptions weightOptions(const RunOptions& options);

}  // namespace caravan
