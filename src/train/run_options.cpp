// Config -> typed options, and the checks between keys (see run_options.h).
#include "train/run_options.h"

#include <sstream>

#include <fmt/format.h>

#include "core/errors.h"
#include "memory/accounting.h"
#include "pipeline/partition.h"
#include "sync/compression.h"

namespace caravan {

int serverCount(const Config& config) {
  return usesServers(parseSyncMode(config.str("sync.mode")))
             ? static_cast<int>(config.i64("sync.servers"))
             : 0;
}

namespace {

std::chrono::milliseconds milliseconds(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

SyncOptions readSync(const Config& config) {
  SyncOptions s;
  s.mode = parseSyncMode(config.str("sync.mode"));
  s.servers = serverCount(config);
  s.backend = config.str("dist.backend");
  s.connections = static_cast<int>(config.i64("dist.connections"));
  s.store = config.str("dist.store");
  s.storePath = config.str("dist.store_path");
  s.timeout = milliseconds(config.f64("fault.timeout"));
  s.rendezvousTimeout = milliseconds(config.f64("fault.rendezvous_timeout"));
  s.stallReport = milliseconds(config.f64("fault.stall_report"));
  s.shard = parseShardLevel(config.str("sync.shard"));
  AllReduceOptions& a = s.allreduce;
  a.bucketBytes = static_cast<int64_t>(config.f64("sync.bucket_mb") * (1 << 20));
  a.firstBucketBytes = static_cast<int64_t>(config.f64("sync.first_bucket_mb") * (1 << 20));
  a.topkRatio = config.f64("sync.topk_ratio");
  s.localSgd.period = config.i64("sync.local_period");
  s.localSgd.postLocalAfter = config.i64("sync.post_local_steps");
  s.localSgd.allreduce = a;  // the BSP phase's gradients: uncompressed
  DilocoOptions& dl = s.diloco;
  dl.period = s.localSgd.period;
  dl.outerLr = config.f64("sync.outer_lr");
  dl.outerMomentum = config.f64("sync.outer_momentum");
  dl.fragments = config.i64("sync.fragments");
  s.gossip.topology = config.str("sync.gossip_topology");
  if (isConsistencyMode(s.mode)) {
    s.ps = psOptions(s.mode, config.i64("sync.staleness"));
  }
  s.ps.topkRatio = a.topkRatio;
  s.setCompression(config.str("sync.compression"));
  OspOptions& o = s.osp;
  o.fraction = config.f64("sync.osp_fraction");
  o.autoFraction = config.flag("sync.osp_auto_fraction");
  o.policy = config.str("sync.osp_policy");
  o.lgp = config.flag("sync.osp_lgp");
  if (config.str("optim.name") == "sgd") o.lgpMomentum = config.f64("optim.momentum");
  o.chunkElements = config.i64("sync.osp_chunk");
  return s;
}

DataOptions readData(const Config& config) {
  DataOptions d;
  d.dataset = config.str("data.dataset");
  d.path = config.str("data.path");
  d.batchSize = config.i64("data.batch_size");
  d.evalBatchSize = config.i64("data.eval_batch_size");
  d.seqLen = config.i64("data.seq_len");
  d.tokenDtype = config.str("data.token_dtype");
  d.vocabSize = config.i64("data.vocab_size");
  d.valFraction = config.f64("data.val_fraction");
  d.prefetch = config.i64("data.prefetch");
  d.syntheticTask = config.str("data.synthetic_task");
  d.syntheticSize = config.i64("data.synthetic_size");
  d.sources = config.dataSources();
  if (!d.sources.empty() && (config.isSet("data.dataset") || config.isSet("data.path"))) {
    throw ConfigError(
        "[[data.sources]] name each source's path and format; remove data.dataset and data.path");
  }
  return d;
}

// `batchSize`: data.batch_size, which the default micro-batch count divides.
PipelineOptions readPipeline(const Config& config, int64_t batchSize) {
  PipelineOptions p;
  p.stages = static_cast<int>(config.i64("parallel.pipeline_stages"));
  p.schedule = parsePipelineSchedule(config.str("parallel.schedule"));
  p.partition = config.str("parallel.partition");
  parsePartition(p.partition);  // a name or split points (their count is checked with the model)
  p.microBatches = static_cast<int>(config.i64("parallel.micro_batches"));
  if (p.microBatches == 0) {  // the default: the largest count <= 4K dividing the batch
    p.microBatches = 1;
    if (p.stages > 1) {
      for (int64_t m = std::min<int64_t>(4 * p.stages, batchSize); m >= 1; --m) {
        if (batchSize % m == 0) {
          p.microBatches = static_cast<int>(m);
          break;
        }
      }
    }
  }
  return p;
}

ModelSpec readModel(const Config& config) {
  ModelSpec m;
  m.name = config.str("model.name");
  m.width = config.i64("model.width");
  m.depth = config.i64("model.depth");
  m.heads = config.i64("model.heads");
  m.dropout = config.f64("model.dropout");
  m.attention =
      config.str("model.attention") == "sdpa" ? AttentionKernel::kSdpa : AttentionKernel::kExplicit;
  m.path = config.str("model.path");
  m.blocks = config.str("model.blocks");
  m.loss = config.str("model.loss");
  return m;
}

OptimizerOptions readOptimizer(const Config& config) {
  OptimizerOptions o;
  o.name = config.str("optim.name");
  o.lr = config.f64("optim.lr");
  o.momentum = config.f64("optim.momentum");
  o.nesterov = config.flag("optim.nesterov");
  o.weightDecay = config.f64("optim.weight_decay");
  o.beta1 = config.f64("optim.beta1");
  o.beta2 = config.f64("optim.beta2");
  o.eps = config.f64("optim.eps");
  o.gradClip = config.f64("optim.grad_clip");
  return o;
}

ScheduleOptions readSchedule(const Config& config, double peakLr) {
  ScheduleOptions s;
  s.kind = config.str("schedule.kind");
  s.peakLr = peakLr;
  s.warmupSteps = config.i64("schedule.warmup_steps");
  s.stepSize = config.i64("schedule.step_size");
  s.gamma = config.f64("schedule.gamma");
  s.minLr = config.f64("schedule.min_lr");
  s.horizon = config.str("schedule.horizon");
  s.budgetSeconds = config.f64("train.max_minutes") * 60.0;
  return s;
}

LoopOptions readLoop(const Config& config) {
  LoopOptions l;
  l.epochs = config.i64("train.epochs");
  l.maxSteps = config.i64("train.max_steps");
  l.maxSeconds = config.f64("train.max_minutes") * 60.0;
  l.evalEvery = config.i64("train.eval_every");
  l.evalBatches = config.i64("train.eval_batches");
  l.logEvery = config.i64("train.log_every");
  l.nonfiniteSkips = config.i64("train.nonfinite_skips");
  l.checkpointEvery = config.i64("checkpoint.every");
  l.checkpointKeep = config.i64("checkpoint.keep");
  return l;
}

RuntimeOptions readRuntime(const Config& config) {
  RuntimeOptions rt;
  rt.keepFreedMemory = config.flag("train.keep_freed_memory");
  // Read only when used: a run without the cache does not care what its size says.
  if (rt.keepFreedMemory) {
    rt.freedMemoryCache =
        parseBytes(config.str("train.freed_memory_cache"), "train.freed_memory_cache");
  }
  rt.threads = config.i64("train.threads");
  rt.precision = config.str("train.precision");
  return rt;
}

MemoryOptions readMemory(const Config& config) {
  MemoryOptions m;
  m.policy = config.str("memory.policy");
  m.offloadWeights = config.str("memory.weights") == "offload";
  m.tier = config.str("memory.tier");
  m.tierDtype = config.str("memory.tier_dtype");
  m.swapDir = config.str("memory.swap_dir");
  m.prefetch = config.i64("memory.prefetch");
  m.profileRepeats = config.i64("memory.profile_repeats");
  m.budgetText = config.str("memory.budget");
  m.budget = parseBytes(m.budgetText, "memory.budget");
  return m;
}

}  // namespace

RunOptions RunOptions::read(const Config& config) {
  RunOptions r;
  r.seed.init = static_cast<uint64_t>(config.i64("seed.init"));
  r.seed.data = static_cast<uint64_t>(config.i64("seed.data"));
  r.seed.dropout = static_cast<uint64_t>(config.i64("seed.dropout"));
  r.data = readData(config);
  r.pipeline = readPipeline(config, r.data.batchSize);
  r.model = readModel(config);
  r.optim = readOptimizer(config);
  r.schedule = readSchedule(config, r.optim.lr);
  r.loop = readLoop(config);
  r.runtime = readRuntime(config);
  r.memory = readMemory(config);
  r.sync = readSync(config);
  return r;
}

WeightOptions weightOptions(const RunOptions& options) {
  WeightOptions o;
  o.prefetch = static_cast<int>(options.memory.prefetch);
  o.overlapUpdates = options.optim.gradClip <= 0.0;  // clipping needs every gradient
  // Optimizer state per weight byte: AdamW two moments, SGD one momentum buffer.
  if (options.optim.name == "adamw") {
    o.stateFactor = 2;
  } else if (options.optim.momentum > 0.0) {
    o.stateFactor = 1;
  }
  return o;
}

void validate(const OptimizerOptions& optim) {
  if (optim.name == "sgd" && optim.nesterov && optim.momentum <= 0.0) {
    throw ConfigError("optim.nesterov = true needs optim.momentum > 0");
  }
}

void validate(const ScheduleOptions& schedule) {
  if (schedule.horizon != "time") return;
  if (schedule.budgetSeconds <= 0) {
    throw ConfigError(
        "schedule.horizon = time counts train.max_minutes: set it (e.g. --set "
        "train.max_minutes=20) or use schedule.horizon = steps");
  }
  if (schedule.kind == "step") {
    throw ConfigError(
        "schedule.kind = step decays every schedule.step_size steps, which a time horizon does "
        "not change; use schedule.kind = cosine with schedule.horizon = time");
  }
}

namespace {

void validate(const PipelineOptions& pipeline, const RunOptions& options, int worldSize) {
  if (options.data.batchSize % pipeline.microBatches != 0) {
    throw ConfigError(fmt::format(
        "data.batch_size = {} does not split into parallel.micro_batches = {}; make the batch "
        "a multiple of it",
        options.data.batchSize, pipeline.microBatches));
  }
  if (!pipeline.active()) return;
  const std::string what = pipeline.stages > 1
                               ? fmt::format("parallel.pipeline_stages = {}", pipeline.stages)
                               : fmt::format("parallel.micro_batches = {}", pipeline.microBatches);
  // First: with parameter servers the world counts them, which the counts below would not.
  if (options.sync.mode != SyncMode::kAllReduce && worldSize > 1) {
    throw ConfigError(fmt::format("{} runs without sync.mode = {}: leave sync.mode at allreduce",
                                  what, syncModeName(options.sync.mode)));
  }
  if (pipeline.stages > 1 && worldSize % pipeline.stages != 0) {
    throw ConfigError(fmt::format(
        "{} does not divide {} workers: run K x D workers (D data-parallel pipelines of K "
        "stages)",
        what, worldSize));
  }
  if (pipeline.stages > 1 && worldSize > pipeline.stages && options.sync.backend == "mpi") {
    throw ConfigError(fmt::format(
        "{} with {} workers (data-parallel pipelines) does not run on dist.backend = mpi yet; "
        "use auto, shm or gloo",
        what, worldSize));
  }
  if (options.memory.offloadWeights) {
    throw ConfigError(fmt::format(
        "{} does not run with memory.weights = offload yet; set memory.weights = core", what));
  }
  if (options.sync.allreduce.compression != Compression::kNone) {
    throw ConfigError(fmt::format(
        "{} averages replicas' gradients uncompressed; set sync.compression = none", what));
  }
  // Fixed policies run per micro-batch (each block call is its own executor frame); auto's
  // policies come from the partition (keep or recompute per block); zb-h1's W reads a block's
  // saved tensors a second time, which recompute and swap hand out once (with auto its stages
  // keep).
  if (options.memory.policy != "keep" && !options.memory.automatic() &&
      pipeline.schedule == PipelineSchedule::kZeroBubbleH1) {
    throw ConfigError(fmt::format(
        "parallel.schedule = zb-h1 keeps every activation (its W reads them again): set "
        "memory.policy = keep or parallel.schedule = 1f1b (not memory.policy = {})",
        options.memory.policy));
  }
}

// sync.shard in a job (part of validateJob): sharded data parallelism is its own step engine
// beside the all-reduce's (train/sharded_step.h).
void validateShard(const RunOptions& options, int worldSize) {
  const ShardLevel shard = options.sync.shard;
  if (shard == ShardLevel::kNone) return;
  const char* name = shardLevelName(shard);
  if (options.sync.mode != SyncMode::kAllReduce) {
    throw ConfigError(fmt::format(
        "sync.shard = {} splits the model state of workers that average gradients every step; "
        "set sync.mode = allreduce, or sync.shard = none for sync.mode = {}",
        name, syncModeName(options.sync.mode)));
  }
  if (options.sync.allreduce.compression != Compression::kNone) {
    throw ConfigError(fmt::format(
        "sync.shard = {} reduce-scatters float32 gradients; set sync.compression = none", name));
  }
  const int stages = options.pipeline.stages;
  if (options.pipeline.active() && worldSize <= stages) {
    throw ConfigError(fmt::format(
        "sync.shard = {} splits each pipeline stage's model state over the stage's replicas, and "
        "{} workers in stages of {} leave one per stage: run {} workers or more (a multiple of "
        "parallel.pipeline_stages), or set sync.shard = none",
        name, worldSize, stages, 2 * stages));
  }
  if (options.memory.offloadWeights && shard != ShardLevel::kParameters) {
    throw ConfigError(fmt::format(
        "sync.shard = {} does not run with memory.weights = offload yet; set sync.shard = "
        "parameters (each worker's slices then live on memory.tier), memory.weights = core, or "
        "sync.shard = none",
        name));
  }
  const std::string& policy = options.memory.policy;
  if (shard == ShardLevel::kParameters && policy != "auto") {
    std::stringstream list(policy);
    for (std::string one; std::getline(list, one, ',');) {
      if (one != "keep" && one != "recompute") {
        throw ConfigError(fmt::format(
            "sync.shard = parameters runs with memory.policy = keep, recompute or auto (which "
            "plans those two), not {} yet: a swapped activation may hold a gathered weight",
            policy));
      }
    }
  }
}

// The sync.* and dist.* keys of a job of several processes (part of validate).
void validateJob(const RunOptions& options, int worldSize) {
  const SyncOptions& sync = options.sync;
  const SyncMode mode = sync.mode;
  const char* modeName = syncModeName(mode);
  // Waits are counted in milliseconds: less than one would be no wait at all.
  for (const auto& [key, value] : {std::pair{"fault.timeout", sync.timeout},
                                   std::pair{"fault.rendezvous_timeout", sync.rendezvousTimeout}}) {
    if (value.count() < 1) {
      throw ConfigError(
          fmt::format("{} is below a millisecond; give it in seconds, at least "
                      "0.001",
                      key));
    }
  }
  const bool psMode = isConsistencyMode(mode);
  const Compression compression = sync.allreduce.compression;
  const bool compressed = compression != Compression::kNone;
  const bool quantized = isQuantized(compression);
  const bool rare = isDiloco(mode) || mode == SyncMode::kLocalSgd;  // parameter changes travel
  if (quantized && !rare) {
    throw ConfigError(fmt::format(
        "sync.compression = {} is for parameter changes (sync.mode = diloco, ps-diloco or "
        "local-sgd); "
        "for {} use none, fp16, bf16 or topk",
        sync.compressionName, modeName));
  }
  if (compressed && !quantized && mode != SyncMode::kAllReduce && !psMode) {
    throw ConfigError(fmt::format(
        "sync.compression = {} works with sync.mode = allreduce, ps-bsp, ps-asp and ps-ssp; "
        "for {} use none{}",
        sync.compressionName, modeName, rare ? ", int8 or int4" : ""));
  }
  if (mode == SyncMode::kLocalSgd && sync.diloco.fragments > 1) {
    throw ConfigError(fmt::format(
        "sync.fragments = {} streams diloco's fragments; local-sgd averages the whole model "
        "at once: use sync.mode = diloco (sync.outer_lr = 1, sync.outer_momentum = 0 for "
        "local SGD's averaging) or sync.fragments = 1",
        sync.diloco.fragments));
  }
  if (isDiloco(mode) && sync.localSgd.postLocalAfter > 0) {
    throw ConfigError(
        fmt::format("sync.post_local_steps is local-sgd's BSP phase; {} has none: set "
                    "sync.post_local_steps = 0",
                    modeName));
  }
  if (isDiloco(mode) && sync.diloco.fragments > sync.diloco.period) {
    throw ConfigError(fmt::format(
        "sync.fragments = {} is more than sync.local_period = {}: each fragment syncs once "
        "every sync.local_period steps, one at a time; use at most {} fragments",
        sync.diloco.fragments, sync.diloco.period, sync.diloco.period));
  }
  if (stepsOnServers(mode) && options.optim.gradClip > 0.0) {
    throw ConfigError(
        fmt::format("optim.grad_clip is not supported with sync.mode = {} yet (its servers run the "
                    "optimizer and the global norm spans their shards); set optim.grad_clip = 0",
                    modeName));
  }
  validateShard(options, worldSize);
  if (options.memory.offloadWeights) {
    // Only the all-reduce exchanges gradients per block (Strategy::supportsParameterGroups).
    if (mode != SyncMode::kAllReduce) {
      throw ConfigError(fmt::format(
          "memory.weights = offload works with sync.mode = allreduce (or one process), not "
          "{}; set memory.weights = core or sync.mode = allreduce",
          modeName));
    }
    if (compressed) {
      throw ConfigError(
          "memory.weights = offload exchanges uncompressed per-block buckets; "
          "set sync.compression = none");
    }
  }
}

}  // namespace

void validate(const RunOptions& options, int worldSize) {
  const SyncOptions& sync = options.sync;
  const SyncMode mode = sync.mode;
  const char* modeName = syncModeName(mode);
  const bool distributed = worldSize > 1;
  if (distributed && sync.servers > 0) {
    if (worldSize - sync.servers < 1) {
      throw ConfigError(
          fmt::format("sync.mode {} with sync.servers = {} leaves no worker in a "
                      "world of {}; start more processes or use fewer servers",
                      modeName, sync.servers, worldSize));
    }
    if (sync.backend == "mpi") {
      throw ConfigError(fmt::format(
          "sync.mode {} does not run on dist.backend = mpi yet; use auto, shm or gloo", modeName));
    }
  }
  validate(options.optim);
  validate(options.schedule);
  if (distributed) validateJob(options, worldSize);
  validate(options.pipeline, options, worldSize);
  // train.nonfinite_skips: the update must come after the gradients can be checked (out-of-core
  // weights update during backward; sharded ones after it).
  const bool shardedUpdate = distributed && options.sync.shard != ShardLevel::kNone;
  const bool updatesBeforeCheck =
      (options.memory.offloadWeights && !shardedUpdate) || (distributed && stepsOnServers(mode));
  if (options.loop.nonfiniteSkips > 0 && updatesBeforeCheck) {
    throw ConfigError(fmt::format(
        "train.nonfinite_skips needs the update after backward; {} updates before it can be "
        "checked: set train.nonfinite_skips = 0",
        options.memory.offloadWeights ? "memory.weights = offload"
                                      : "sync.mode = " + std::string(modeName)));
  }
}

void SyncOptions::setCompression(const std::string& name) {
  const Compression c = parseCompression(name);
  compressionName = name;
  allreduce.compression = c;
  ps.compression = c;
  localSgd.compression = c;  // the averaging's: none, int8, int4
  diloco.compression = c;
}

}  // namespace caravan
