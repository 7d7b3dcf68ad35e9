#include "sim/layout.h"

#include <algorithm>
#include <array>

#include <fmt/format.h>

#include "core/errors.h"
#include "memory/executor.h"
#include "memory/planner.h"
#include "memory/tier.h"
#include "memory/tracker.h"
#include "pipeline/partition.h"
#include "pipeline/schedule.h"
#include "sim/recommend.h"
#include "train/memory_setup.h"

namespace caravan::sim {
namespace {

// The workload's blocks as the planner profiled them (before the config's policy; a micro-batch's
// for perMicroBatch's workload).
ModelProfile wholeProfile(const Workload& w) {
  ModelProfile p;
  for (size_t b = 0; b < w.forwardSeconds.size(); ++b) {
    BlockProfile& bp = p.blocks.emplace_back();
    bp.forwardSeconds = w.forwardSeconds[b];
    bp.backwardSeconds = w.planner.keepBackwardSeconds[b];
    bp.inputBytes = bp.inputFloat32Bytes = w.inputBytes[b];
    bp.savedBytes = bp.savedFloat32Bytes = w.planner.savedBytes[b];
  }
  p.lossSeconds = w.lossSeconds;
  p.lossSavedBytes = w.planner.lossSavedBytes;
  return p;
}

double keepCompute(const ModelProfile& p) {
  double s = p.lossSeconds;
  for (const BlockProfile& b : p.blocks) s += b.forwardSeconds + b.backwardSeconds;
  return s;
}

std::string countPolicies(const std::vector<BlockPolicy>& policies) {
  std::array<int, kBlockPolicies> n{};
  for (BlockPolicy p : policies) ++n[static_cast<size_t>(p)];
  std::string out;
  for (int i = 0; i < kBlockPolicies; ++i) {
    if (n[i] == 0) continue;
    out += fmt::format("{}{} {}", out.empty() ? "" : ", ", n[i],
                       policyName(static_cast<BlockPolicy>(i)));
  }
  return out;
}

// The candidate's memory, its plan, the workload its compute is simulated with and (pipelines)
// the cut the run's partition makes.
struct Laid {
  Workload workload;
  int64_t memory = 0;
  int64_t leastMemory = 0;  // the smallest limit it fits
  bool fits = true;
  std::vector<BlockPolicy> policies;
  std::string partition;  // pipelines: parallel.partition's split points ("3,6,9")
};

Laid layOut(const Workload& w, const RunOptions& job, int workers, int64_t limit) {
  Laid out;
  out.workload = w;
  // sync.shard = parameters never swaps (a swapped activation could hold a gathered weight).
  const TierBandwidth bandwidth =
      job.sync.shard == ShardLevel::kParameters
          ? TierBandwidth{}
          : TierBandwidth{w.planner.tierWriteBytesPerSecond, w.planner.tierReadBytesPerSecond};
  const int prefetch = static_cast<int>(job.memory.prefetch);
  const size_t n = w.forwardSeconds.size();
  out.workload.backwardSeconds = w.planner.keepBackwardSeconds;
  // Spreads a stage's extra seconds over its blocks' backward, by their share of it; each
  // block's part divided by `shrink(b)`, what perMicroBatch multiplies its backward by (1: the
  // extra is per step).
  auto addExtra = [&](size_t begin, size_t end, double extra, auto shrink) {
    double backward = 0.0;
    for (size_t b = begin; b < end; ++b) backward += w.planner.keepBackwardSeconds[b];
    for (size_t b = begin; b < end && backward > 0.0; ++b) {
      const double share = shrink(b);
      if (share > 0.0) {
        out.workload.backwardSeconds[b] +=
            extra * w.planner.keepBackwardSeconds[b] / backward / share;
      }
    }
  };
  const int k = job.pipeline.stages;
  if (k <= 1 && job.memory.offloadWeights) {  // the run's own offload plan, as profiled
    out.workload = w;
    out.memory = out.leastMemory = w.offload.windowBytes + w.offload.activationPeakBytes;
    out.fits = limit <= 0 || out.memory <= limit;
    return out;
  }
  if (k <= 1) {  // the run's planner under what the limit leaves (train/memory_setup.cpp)
    const int64_t persistent = modelStateBytes(w, job, workers);
    const ModelProfile profile = wholeProfile(w);
    const int64_t room = limit > 0 ? plannedActivationBudget(limit, persistent) : 0;
    const Plan plan = planPolicies(profile, bandwidth, room, prefetch, nullptr, room);
    addExtra(0, n, std::max(0.0, plan.prediction.stepSeconds - keepCompute(profile)),
             [](size_t) { return 1.0; });
    out.workload.activationPeakBytes = plan.prediction.peakBytes;
    out.memory = persistent + plan.prediction.peakBytes;
    out.fits = limit <= 0 || (plan.fits && persistent < limit);
    // The smallest plan: the one the planner returns when none fits a budget of one byte.
    const int64_t least = limit > 0
                              ? planPolicies(profile, bandwidth, 1, prefetch).prediction.peakBytes
                              : plan.prediction.peakBytes;
    out.leastMemory = budgetForPlannedPeak(least, persistent);
    out.policies = plan.policies;
    return out;
  }
  // Pipelines: the run's partition (pipeline/partition.h) under the limit, recomputing where
  // memory.policy = auto would (not under zb-h1); the simulation then cuts where it cut.
  const int m = job.pipeline.microBatches;
  const Workload micro = perMicroBatch(w, m);
  const PartitionChoice choice = parsePartition(job.pipeline.partition);
  const bool recompute = limit > 0 && job.pipeline.schedule != PipelineSchedule::kZeroBubbleH1;
  const Partition partition = partitionBlocks(
      pipelineBlockCosts(wholeProfile(micro), micro.parameterBytes, 2 + w.stateFactor()), k, m,
      job.pipeline.schedule, limit, choice.objective, recompute,
      choice.objective == PartitionObjective::kGiven ? givenPartition(choice.splits, n, k)
                                                     : std::vector<size_t>{});
  out.policies.assign(n, BlockPolicy::kKeep);
  // A stage's recomputation is per micro-batch: added to the full batch's backward as what
  // perMicroBatch's shares bring back to it (each block's backward share at M).
  auto backwardShare = [&](size_t b) {
    const double full = w.planner.keepBackwardSeconds[b];
    return full > 0.0 ? micro.planner.keepBackwardSeconds[b] / full : 0.0;
  };
  for (const StageEstimate& stage : partition.stages) {
    addExtra(stage.begin, stage.end, stage.recomputeSeconds, backwardShare);
    out.memory = std::max(out.memory, stage.memoryBytes);
    for (size_t b : stage.recomputed) out.policies[b] = BlockPolicy::kRecompute;
  }
  out.fits = partition.fits;
  out.leastMemory = limit > 0 ? partition.smallestBudget : out.memory;
  for (size_t s = 1; s + 1 < partition.boundaries.size(); ++s) {
    out.partition += fmt::format("{}{}", s == 1 ? "" : ",", partition.boundaries[s]);
  }
  return out;
}

std::string shape(const RunOptions& job, int workers) {
  const int k = job.pipeline.stages;
  if (k > 1) {
    return fmt::format("{} stages x {} replica{}, {} micro-batches ({})", k, workers / k,
                       workers / k == 1 ? "" : "s", job.pipeline.microBatches,
                       pipelineScheduleName(job.pipeline.schedule));
  }
  return fmt::format("{} replica{}", workers, workers == 1 ? "" : "s");
}

}  // namespace

LayoutSync parseLayoutSync(const std::string& name) {
  if (name == "bsp") return LayoutSync::kBsp;
  if (name == "any") return LayoutSync::kAny;
  throw ConfigError(
      fmt::format("parallel.layout_sync = {}: use bsp (every step synchronous) or any (also the "
                  "asynchronous and local modes)",
                  name));
}

int clusterCapacity(const ClusterSpec& cluster, int threads) {
  const int perHost =
      std::max(1, static_cast<int>(cluster.coresPerHost / std::max(1, threads) + 1e-9));
  return cluster.hosts * perHost;
}

std::vector<std::string> layoutKeys(const RunOptions& job, int64_t memoryBudget) {
  std::vector<std::string> keys = {
      fmt::format("parallel.pipeline_stages={}", job.pipeline.stages),
      fmt::format("parallel.micro_batches={}", job.pipeline.microBatches),
      fmt::format("sync.mode=\"{}\"", syncModeName(job.sync.mode)),
      fmt::format("sync.shard=\"{}\"", shardLevelName(job.sync.shard)),
      "sync.compression=\"none\"",
      fmt::format("memory.weights=\"{}\"", job.memory.offloadWeights ? "offload" : "core")};
  if (job.pipeline.stages > 1) {
    keys.push_back(fmt::format("parallel.partition=\"{}\"", job.pipeline.partition));
  }
  if (job.sync.mode == SyncMode::kOsp) keys.push_back("sync.osp_auto_fraction=true");
  if (job.sync.mode == SyncMode::kLocalSgd) keys.push_back("sync.post_local_steps=0");
  if (job.sync.mode == SyncMode::kGossip) keys.push_back("sync.gossip_topology=\"ring\"");
  // The planner's policy under the limit, or every block kept (whatever the config said); with
  // offloaded weights the config's own, as the profile planned it.
  if (job.memory.offloadWeights) return keys;
  if (memoryBudget > 0) {
    keys.push_back("memory.policy=\"auto\"");
    keys.push_back(fmt::format("memory.budget=\"{}\"", memoryBudget));
  } else {
    keys.push_back("memory.policy=\"keep\"");
  }
  return keys;
}

std::vector<RunOptions> layoutCandidates(const RunOptions& own, const LayoutSpace& space,
                                         size_t blocks, int64_t batch) {
  const int workers = space.workers;
  const bool any = space.sync == LayoutSync::kAny;
  std::vector<RunOptions> out;
  auto add = [&](SyncMode mode, auto&& change) {
    RunOptions c = plainJob(own, mode);
    change(c);
    out.push_back(std::move(c));
  };
  auto none = [](RunOptions&) {};
  if (usesServers(own.sync.mode)) {  // the world has server processes: the server modes
    add(SyncMode::kPsBsp, none);
    if (any) {
      add(SyncMode::kPsAsp, none);
      add(SyncMode::kPsSsp, none);
      add(SyncMode::kOsp, [](RunOptions& c) { c.sync.osp.autoFraction = true; });
    }
    return out;
  }
  for (int k = 1; k <= workers && static_cast<size_t>(k) <= blocks; ++k) {
    if (workers % k != 0) continue;
    const int d = workers / k;
    if (k == 1) {
      for (ShardLevel level : kShardLevels) {
        if (level != ShardLevel::kNone && d == 1) continue;
        add(SyncMode::kAllReduce, [level](RunOptions& c) { c.sync.shard = level; });
      }
      add(SyncMode::kAllReduce, [](RunOptions& c) { c.memory.offloadWeights = true; });
      if (any && d > 1) {
        add(SyncMode::kLocalSgd, none);
        add(SyncMode::kGossip, none);
      }
      continue;
    }
    for (int m : {k, 2 * k, 4 * k}) {
      if (m > batch || batch % m != 0) continue;
      add(SyncMode::kAllReduce, [k, m](RunOptions& c) {
        c.pipeline.stages = k;
        c.pipeline.microBatches = m;
      });
    }
  }
  return out;
}

const LayoutChoice* LayoutSearch::best() const {
  return !ranked.empty() && ranked.front().fits ? &ranked.front() : nullptr;
}

std::string LayoutChoice::text() const {
  return fmt::format("{}: {:.1f} ms/step, {:.1f} samples/s; {}", name, 1e3 * predicted.stepSeconds,
                     predicted.samplesPerSecond, reasons);
}

LayoutSearch searchLayouts(const std::vector<PrecisionProfile>& profiles, const RunOptions& own,
                           const ClusterSpec& cluster, const LayoutSpace& space) {
  for (const PrecisionProfile& p : profiles) {
    if (!p.workload.planner.measured) {
      throw ConfigError(
          "the workload has no per-block planner profile (a workload file from before the "
          "layout search); profile again (drop --workload)");
    }
  }
  const int processes = space.workers + own.sync.servers;
  LayoutSearch search;
  // The limit: memory.budget, and at most the host's memory over the processes on the busiest.
  int64_t limit = own.memory.budget;
  search.limitSource = "memory.budget";
  if (cluster.memoryBytesPerHost > 0.0) {
    const int perHost = (processes + cluster.hosts - 1) / cluster.hosts;
    const auto share = static_cast<int64_t>(cluster.memoryBytesPerHost / perHost);
    if (limit <= 0 || share < limit) {
      limit = share;
      search.limitSource = "the host's memory over its processes";
    }
  }
  search.memoryLimit = limit;
  const SimOptions sim{space.workers, space.steps, 1};
  for (const PrecisionProfile& profile : profiles) {
    const Workload& workload = profile.workload;
    for (RunOptions& job :
         layoutCandidates(own, space, workload.forwardSeconds.size(), workload.batchPerWorker)) {
      if (!profile.precision.empty()) job.runtime.precision = profile.precision;
      const std::string name =
          label(job) + (profiles.size() > 1 ? "+" + job.runtime.precision : std::string());
      if (job.memory.offloadWeights && !workload.offload.measured) continue;
      try {
        validate(job, processes);
        if (const std::string why = unsupported(job); !why.empty()) throw ConfigError(why);
        LayoutChoice c;
        const Laid laid = layOut(workload, job, space.workers, limit);
        if (!laid.partition.empty()) job.pipeline.partition = laid.partition;
        c.predicted = simulate(laid.workload, job, cluster, sim);
        c.memoryBytes = laid.memory;
        c.leastMemoryBytes = laid.leastMemory;
        c.fits = laid.fits;
        c.policy = laid.policies.empty() ? "offload window" : countPolicies(laid.policies);
        const bool planned =
            limit > 0 && std::any_of(laid.policies.begin(), laid.policies.end(),
                                     [](BlockPolicy p) { return p != BlockPolicy::kKeep; });
        c.keys = layoutKeys(job, planned ? limit : 0);
        if (!profile.precision.empty()) c.keys.push_back("train.precision=" + profile.precision);
        const SimResult& r = c.predicted;
        c.reasons = fmt::format(
            "{}; {}; {} per worker{}; memory: {}", shape(job, space.workers), boundText(r),
            formatBytes(c.memoryBytes),
            limit > 0 ? fmt::format(" of {}{}", formatBytes(limit), c.fits ? "" : ", does NOT fit")
                      : "",
            c.policy);
        c.name = name;
        c.job = std::move(job);
        search.ranked.push_back(std::move(c));
      } catch (const ConfigError& e) {
        search.refused.push_back(fmt::format("{}: {}", name, e.what()));
      }
    }
  }
  std::stable_sort(search.ranked.begin(), search.ranked.end(),
                   [](const LayoutChoice& a, const LayoutChoice& b) {
                     if (a.fits != b.fits) return a.fits;
                     // Equal predictions (sharding levels that send the same bytes): the one
                     // that needs less memory.
                     if (a.fits && a.predicted.samplesPerSecond != b.predicted.samplesPerSecond) {
                       return a.predicted.samplesPerSecond > b.predicted.samplesPerSecond;
                     }
                     if (a.fits) return a.memoryBytes < b.memoryBytes;
                     return a.leastMemoryBytes < b.leastMemoryBytes;
                   });
  return search;
}

LayoutSearch searchLayouts(const Workload& workload, const RunOptions& own,
                           const ClusterSpec& cluster, const LayoutSpace& space) {
  return searchLayouts(std::vector<PrecisionProfile>{{workload, ""}}, own, cluster, space);
}

}  // namespace caravan::sim
