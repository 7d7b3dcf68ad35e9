#include "sim/recommend.h"

#include <algorithm>

#include <fmt/format.h>

#include "memory/tracker.h"
#include "sync/compression.h"
#include "sync/parameter_server.h"

namespace caravan::sim {
namespace {

// What a mode gives up against single-process training, in words.
std::string consistency(const RunOptions& job, const SimResult& r) {
  const SyncOptions& s = job.sync;
  std::string c;
  switch (s.mode) {
    case SyncMode::kAllReduce:
    case SyncMode::kPsBsp: c = "exact (every step synchronous)"; break;
    case SyncMode::kPsAsp:
      c = fmt::format("stale reads (mean gap {:.2f} steps)", meanStaleness(r.staleness));
      break;
    case SyncMode::kPsSsp:
      c = fmt::format("reads at most {} steps stale (mean gap {:.2f})", s.ps.staleness,
                      meanStaleness(r.staleness));
      break;
    case SyncMode::kOsp:
      c = fmt::format("{:.0f}% of each step synchronous, the rest a step late with LGP",
                      100.0 * r.ospFraction);
      break;
    case SyncMode::kLocalSgd:
      c = fmt::format("replicas averaged every {} steps", s.localSgd.period);
      break;
    case SyncMode::kGossip: c = "replicas mixed with their ring neighbours only"; break;
    case SyncMode::kDiloco:
    case SyncMode::kPsDiloco: break;  // not simulated
  }
  switch (sentCompression(s)) {
    case Compression::kFp16:
    case Compression::kBf16: c += ", gradients rounded to 16 bits"; break;
    case Compression::kTopK:
      c += fmt::format(", top {:g}% of each gradient", 100.0 * s.allreduce.topkRatio);
      break;
    case Compression::kNone:
    case Compression::kInt8:
    case Compression::kInt4: break;  // int8, int4: not simulated
  }
  return c;
}

}  // namespace

bool isComputeBound(const SimResult& r) { return r.computeUtilisation >= 0.8; }

std::string boundText(const SimResult& r) {
  return isComputeBound(r)
             ? fmt::format("compute-bound ({:.0f}% computing)", 100.0 * r.computeUtilisation)
             : fmt::format("communication-bound ({:.0f}% computing, busiest link {:.0f}%)",
                           100.0 * r.computeUtilisation, 100.0 * r.linkUtilisation);
}

RunOptions plainJob(const RunOptions& own, SyncMode mode) {
  RunOptions c = own;
  SyncOptions& s = c.sync;
  s.mode = mode;
  s.servers = usesServers(mode) ? std::max(1, own.sync.servers) : 0;
  s.setCompression("none");
  if (isConsistencyMode(mode)) {  // the mode's consistency, the run's staleness
    const PsOptions ps = s.ps;
    s.ps = psOptions(mode, ps.staleness);
    s.ps.compression = ps.compression;
    s.ps.topkRatio = ps.topkRatio;
  }
  s.localSgd.postLocalAfter = 0;
  s.gossip.topology = "ring";
  s.shard = ShardLevel::kNone;
  c.memory.offloadWeights = false;
  c.pipeline.stages = 1;
  c.pipeline.microBatches = 1;
  return c;
}

std::vector<RunOptions> candidates(const RunOptions& own, int workers) {
  const std::string ownLabel = label(own);
  std::vector<RunOptions> out{own};
  auto add = [&](SyncMode mode, auto&& change) {
    RunOptions c = plainJob(own, mode);
    change(c);
    if (label(c) != ownLabel) out.push_back(c);
  };
  auto none = [](RunOptions&) {};
  add(SyncMode::kAllReduce, none);
  add(SyncMode::kAllReduce, [](RunOptions& c) { c.sync.setCompression("fp16"); });
  add(SyncMode::kAllReduce, [](RunOptions& c) { c.sync.shard = ShardLevel::kGradients; });
  add(SyncMode::kAllReduce, [](RunOptions& c) { c.sync.shard = ShardLevel::kParameters; });
  add(SyncMode::kAllReduce, [](RunOptions& c) { c.memory.offloadWeights = true; });
  add(SyncMode::kPsBsp, none);
  add(SyncMode::kPsAsp, none);
  add(SyncMode::kPsSsp, none);
  add(SyncMode::kOsp, [](RunOptions& c) { c.sync.osp.autoFraction = true; });
  add(SyncMode::kLocalSgd, none);
  add(SyncMode::kGossip, none);
  if (workers % 2 == 0) {
    add(SyncMode::kAllReduce, [](RunOptions& c) {
      c.pipeline.stages = 2;
      c.pipeline.microBatches = 4;
    });
  }
  return out;
}

std::string Recommendation::text() const {
  const std::string epoch =
      epochMinutes > 0.0 ? fmt::format(", {:.1f} min/epoch", epochMinutes) : "";
  return fmt::format(
      "{}: {:.0f} samples/s{}; {}; {}{}{}", mode, samplesPerSecond, epoch, bound, consistency,
      memoryPredicted ? "" : "; memory not predicted",
      fits ? ""
           : fmt::format("; does NOT fit memory ({} per worker)", formatBytes(memoryPeakBytes)));
}

std::vector<Recommendation> recommend(
    const std::vector<std::pair<RunOptions, SimResult>>& simulated, const ClusterSpec& cluster,
    int workers, int64_t epochExamples) {
  std::vector<const std::pair<RunOptions, SimResult>*> order;
  for (const auto& s : simulated) order.push_back(&s);
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return a->second.samplesPerSecond > b->second.samplesPerSecond;
  });
  const double perHost = cluster.memoryBytesPerHost;
  const double perWorker =
      perHost > 0.0 ? perHost / std::max(1, (workers + cluster.hosts - 1) / cluster.hosts) : 0.0;
  std::vector<Recommendation> out;
  for (const auto* s : order) {
    const SimResult& r = s->second;
    Recommendation c;
    c.mode = r.mode;
    c.samplesPerSecond = r.samplesPerSecond;
    if (epochExamples > 0) c.epochMinutes = epochExamples / r.samplesPerSecond / 60.0;
    c.computeBound = isComputeBound(r);
    c.bound = boundText(r);
    c.consistency = consistency(s->first, r);
    c.memoryPredicted = r.memoryPeakBytes != 0;
    c.memoryPeakBytes = r.memoryPeakBytes;
    c.fits = perWorker <= 0.0 || r.memoryPeakBytes <= perWorker;
    out.push_back(std::move(c));
  }
  return out;
}

}  // namespace caravan::sim
