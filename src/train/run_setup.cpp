// A run put together in one order (see run_setup.h).
#include "train/run_setup.h"

#include <algorithm>
#include <exception>
#include <set>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/communicator.h"
#include "core/errors.h"
#include "memory/accounting.h"
#include "pipeline/stage.h"
#include "train/data_parallel_step.h"
#include "train/distributed.h"
#include "train/pipeline_step.h"
#include "train/setup.h"
#include "train/sharded_step.h"

namespace caravan {

namespace {

int64_t countParameters(BlockModel& model) {
  int64_t n = 0;
  for (const auto& p : model->parameters()) n += p.numel();
  return n;
}

// What every engine's step does besides the gradients.
StepOptions stepOptions(const RunOptions& options) {
  StepOptions o;
  o.gradClip = options.optim.gradClip;
  o.skipNonFinite = options.loop.nonfiniteSkips > 0;
  return o;
}

// One process reads its own options: validated as train() validates them.
RunOptions validatedAlone(const Config& config) {
  RunOptions options = RunOptions::read(config);
  validate(options, 1);
  return options;
}

}  // namespace

RunSetup::RunSetup(const Config& config) : RunSetup(config, validatedAlone(config)) {}

RunSetup RunSetup::forInspection(const Config& config) {
  return RunSetup(config, RunOptions::read(config), 0, 1, ModelOnly{});
}

RunSetup::RunSetup(const Config& cfg, RunOptions opts, int rankInWorkers, int workerCount,
                   ModelOnly)
    : config(cfg),
      options([&] {
        opts.workers = workerCount;
        return std::move(opts);
      }()),
      rank(rankInWorkers),
      workers(workerCount) {
  data = makeDatasets(options.data, options.seed.data);
  torch::manual_seed(options.seed.init);
  model = buildModel(options.model, data.train->shape());
  parameterCount_ = countParameters(model);
  identity = runIdentity(options, data, model);
}

RunSetup::RunSetup(const Config& cfg, RunOptions opts, int rankInWorkers, int workerCount)
    : RunSetup(cfg, std::move(opts), rankInWorkers, workerCount, ModelOnly{}) {
  optimizer = makeOptimizer(options.optim, model->parameters());
  // Data is sharded over the workers (parameter servers read none).
  sampler = makeSamplerOptions(options, data.train->size(), rank, workers);
  batchesPerEpoch = Sampler(sampler).batchesPerEpoch();
  totalSteps =
      options.loop.maxSteps > 0 ? options.loop.maxSteps : options.loop.epochs * batchesPerEpoch;
  schedule = options.schedule;
  schedule.totalSteps = totalSteps;
}

RunSetup::RunSetup(const Config& cfg, RunOptions opts, Distributed* dist)
    : RunSetup(cfg, opts, dist != nullptr ? dist->workers()->rank() / opts.pipeline.stages : 0,
               dist != nullptr ? dist->workers()->size() / opts.pipeline.stages : 1) {}

RunSetup::~RunSetup() = default;

Batch RunSetup::sampleBatch() const {
  std::vector<int64_t> first;
  for (int64_t i = 0; i < std::min(options.data.batchSize, data.train->size()); ++i) {
    first.push_back(i);
  }
  return data.train->get(first);
}

void RunSetup::prepareTraining(const std::optional<std::string>& resumeFrom, int localProcesses) {
  CARAVAN_CHECK(optimizer != nullptr, "RunSetup::prepareTraining on a setup for inspection");
  loader = std::make_unique<Loader>(data.train, sampler, options.data.prefetch);
  state = TrainingState{};
  state.meta = identity;
  resumedFrom = resumeFrom;
  if (resumeFrom) {
    // A sharded run (attachSharded) installs its own slices of a sharded checkpoint of as many
    // workers; it reads no other rank's.
    std::optional<SliceOwner> own;
    if (options.sync.shard != ShardLevel::kNone && workers > 1 && !options.pipeline.active()) {
      own = SliceOwner{rank, workers};
    }
    state = loadCheckpoint(*resumeFrom, *model, *optimizer, identity, own);
    // A checkpoint's name is its step: another step inside is a renamed or copied file (of
    // another run, or an older one of this run), which resuming would silently continue from.
    if (const auto named = CheckpointDir::stepOf(*resumeFrom); named && *named != state.step) {
      throw CheckpointError(fmt::format(
          "{} holds step {}, not the step its name says: it was renamed or copied in; move it "
          "out of checkpoints/ to resume from the run's own checkpoints",
          *resumeFrom, state.step));
    }
    if (state.step > totalSteps) {
      throw ConfigError(
          fmt::format("{} is at step {}, past the {} steps this run trains (train.max_steps / "
                      "train.epochs); raise them to continue it",
                      *resumeFrom, state.step, totalSteps));
    }
    setDefaultRngState(state.rngState);
    if (state.batchSize == 0) state.batchSize = sampler.batchSize;  // older checkpoints
    if (state.workers == 0) state.workers = workers;
    if (state.workers != workers || state.batchSize != sampler.batchSize) {
      // Resharding: the position counts samples of the epoch (loader.h).
      const SamplerPosition saved = state.position;
      state.position = reshardPosition(saved, state.workers * state.batchSize,
                                       workers * sampler.batchSize, batchesPerEpoch);
      reshardNote = fmt::format(
          "caravan: the checkpoint was written by {} workers x batch {} (epoch {} batch {}); "
          "continuing with {} x {} at epoch {} batch {}",
          state.workers, state.batchSize, saved.epoch + 1, saved.batchInEpoch, workers,
          sampler.batchSize, state.position.epoch + 1, state.position.batchInEpoch);
    }
    loader->seek(state.position);
  } else {
    torch::manual_seed(options.seed.dropout);
  }
  // Per-block policies (memory.policy; planned under the budget for auto) and their executor:
  // before anything is written, so a run that cannot fit leaves nothing behind.
  const Batch sample = sampleBatch();
  checkTrainingFitsMachine(options, model, sample, data.train->shape().seqLen, localProcesses);
  // After the machine check (a float32 estimate: it does not count the bf16 copies of weights
  // a bf16 block saves for backward), before the memory plan, whose profile times the blocks
  // as they will run. Like the planner's profile, the timing holds every block's input.
  precision = choosePrecision(options.runtime.precision, model, sample,
                              std::max<int>(2, static_cast<int>(options.memory.profileRepeats)),
                              state.bf16Blocks);
  state.bf16Blocks = precision.blocksText();
  if (productsInBf16(options.runtime.precision) &&
      std::none_of(precision.bf16.begin(), precision.bf16.end(), [](bool b) { return b; })) {
    // Every product in float32 after all: OpenBLAS's threads back (core/openmp_env.h).
    setBlasThreads(at::get_num_threads());
    if (at::get_num_threads() > 1 && openMpWorkersSpin() &&
        matrixProductsFor("float32") == MatrixProducts::kBlasThreads) {
      precision.report.push_back(fmt::format(
          "precision: no block runs bf16, so OpenBLAS multiplies on {} threads again while "
          "OpenMP's idle workers spin (set for bf16 at start); train.precision = float32 runs "
          "this model with passive workers",
          at::get_num_threads()));
    }
  }
  activations = makeActivationMemory(options, model, sample, /*alwaysPlan=*/false, localProcesses);
}

RunSetup::PipelineCut RunSetup::pipelineCut(Communicator* comm) {
  // Rank 0 plans (profiles are timings: ranks would disagree); the others take its cut, or its
  // refusal, from one broadcast: [K + 1 boundaries, smallest budget or -1 when it fits, one
  // recompute flag per block].
  const int k = options.pipeline.stages;
  const int64_t n = static_cast<int64_t>(model->numBlocks());
  // Every rank refuses more stages than blocks, or split points that do not fit them, alike.
  evenPartition(model->numBlocks(), k);
  if (const PartitionChoice c = parsePartition(options.pipeline.partition);
      c.objective == PartitionObjective::kGiven) {
    givenPartition(c.splits, model->numBlocks(), k);
  }
  at::Tensor message = at::full({k + 2 + n}, -1, at::kLong);
  constexpr int64_t kRankZeroFailed = -2;  // in place of the smallest budget
  std::exception_ptr failure;  // rank 0's planning error: the others learn of it, then it throws
  if (comm == nullptr || comm->rank() == 0) {
    try {
      pipelinePlan_ = planPipeline(options, model, sampleBatch());
      const Partition& p = pipelinePlan_->partition;
      for (int i = 0; i <= k; ++i) message[i] = static_cast<int64_t>(p.boundaries[i]);
      if (!p.fits) message[k + 1] = p.smallestBudget;
      message.narrow(0, k + 2, n).zero_();
      for (const StageEstimate& e : p.stages) {
        for (size_t b : e.recomputed) message[k + 2 + static_cast<int64_t>(b)] = 1;
      }
    } catch (...) {
      failure = std::current_exception();
      message[k + 1] = kRankZeroFailed;
    }
  }
  if (comm != nullptr) comm->broadcast(message, 0)->wait(comm->timeout());
  if (failure) std::rethrow_exception(failure);
  if (message[k + 1].item<int64_t>() == kRankZeroFailed) {
    // A peer's failure (ranked below rank 0's own error when the launcher names the cause).
    throw PeerError(
        "rank 0 failed while planning the pipeline's stages; its error is in rank 0's "
        "output");
  }
  if (message[k + 1].item<int64_t>() >= 0)
    throw noPartitionFits(options, message[k + 1].item<int64_t>());
  PipelineCut cut;
  for (int i = 0; i <= k; ++i)
    cut.boundaries.push_back(static_cast<size_t>(message[i].item<int64_t>()));
  for (int64_t b = 0; b < n; ++b) cut.recompute.push_back(message[k + 2 + b].item<int64_t>() == 1);
  return cut;
}

void RunSetup::takeRankZeroPrecision(Communicator& comm) {
  const int64_t n = static_cast<int64_t>(model->numBlocks());
  at::Tensor flags = torch::zeros({n}, at::kInt);
  int32_t* f = flags.data_ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) f[i] = precision.bf16[i] ? 1 : 0;
  comm.broadcast(flags, 0)->wait(comm.timeout());
  for (int64_t i = 0; i < n; ++i) precision.bf16[i] = f[i] != 0;
  model->setBf16(precision.bf16);
  state.bf16Blocks = precision.blocksText();
}

std::unique_ptr<StepEngine> RunSetup::attach(Distributed* dist) {
  CARAVAN_CHECK(loader != nullptr, "RunSetup::attach before prepareTraining");
  // Before the pipeline's cut, which rank 0 plans with its own blocks' precision.
  // (The config decides whether to exchange, so every worker takes part even where a host's
  // CPU lacks bf16: it then runs rank 0's choice emulated.)
  if (dist != nullptr && options.runtime.precision != "float32") {
    takeRankZeroPrecision(*dist->workers());
  }
  std::unique_ptr<StepEngine> engine = options.pipeline.active() ? attachPipeline(dist)
                                       : sharded(dist)           ? attachSharded(*dist)
                                                                 : attachDataParallel(dist);
  engine->accountModelState(memory);
  memory.resetPeaks();
  return engine;
}

std::unique_ptr<StepEngine> RunSetup::attachPipeline(Distributed* dist) {
  // Stages train their own blocks; every rank built the same model from seed.init or loaded
  // the same checkpoint, so there is nothing to broadcast. Replicas of a stage average their
  // gradients in the engine (PipelineStep, through the all-reduce's accumulating mode, or
  // reduce-scatter their units under sync.shard): no sync.mode strategy.
  Communicator* comm = dist != nullptr ? dist->workers().get() : nullptr;
  const int worldSize = comm != nullptr ? comm->size() : 1;
  const PipelineLayout layout =
      PipelineLayout::of(comm != nullptr ? comm->rank() : 0, worldSize, options.pipeline.stages);
  const PipelineCut cut = pipelineCut(comm);
  auto stage =
      std::make_unique<PipelineStage>(model, cut.boundaries, comm, layout,
                                      options.pipeline.schedule, options.pipeline.microBatches);
  stage->holdOwnStageOnly(*optimizer);  // a checkpoint holds every stage's
  if (options.memory.automatic()) {     // the partition chose each block's policy
    std::vector<BlockPolicy> policies;
    for (bool r : cut.recompute)
      policies.push_back(r ? BlockPolicy::kRecompute : BlockPolicy::kKeep);
    setStagePolicies(activations, model, std::move(policies),
                     static_cast<int>(options.memory.prefetch));
  }
  PipelineStep::Parts parts;
  parts.comm = comm;
  parts.replicas = dist != nullptr ? dist->stageReplicas() : nullptr;
  std::vector<at::Tensor> gatheredLater;
  if (options.sync.shard != ShardLevel::kNone && parts.replicas != nullptr) {
    // The stage's units over its replicas (validate refused a stage without any); their
    // parameters are views of the units from now on.
    parts.shards = std::make_unique<ShardedParameters>(
        model, parts.replicas, options.sync.shard, &memory, options.sync.allreduce.bucketBytes,
        std::set<const c10::TensorImpl*>{},
        ShardedParameters::StageScope{stage->firstBlock(), stage->endBlock(), stage->parameters()});
    parts.sliced = makeOptimizer(options.optim, parts.shards->shards());
    gatheredLater = stage->parameters();
  }
  if (activations.executor) activations.executor->refreshParameters(gatheredLater);
  // Dropout: stages draw from their own streams (one stream on every rank would give
  // equally shaped blocks on different stages the same masks). Stage 0 keeps seed.dropout's
  // (or the checkpoint's); stage s > 0 starts from seed.dropout, s and the step, so a resumed
  // run's later stages draw other masks than the uninterrupted run's (docs/pipeline.md).
  if (layout.stage > 0) {
    torch::manual_seed(options.seed.dropout + 0x9E3779B97F4A7C15ULL * layout.stage +
                       static_cast<uint64_t>(state.step));
  }
  parts.buckets = options.sync.allreduce;  // uncompressed: validate refuses compression here
  parts.timelineStep = std::min(state.step + 3, totalSteps);
  return std::make_unique<PipelineStep>(std::move(stage), *optimizer, stepOptions(options),
                                        std::move(parts));
}

std::unique_ptr<StepEngine> RunSetup::attachDataParallel(Distributed* dist) {
  DataParallelStep::Parts parts;
  if (dist != nullptr) {
    AttachContext context;
    context.optimizer = optimizer.get();
    context.startStep = state.step;
    // Out-of-core weights exchange and update gradients per block: the strategy's groups.
    if (options.memory.offloadWeights) context.parameterGroups = blockParameters(model);
    if (resumedFrom) {
      context.restoredState = &state.strategy;
      context.savedWorkers = state.workers;
    }
    parts.strategy = dist->attach(*model, std::move(context));
    parts.workers = dist->workers().get();
    state.strategy.clear();  // handed to the strategy
  }
  // Out-of-core weights (memory.weights = offload): after the strategy attached (it broadcast
  // rank 0's parameters), the blocks move to the tier; the store counts what is in memory.
  if (options.memory.offloadWeights) {
    const OptimizerOptions optim = options.optim;
    weights = std::make_unique<OutOfCoreWeights>(
        model, *optimizer,
        [optim](std::vector<at::Tensor> ps) { return makeOptimizer(optim, std::move(ps)); },
        *activations.tier, &memory, parts.strategy, activations.weights);
    activations.executor->setWeights(weights.get());
    parts.weights = weights.get();
  }
  return std::make_unique<DataParallelStep>(model, *optimizer, stepOptions(options), parts);
}

bool RunSetup::sharded(const Distributed* dist) const {
  return dist != nullptr && options.sync.shard != ShardLevel::kNone;
}

std::unique_ptr<StepEngine> RunSetup::attachSharded(Distributed& dist) {
  // Every worker built the same model from seed.init or loaded the same checkpoint; the units
  // broadcast rank 0's anyway, as the all-reduce does. The slices get an optimizer of their
  // own (the run's options); the setup's keeps the learning rate and a resumed run's state,
  // which the engine slices.
  // Under parameters, the weights of bf16 blocks that only autocast's casts read are gathered
  // in bf16 (found from one forward of the sample batch, the same on every rank).
  const std::set<const c10::TensorImpl*> bf16Gathered =
      options.sync.shard == ShardLevel::kParameters ? bf16GatheredParameters(model, sampleBatch())
                                                    : std::set<const c10::TensorImpl*>{};
  auto shards =
      std::make_unique<ShardedParameters>(model, dist.workers(), options.sync.shard, &memory,
                                          options.sync.allreduce.bucketBytes, bf16Gathered);
  // The parameters are views of the units now (empty ones too, under parameters): saved
  // weights stay weights under every memory.policy.
  if (activations.executor) activations.executor->refreshParameters(model->parameters());
  auto sliced = makeOptimizer(options.optim, shards->shards());
  Tier* tier = options.memory.offloadWeights ? activations.tier.get() : nullptr;
  CARAVAN_CHECK(!options.memory.offloadWeights || tier != nullptr,
                "memory.weights = offload without a tier");
  std::shared_ptr<const ShardedSlices> resumed = std::move(state.ownSlices);
  return std::make_unique<ShardedStep>(model, *optimizer, stepOptions(options), std::move(shards),
                                       std::move(sliced), std::move(resumed),
                                       resumedFrom.value_or(""), tier);
}

std::vector<std::pair<std::string, std::string>> RunSetup::planFiles() const {
  std::vector<std::pair<std::string, std::string>> files;
  if (activations.plan) files.emplace_back("memory_plan.txt", activations.report);
  // Rank 0 planned the stages: the cut every rank runs.
  if (pipelinePlan_) files.emplace_back("pipeline_plan.txt", pipelinePlan_->report);
  return files;
}

}  // namespace caravan
