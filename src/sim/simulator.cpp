#include "sim/simulator.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <queue>
#include <random>

#include <fmt/format.h>

#include "core/errors.h"
#include "pipeline/partition.h"
#include "pipeline/schedule.h"
#include "sync/buckets.h"
#include "sync/compression.h"

namespace caravan::sim {

int64_t Workload::parameterTotal() const {
  return std::accumulate(parameterBytes.begin(), parameterBytes.end(), int64_t{0});
}

int Workload::stateFactor() const {
  const int64_t p = parameterTotal();
  return p > 0 ? static_cast<int>((optimizerStateBytes + p / 2) / p) : 0;
}

double Workload::computeSeconds() const {
  return std::accumulate(forwardSeconds.begin(), forwardSeconds.end(), 0.0) + lossSeconds +
         std::accumulate(backwardSeconds.begin(), backwardSeconds.end(), 0.0);
}

std::vector<GradientBucket> gradientBuckets(const Workload& workload,
                                            const AllReduceOptions& options) {
  // Each parameter's bytes and block, in the order backward makes them ready (the last
  // registered first), as AllReduceStrategy::layBuckets lists them.
  std::vector<int64_t> bytes;
  std::vector<size_t> block;
  for (size_t k = workload.parameterBytes.size(); k-- > 0;) {
    if (workload.gradientBytes.empty()) {
      bytes.push_back(workload.parameterBytes[k]);
      block.push_back(k);
      continue;
    }
    const std::vector<int64_t>& tensors = workload.gradientBytes.at(k);
    for (auto it = tensors.rbegin(); it != tensors.rend(); ++it) {
      bytes.push_back(*it);
      block.push_back(k);
    }
  }
  const std::vector<size_t> starts =
      bucketStarts(bytes, options.firstBucketBytes, options.bucketBytes);
  std::vector<GradientBucket> buckets;
  for (size_t b = 0; b < starts.size(); ++b) {
    const size_t end = b + 1 < starts.size() ? starts[b + 1] : bytes.size();
    GradientBucket g;
    g.tensors = end - starts[b];
    for (size_t i = starts[b]; i < end; ++i) g.bytes += bytes[i];
    g.readyBlock = block[end - 1];
    buckets.push_back(g);
  }
  return buckets;
}

Compression sentCompression(const SyncOptions& sync) {
  switch (sync.mode) {
    case SyncMode::kAllReduce: return sync.allreduce.compression;
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp:
    case SyncMode::kOsp: return sync.ps.compression;
    case SyncMode::kLocalSgd: return sync.localSgd.compression;
    case SyncMode::kDiloco:
    case SyncMode::kPsDiloco: return sync.diloco.compression;
    case SyncMode::kGossip: return Compression::kNone;
  }
  return Compression::kNone;
}

std::string label(const RunOptions& job) {
  const SyncOptions& sync = job.sync;
  std::string s = syncModeName(sync.mode);
  switch (sync.mode) {
    case SyncMode::kPsSsp: s += fmt::format("({})", sync.ps.staleness); break;
    case SyncMode::kOsp:
      s += sync.osp.autoFraction ? "(auto)" : fmt::format("({:g})", sync.osp.fraction);
      break;
    case SyncMode::kLocalSgd: s += fmt::format("(H={})", sync.localSgd.period); break;
    case SyncMode::kAllReduce:
    case SyncMode::kDiloco:
    case SyncMode::kGossip:
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsDiloco: break;
  }
  if (sentCompression(sync) != Compression::kNone) s += "+" + sync.compressionName;
  if (sync.shard != ShardLevel::kNone) s += fmt::format("+shard({})", shardLevelName(sync.shard));
  if (job.memory.offloadWeights) s += "+offload";
  if (job.pipeline.stages > 1) {
    s += fmt::format("+pipeline({}x{})", job.pipeline.stages, job.pipeline.microBatches);
  }
  return s;
}

std::string unsupported(const RunOptions& job) {
  const SyncOptions& sync = job.sync;
  const char* mode = syncModeName(sync.mode);
  switch (sync.mode) {
    case SyncMode::kAllReduce: break;
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp:
    case SyncMode::kOsp:
      if (sync.servers < 1) return fmt::format("sync.mode = {} needs sync.servers >= 1", mode);
      break;
    case SyncMode::kLocalSgd:
      if (sync.localSgd.postLocalAfter > 0) {
        return "sync.post_local_steps > 0 (a BSP phase before local SGD) is not simulated";
      }
      break;
    case SyncMode::kGossip:
      if (sync.gossip.topology != "ring") {
        return fmt::format("sync.gossip_topology = {} is not simulated (ring is)",
                           sync.gossip.topology);
      }
      break;
    case SyncMode::kDiloco:
    case SyncMode::kPsDiloco:
      return fmt::format(
          "sync.mode = {} is not simulated (allreduce, ps-bsp, ps-asp, ps-ssp, "
          "osp, local-sgd, gossip are)",
          mode);
  }
  if (isQuantized(sentCompression(sync))) {
    return fmt::format("sync.compression = {} (quantized parameter changes) is not simulated",
                       sync.compressionName);
  }
  if (job.pipeline.stages > 1 && sync.mode != SyncMode::kAllReduce) {
    return "pipeline stages are simulated with sync.mode = allreduce between replicas only";
  }
  if (job.memory.offloadWeights && (sync.shard != ShardLevel::kNone || job.pipeline.stages > 1)) {
    return "memory.weights = offload is simulated with sync.shard = none and one pipeline stage";
  }
  if (sync.shard != ShardLevel::kNone &&
      (sync.mode != SyncMode::kAllReduce || job.pipeline.active() ||
       sync.allreduce.compression != Compression::kNone)) {
    return fmt::format(
        "sync.shard = {} is simulated with sync.mode = allreduce, uncompressed, without "
        "pipelines (what caravan train runs)",
        shardLevelName(sync.shard));
  }
  return "";
}

double meanStaleness(const std::vector<int64_t>& histogram) {
  double n = 0.0, sum = 0.0;
  for (size_t gap = 0; gap < histogram.size(); ++gap) {
    n += static_cast<double>(histogram[gap]);
    sum += static_cast<double>(gap) * static_cast<double>(histogram[gap]);
  }
  return n > 0.0 ? sum / n : 0.0;
}

namespace {

// The hosts' links: one outgoing and one incoming per host, each held first come first served.
// Calls must come in non-decreasing `ready` order per link for that to hold (the event loops
// below issue transfers as their events happen).
class Links {
 public:
  explicit Links(const ClusterSpec& c)
      : txFree_(c.hosts, 0.0),
        rxFree_(c.hosts, 0.0),
        txBusy_(c.hosts, 0.0),
        rxBusy_(c.hosts, 0.0),
        alpha_(c.latencySeconds),
        rate_(c.linkBytesPerSecond()),
        shm_(c.shmBytesPerSecond) {}

  // When `bytes` sent from host `src` at `ready` have arrived at host `dst`.
  double transfer(int src, int dst, double bytes, double ready) {
    if (src == dst) return ready + bytes / shm_;
    const double start = std::max({ready, txFree_[src], rxFree_[dst]});
    const double d = alpha_ + bytes / rate_;
    txFree_[src] = rxFree_[dst] = start + d;
    txBusy_[src] += d;
    rxBusy_[dst] += d;
    return start + d;
  }
  double busiest() const {
    double b = 0.0;
    for (size_t h = 0; h < txBusy_.size(); ++h) b = std::max({b, txBusy_[h], rxBusy_[h]});
    return b;
  }

 private:
  std::vector<double> txFree_, rxFree_, txBusy_, rxBusy_;
  double alpha_, rate_, shm_;
};

struct Placement {
  std::vector<int> workerHost, serverHost;
  std::vector<int> workersOnHost;
  int hostsUsed = 0;  // hosts with a worker
  int mostPerHost = 0;
  std::string text;
};

// Workers one per host while there are hosts, then round robin; servers on hosts of their own
// when the cluster has that many more, else beside the workers (server s on host s).
Placement place(int workers, int servers, const ClusterSpec& c) {
  Placement p;
  p.workersOnHost.assign(c.hosts, 0);
  for (int w = 0; w < workers; ++w) {
    p.workerHost.push_back(w % c.hosts);
    ++p.workersOnHost[w % c.hosts];
  }
  const bool own = c.hosts >= workers + servers;
  for (int s = 0; s < servers; ++s) p.serverHost.push_back(own ? workers + s : s % c.hosts);
  p.hostsUsed = std::min(workers, c.hosts);
  p.mostPerHost = *std::max_element(p.workersOnHost.begin(), p.workersOnHost.end());
  p.text = fmt::format("{} worker{} on {} host{}", workers, workers == 1 ? "" : "s", p.hostsUsed,
                       p.hostsUsed == 1 ? "" : "s");
  if (servers > 0) {
    p.text += fmt::format(", {} server{} {}", servers, servers == 1 ? "" : "s",
                          own ? "on hosts of their own" : "beside workers");
  }
  return p;
}

// Lognormal factors with mean 1 and the given coefficient of variation (1 when cv = 0).
class Stragglers {
 public:
  Stragglers(double cv, uint64_t seed) : rng_(seed) {
    const double s2 = std::log1p(cv * cv);
    dist_ = std::lognormal_distribution<double>(-s2 / 2.0, std::sqrt(s2));
    on_ = cv > 0.0;
  }
  double next() { return on_ ? dist_(rng_) : 1.0; }

 private:
  std::mt19937_64 rng_;
  std::lognormal_distribution<double> dist_;
  bool on_ = false;
};

struct Context {
  const Workload& w;
  const RunOptions& job;
  const SyncOptions& sync;          // job.sync
  const PipelineOptions& pipeline;  // job.pipeline
  const ClusterSpec& c;
  const SimOptions& o;
  Placement p;
  std::vector<double> scale;  // per worker: its host's compute contention
};

// The straggler factors of a worker's step in this context (the cluster's cv at the slowest
// worker's compute per step: ClusterSpec::stragglerCvAt).
Stragglers stepNoise(const Context& x) {
  const double maxScale = *std::max_element(x.scale.begin(), x.scale.end());
  return Stragglers(x.c.stragglerCvAt(maxScale * x.w.computeSeconds()), x.o.seed);
}

// A worker's host's own cores (where hosts share a machine's cores: a cgroup's quota, which
// holds even while the others idle): its processes' threads over them.
double hostQuota(const Placement& p, int host, const Workload& w, const ClusterSpec& c) {
  return std::max(1.0, p.workersOnHost[host] * w.threads / c.coresPerHost);
}

// The compute contention of a worker on `host`: its host's quota, and where the hosts share
// cores, every process's threads over them.
double contention(const Placement& p, int host, int workers, const Workload& w,
                  const ClusterSpec& c) {
  const double quota = hostQuota(p, host, w, c);
  if (c.sharedCores > 0.0) return std::max(quota, workers * w.threads / c.sharedCores);
  return quota;
}

// A ring all-reduce of `bytes` between the hosts with workers, after a reduction inside each
// host (and a broadcast back) through memory.
double allReduceSeconds(double bytes, const Placement& p, const ClusterSpec& c) {
  double t = 0.0;
  if (p.mostPerHost > 1) t += 2.0 * bytes / c.shmBytesPerSecond;
  const int h = p.hostsUsed;
  if (h > 1) t += 2.0 * (h - 1) * (c.latencySeconds + bytes / h / c.linkBytesPerSecond());
  return t;
}
double allReduceSentBytes(double bytes, const Placement& p) {
  const int h = p.hostsUsed;
  return h > 1 ? 2.0 * (h - 1) / h * bytes : 0.0;
}

// Wire bytes of a float32 gradient of `bytes` (fp16/bf16 half; top-k an (index, value) pair per
// kept element). int8/int4 are refused before (unsupported).
double wireBytes(double bytes, Compression compression, double topkRatio) {
  switch (compression) {
    case Compression::kFp16:
    case Compression::kBf16: return bytes / 2.0;
    case Compression::kTopK: return 2.0 * topkRatio * bytes;
    case Compression::kNone:
    case Compression::kInt8:
    case Compression::kInt4: return bytes;
  }
  return bytes;
}

// One gradient bucket's exchange: a ring all-reduce, or top-k's all-gather.
struct Exchange {
  double seconds = 0.0, sent = 0.0;
};
Exchange gradientExchange(double bytes, const Context& x) {
  const AllReduceOptions& a = x.sync.allreduce;
  if (a.compression == Compression::kTopK) {
    const double part = wireBytes(bytes, a.compression, a.topkRatio) * x.p.mostPerHost;
    const int h = x.p.hostsUsed;
    Exchange e;
    if (h > 1) {
      e.seconds = (h - 1) * (x.c.latencySeconds + part / x.c.linkBytesPerSecond());
      e.sent = (h - 1) * part;
    }
    return e;
  }
  const double wire = wireBytes(bytes, a.compression, a.topkRatio);
  return {allReduceSeconds(wire, x.p, x.c), allReduceSentBytes(wire, x.p)};
}

struct Totals {
  double wall = 0.0, compute = 0.0, sent = 0.0, linkBusy = 0.0;
  std::vector<int64_t> staleness;
  // > 0: the contention the mode applied itself (pipelines: the most contended stage's, from
  // its schedule), else the context's (every worker computing all the time).
  double computeScale = 0.0;
};

// One step's straggler factors: adds every worker's compute (forward, backward and its share of
// the update) to t.compute; returns the slowest worker's factor.
double drawStep(const Context& x, Stragglers& noise, double updateShare, Totals& t) {
  double slowest = 0.0;
  for (int wk = 0; wk < x.o.workers; ++wk) {
    const double f = noise.next() * x.scale[wk];
    slowest = std::max(slowest, f);
    t.compute += f * x.w.computeSeconds() + x.scale[wk] * x.w.updateSeconds * updateShare;
  }
  return slowest;
}

// allreduce: buckets in backward order, each started when the slowest worker produced it.
Totals simulateAllReduce(const Context& x) {
  struct Bucket {
    double readyOffset;  // seconds from the step's start on a worker with factor 1
    double bytes;
  };
  const size_t n = x.w.forwardSeconds.size();
  // When each block's backward ends, from the step's start on a worker with factor 1.
  std::vector<double> backwardEnd(n);
  double cum =
      std::accumulate(x.w.forwardSeconds.begin(), x.w.forwardSeconds.end(), 0.0) + x.w.lossSeconds;
  for (size_t k = n; k-- > 0;) backwardEnd[k] = cum += x.w.backwardSeconds[k];
  // As AllReduceStrategy forms them; a bucket is ready when its last parameter's block ended
  // its backward.
  std::vector<Bucket> buckets;
  for (const GradientBucket& g : gradientBuckets(x.w, x.sync.allreduce)) {
    buckets.push_back({backwardEnd[g.readyBlock], static_cast<double>(g.bytes)});
  }
  Stragglers noise = stepNoise(x);
  Totals t;
  const double maxScale = *std::max_element(x.scale.begin(), x.scale.end());
  for (int64_t step = 0; step < x.o.steps; ++step) {
    const double slowest = drawStep(x, noise, 1.0, t);
    const double start = t.wall;
    double done = start;
    for (const Bucket& b : buckets) {
      const Exchange e = gradientExchange(b.bytes, x);
      done = std::max(done, start + slowest * b.readyOffset) + e.seconds;
      t.sent += e.sent * x.p.hostsUsed;  // one process per host sends (the host's leader)
      t.linkBusy += e.seconds;
    }
    done = std::max(done, start + slowest * x.w.computeSeconds());
    t.wall = done + maxScale * x.w.updateSeconds;
  }
  return t;
}

// allreduce with sync.shard (sync/sharding.h): one unit per block. Every worker's collectives go
// through one queue in issue order: the reduce-scatter of a block as its backward ends; the
// update of a 1/W slice; then the all-gathers: every block's at once after the update (optimizer,
// gradients; the next forward waits for each block's) or (parameters) each block's before its
// forward and again before its backward, the next one issued as a prefetch. A reduce-scatter or
// an all-gather moves half an all-reduce's bytes.
Totals simulateSharded(const Context& x) {
  const size_t n = x.w.forwardSeconds.size();
  const bool parameters = x.sync.shard == ShardLevel::kParameters;
  const double workers = static_cast<double>(x.o.workers);
  auto half = [&](int64_t size) {
    const auto bytes = static_cast<double>(size);
    return Exchange{0.5 * allReduceSeconds(bytes, x.p, x.c), 0.5 * allReduceSentBytes(bytes, x.p)};
  };
  // What a block's gather moves: under parameters its bf16-gathered weights at 2 bytes.
  auto gatherSize = [&](size_t block) {
    return parameters && !x.w.gatherBytes.empty() ? x.w.gatherBytes[block]
                                                  : x.w.parameterBytes[block];
  };
  Stragglers noise = stepNoise(x);
  Totals t;
  const double maxScale = *std::max_element(x.scale.begin(), x.scale.end());
  for (int64_t step = 0; step < x.o.steps; ++step) {
    const double slowest = drawStep(x, noise, 1.0 / workers, t);
    double queue = t.wall;                  // when the collectives' queue is free
    std::vector<double> gathered(n, -1.0);  // when block k's weights are in (-1: not issued)
    auto issue = [&](size_t k, double at) {
      if (k >= n || gathered[k] >= 0.0) return;
      if (x.w.parameterBytes[k] == 0) {
        gathered[k] = at;
        return;
      }
      const Exchange e = half(gatherSize(k));
      gathered[k] = queue = std::max(queue, at) + e.seconds;
      t.sent += e.sent * x.p.hostsUsed;
      t.linkBusy += e.seconds;
    };
    double now = t.wall;
    if (!parameters) {
      for (size_t k = 0; k < n; ++k) issue(k, now);  // after the previous update
    }
    for (size_t k = 0; k < n; ++k) {
      issue(k, now);
      if (parameters) issue(k + 1, now);
      now = std::max(now, gathered[k]) + slowest * x.w.forwardSeconds[k];
    }
    now += slowest * x.w.lossSeconds;
    if (parameters) {
      const double last = gathered[n - 1];
      std::fill(gathered.begin(), gathered.end(), -1.0);
      gathered[n - 1] = last;  // the last block stays for its backward
    }
    for (size_t k = n; k-- > 0;) {
      if (parameters) {
        issue(k, now);
        if (k > 0) issue(k - 1, now);
      }
      now = std::max(now, gathered[k]) + slowest * x.w.backwardSeconds[k];
      if (x.w.parameterBytes[k] > 0) {
        const Exchange e = half(x.w.parameterBytes[k]);  // the block's reduce-scatter (float32)
        queue = std::max(queue, now) + e.seconds;
        t.sent += e.sent * x.p.hostsUsed;
        t.linkBusy += e.seconds;
      }
    }
    t.wall = std::max(now, queue) + maxScale * x.w.updateSeconds / workers;
  }
  return t;
}

// local-sgd: H steps on each worker alone, then a barrier and the parameters' all-reduce.
Totals simulateLocalSgd(const Context& x) {
  Stragglers noise = stepNoise(x);
  Totals t;
  std::vector<double> at(x.o.workers, 0.0);
  const double params = static_cast<double>(x.w.parameterTotal());
  for (int64_t step = 0; step < x.o.steps; ++step) {
    for (int wk = 0; wk < x.o.workers; ++wk) {
      const double d =
          noise.next() * x.scale[wk] * x.w.computeSeconds() + x.scale[wk] * x.w.updateSeconds;
      at[wk] += d;
      t.compute += d;
    }
    if ((step + 1) % x.sync.localSgd.period == 0 || step + 1 == x.o.steps) {
      const double barrier = *std::max_element(at.begin(), at.end());
      const double e = allReduceSeconds(params, x.p, x.c);
      std::fill(at.begin(), at.end(), barrier + e);
      t.sent += allReduceSentBytes(params, x.p) * x.p.hostsUsed;
      t.linkBusy += e;
    }
  }
  t.wall = *std::max_element(at.begin(), at.end());
  return t;
}

// gossip (sync/gossip.cpp): a worker sends its parameters of step t to its ring neighbours as
// step t starts, computes, and ends the step once its neighbours' parameters of step t are in.
// An event loop, so the links serve transfers in time order.
Totals simulateGossip(const Context& x) {
  Stragglers noise = stepNoise(x);
  Links links(x.c);
  Totals t;
  const int n = x.o.workers;
  const double params = static_cast<double>(x.w.parameterTotal());
  auto neighbours = [n](int w) {
    std::vector<int> out;
    if (n > 1) out.push_back((w + 1) % n);
    if (n > 2) out.push_back((w + n - 1) % n);
    return out;
  };
  struct Event {
    double time;
    int64_t seq;
    int worker;
    int64_t step;
    bool operator<(const Event& o) const { return time != o.time ? time > o.time : seq > o.seq; }
  };
  std::priority_queue<Event> events;
  int64_t seq = 0;
  std::vector<int64_t> stepOf(n, 0);
  std::vector<double> computeEnd(n, -1.0), ownSent(n, 0.0);         // gossip.cpp waits for both
  std::map<std::pair<int, int64_t>, std::pair<size_t, double>> in;  // (worker, step): arrived
  auto tryFinish = [&](int w, int64_t step) {
    if (stepOf[w] != step || computeEnd[w] < 0.0) return;
    const auto it = in.find({w, step});
    const size_t got = it == in.end() ? 0 : it->second.first;
    if (got < neighbours(w).size()) return;
    const double end =
        std::max({computeEnd[w], ownSent[w], it == in.end() ? 0.0 : it->second.second});
    if (it != in.end()) in.erase(it);
    computeEnd[w] = -1.0;
    stepOf[w] = step + 1;
    t.wall = std::max(t.wall, end);
    if (step + 1 < x.o.steps) events.push({end, seq++, w, step + 1});
  };
  for (int w = 0; w < n; ++w) events.push({0.0, seq++, w, 0});
  while (!events.empty()) {
    const Event e = events.top();
    events.pop();
    const double d = noise.next() * x.scale[e.worker] * x.w.computeSeconds() +
                     x.scale[e.worker] * x.w.updateSeconds;
    t.compute += d;
    computeEnd[e.worker] = e.time + d;
    ownSent[e.worker] = e.time;
    for (int nb : neighbours(e.worker)) {
      const int from = x.p.workerHost[e.worker], to = x.p.workerHost[nb];
      const double a = links.transfer(from, to, params, e.time);
      ownSent[e.worker] = std::max(ownSent[e.worker], a);
      if (from != to) t.sent += params;
      auto& got = in[{nb, e.step}];
      ++got.first;
      got.second = std::max(got.second, a);
      tryFinish(nb, e.step);
    }
    tryFinish(e.worker, e.step);
  }
  t.linkBusy = links.busiest();
  return t;
}

// Parameter servers and OSP (sync/parameter_server.cpp, sync/osp.cpp): an event loop over
// pushes, server updates and pulls.
// How the servers of a mode treat pushes: osp's two stages; synchronous (a server updates once
// every worker's push of a step is in: ps-bsp, osp) or on each push, answering a pull while the
// reader is at most `bound` clocks ahead (ps-ssp: sync.staleness; ps-asp: -1, unbounded).
struct ServerRule {
  bool osp = false;
  bool synchronous = false;
  int64_t bound = 0;
};
ServerRule serverRule(const SyncOptions& sync) {
  switch (sync.mode) {
    case SyncMode::kPsBsp: return {false, true, 0};
    case SyncMode::kPsAsp: return {false, false, -1};
    case SyncMode::kPsSsp: return {false, false, sync.ps.staleness};
    case SyncMode::kOsp: return {true, true, 0};
    case SyncMode::kAllReduce:
    case SyncMode::kLocalSgd:
    case SyncMode::kDiloco:
    case SyncMode::kGossip:
    case SyncMode::kPsDiloco: break;
  }
  CARAVAN_CHECK(false, "sync.mode = {} has no parameter servers to simulate",
                syncModeName(sync.mode));
  return {};
}

class ServerLoop {
 public:
  ServerLoop(const Context& x, double fraction)
      : x_(x),
        links_(x.c),
        noise_(stepNoise(x)),
        n_(x.o.workers),
        s_(x.sync.servers),
        rule_(serverRule(x.sync)),
        osp_(rule_.osp),
        fraction_(osp_ ? fraction : 1.0),
        bound_(rule_.bound),
        workers_(n_),
        clock_(s_, std::vector<int64_t>(n_, 0)),
        waiting_(s_) {
    const double shard = static_cast<double>(x.w.parameterTotal()) / s_;
    pushBytes_ = wireBytes(shard, x.sync.ps.compression, x.sync.ps.topkRatio);
    pullBytes_ = shard;
    shardUpdate_ = x.w.updateSeconds / s_;
    serverFree_.assign(s_, 0.0);
  }

  Totals run() {
    for (int wk = 0; wk < n_; ++wk) startCompute(wk, 0, 0.0);
    while (!events_.empty()) {
      const Event e = events_.top();
      events_.pop();
      now_ = e.time;
      handle(e);
    }
    t_.linkBusy = links_.busiest();
    t_.wall = now_;
    return std::move(t_);
  }

 private:
  enum Kind { kComputeDone, kPushArrive, kServerDone, kPullArrive };
  struct Event {
    double time;
    int64_t seq;
    Kind kind;
    int worker, server;
    int64_t step;
    int stage;                              // 1, or 2 (osp's second stage)
    bool operator<(const Event& o) const {  // the priority queue's top is the earliest
      return time != o.time ? time > o.time : seq > o.seq;
    }
  };
  struct Worker {
    std::map<std::pair<int64_t, int>, int> pulls;  // (step, stage) -> pulls arrived
    std::map<int64_t, bool> stage2Back;            // osp: steps whose stage 2 is all back
    int64_t heldPush = -1;  // osp: a step whose stage-1 push waits for the stage 2 before it
  };

  void post(double time, Kind kind, int worker, int server, int64_t step, int stage) {
    events_.push({time, seq_++, kind, worker, server, step, stage});
  }
  double bytes(int stage, double full) const {
    return (stage == 1 ? fraction_ : 1.0 - fraction_) * full;
  }

  void startCompute(int wk, int64_t step, double at) {
    if (step >= x_.o.steps) return;
    double d = noise_.next() * x_.scale[wk] * x_.w.computeSeconds();
    if (osp_ && x_.sync.osp.lgp) {  // the LGP update of the stage-2 part, on the worker
      d += x_.scale[wk] * x_.w.updateSeconds * (1.0 - fraction_);
    }
    t_.compute += d;
    post(at + d, kComputeDone, wk, -1, step, 1);
  }

  void push(int wk, int64_t step, int stage) {
    for (int sv = 0; sv < s_; ++sv) {
      const double b = bytes(stage, pushBytes_);
      const double a = links_.transfer(x_.p.workerHost[wk], x_.p.serverHost[sv], b, now_);
      if (x_.p.workerHost[wk] != x_.p.serverHost[sv]) t_.sent += b;
      post(a, kPushArrive, wk, sv, step, stage);
    }
  }
  void pull(int sv, int wk, int64_t step, int stage) {
    const double a =
        links_.transfer(x_.p.serverHost[sv], x_.p.workerHost[wk], bytes(stage, pullBytes_), now_);
    post(a, kPullArrive, wk, sv, step, stage);
  }

  void handle(const Event& e) {
    switch (e.kind) {
      case kComputeDone: {
        Worker& w = workers_[e.worker];
        // osp: step t's stage 1 goes once step t - 1's stage 2 is back (osp.cpp drainStage2).
        if (osp_ && fraction_ < 1.0 && e.step >= 1 && w.stage2Back.count(e.step - 1) == 0) {
          w.heldPush = e.step;
          break;
        }
        w.stage2Back.erase(e.step - 1);
        push(e.worker, e.step, 1);
        break;
      }
      case kPushArrive: {
        const double start = std::max(now_, serverFree_[e.server]);
        if (rule_.synchronous) {  // update once all N are in
          std::vector<int>& arrived = rounds_[{e.server, e.step, e.stage}];
          arrived.push_back(e.worker);
          if (static_cast<int>(arrived.size()) < n_) break;
          serverFree_[e.server] = start + bytes(e.stage, shardUpdate_);
          post(serverFree_[e.server], kServerDone, -1, e.server, e.step, e.stage);
        } else {  // asp/ssp: applied on arrival
          serverFree_[e.server] = start + shardUpdate_;
          post(serverFree_[e.server], kServerDone, e.worker, e.server, e.step, 1);
        }
        break;
      }
      case kServerDone:
        if (e.worker < 0) {
          auto it = rounds_.find({e.server, e.step, e.stage});
          for (int wk : it->second) pull(e.server, wk, e.step, e.stage);
          rounds_.erase(it);
        } else {
          applied(e);
        }
        break;
      case kPullArrive: pulled(e); break;
    }
  }

  // asp/ssp: a push applied on server `e.server`, whose clocks are its own (as each server's
  // in parameter_server.cpp): the pusher's clock advances, then every pull waiting there whose
  // reader is within the bound of that server's slowest clock is answered. The staleness of a
  // read is the reader's clock less the slowest's, the most over the servers (as the worker
  // records it).
  void applied(const Event& e) {
    std::vector<int64_t>& clock = clock_[e.server];
    clock[e.worker] = e.step + 1;
    auto& waiting = waiting_[e.server];
    waiting.push_back({e.worker, e.step});
    const int64_t slowest = *std::min_element(clock.begin(), clock.end());
    for (auto it = waiting.begin(); it != waiting.end();) {
      const int64_t gap = clock[it->first] - slowest;
      if (bound_ >= 0 && gap > bound_) {
        ++it;
        continue;
      }
      auto& [replies, most] = gaps_[{it->first, it->second}];
      most = std::max(most, gap);
      if (++replies == s_) {
        if (t_.staleness.size() <= static_cast<size_t>(most)) t_.staleness.resize(most + 1, 0);
        ++t_.staleness[most];
        gaps_.erase({it->first, it->second});
      }
      pull(e.server, it->first, it->second, 1);
      it = waiting.erase(it);
    }
  }

  void pulled(const Event& e) {
    Worker& w = workers_[e.worker];
    if (++w.pulls[{e.step, e.stage}] < s_) return;
    w.pulls.erase({e.step, e.stage});
    if (e.stage == 2) {
      w.stage2Back[e.step] = true;
      if (w.heldPush == e.step + 1) {  // step + 1's stage 1 waited for this stage 2
        w.heldPush = -1;
        w.stage2Back.erase(e.step);
        push(e.worker, e.step + 1, 1);
      }
      return;
    }
    if (osp_ && fraction_ < 1.0) push(e.worker, e.step, 2);
    startCompute(e.worker, e.step + 1, now_);
  }

  const Context& x_;
  Links links_;
  Stragglers noise_;
  int n_, s_;
  ServerRule rule_;
  bool osp_;
  double fraction_;
  int64_t bound_;  // 0 bsp, s for ssp, -1 asp
  double pushBytes_ = 0.0, pullBytes_ = 0.0, shardUpdate_ = 0.0;
  std::vector<double> serverFree_;
  std::vector<Worker> workers_;
  std::vector<std::vector<int64_t>> clock_;                           // server -> worker -> clock
  std::vector<std::vector<std::pair<int, int64_t>>> waiting_;         // server -> (worker, step)
  std::map<std::pair<int, int64_t>, std::pair<int, int64_t>> gaps_;   // read -> (replies, most)
  std::map<std::tuple<int, int64_t, int>, std::vector<int>> rounds_;  // workers in push order
  std::priority_queue<Event> events_;
  int64_t seq_ = 0;
  double now_ = 0.0;
  Totals t_;
};

// The share of a time at `examples` (below the last point): on the line through the two points
// around it (points in ascending examples). Below the first point, the line through the first
// two, kept between the first point's share in proportion (no fixed cost) and its share itself
// (no cheaper than the smaller batch). One point (the full batch alone): in proportion.
double shareAt(const std::vector<std::pair<double, double>>& points, double examples) {
  const auto [x0, y0] = points[0];
  if (points.size() == 1) return y0 * examples / x0;
  size_t i = 1;
  while (i + 1 < points.size() && points[i].first < examples) ++i;
  const auto [xa, ya] = points[i - 1];
  const auto [xb, yb] = points[i];
  const double share = ya + (yb - ya) * (examples - xa) / (xb - xa);
  if (examples >= x0) return share;
  return std::clamp(share, y0 * examples / x0, y0);
}

}  // namespace

Workload perMicroBatch(const Workload& workload, int microBatches) {
  const int m = std::max(1, microBatches);
  Workload w = workload;
  if (m == 1 || workload.batchPerWorker < 1) return w;
  w.smallerBatches.clear();  // the shares are the full batch's: a micro-batch's is not shrunk again
  const double full = static_cast<double>(workload.batchPerWorker);
  const double examples = full / m;
  auto share = [&](auto pick) {  // pick(BatchShare) -> its share of this time
    std::vector<std::pair<double, double>> points;
    for (const Workload::BatchShare& p : workload.smallerBatches) {
      points.emplace_back(p.examples, pick(p));
    }
    points.emplace_back(full, 1.0);
    return shareAt(points, examples);
  };
  for (size_t b = 0; b < w.forwardSeconds.size(); ++b) {
    const double forward = share([b](const Workload::BatchShare& p) { return p.forward[b]; });
    const double backward = share([b](const Workload::BatchShare& p) { return p.backward[b]; });
    w.forwardSeconds[b] *= forward;
    w.backwardSeconds[b] *= backward;
    w.inputBytes[b] /= m;
    if (b < w.planner.keepBackwardSeconds.size()) {
      w.planner.keepBackwardSeconds[b] *= backward;
      w.planner.savedBytes[b] /= m;
    }
  }
  w.planner.lossSavedBytes /= m;
  w.lossSeconds *= share([](const Workload::BatchShare& p) { return p.loss; });
  w.activationPeakBytes /= m;
  w.batchPerWorker = std::max<int64_t>(1, w.batchPerWorker / m);
  return w;
}

std::vector<size_t> pipelineCut(const Workload& workload, const PipelineOptions& pipeline) {
  const int k = pipeline.stages, m = std::max(1, pipeline.microBatches);
  const Workload micro = perMicroBatch(workload, m);
  const size_t n = workload.forwardSeconds.size();
  std::vector<BlockCost> blocks(n);
  for (size_t b = 0; b < n; ++b) {
    blocks[b].forwardSeconds = micro.forwardSeconds[b];
    blocks[b].backwardSeconds = micro.backwardSeconds[b];
    blocks[b].parameterBytes = workload.parameterBytes[b];
    blocks[b].inputBytes = micro.inputBytes[b];
  }
  const PartitionChoice choice = parsePartition(pipeline.partition);
  return partitionBlocks(blocks, k, m, pipeline.schedule, 0, choice.objective, false,
                         choice.objective == PartitionObjective::kGiven
                             ? givenPartition(choice.splits, n, k)
                             : std::vector<size_t>{})
      .boundaries;
}

namespace {

// The period a cgroup's CPU quota is given per (CFS's default; scripts/netns_hosts.sh's).
constexpr double kQuotaPeriodSeconds = 0.1;

// Pipelines: K stages cut by profiled time, M micro-batches, then the stages' all-reduce.
Totals simulatePipeline(const Context& x) {
  const int k = x.pipeline.stages, m = x.pipeline.microBatches;
  const std::vector<size_t> begin = pipelineCut(x.w, x.pipeline);
  const Workload micro = perMicroBatch(x.w, m);  // one micro-batch's times and activations
  const int replicas = x.o.workers / k;
  std::vector<double> stageForward(k, 0.0), stageBackward(k, 0.0), stageParams(k, 0.0);
  std::vector<StageCosts> costs(k);
  double activationsSent = 0.0;  // per pipeline and step: activations and their gradients
  for (int s = 0; s < k; ++s) {
    for (size_t b = begin[s]; b < begin[s + 1]; ++b) {
      stageForward[s] += micro.forwardSeconds[b];
      stageBackward[s] += micro.backwardSeconds[b];
      stageParams[s] += static_cast<double>(x.w.parameterBytes[b]);
    }
    if (s == k - 1) stageForward[s] += micro.lossSeconds;
    // A stage's receives: activations across its first cut, gradients across its last (the
    // schedule's simulation has one transfer time per receiving stage: the larger of the two).
    double boundary = 0.0;
    if (s > 0) boundary = static_cast<double>(micro.inputBytes[begin[s]]);
    if (s + 1 < k) {
      boundary = std::max(boundary, static_cast<double>(micro.inputBytes[begin[s + 1]]));
    }
    const bool sameHost = x.p.workerHost[s] == x.p.workerHost[s > 0 ? s - 1 : 1];
    costs[s].transfer = sameHost ? boundary / x.c.shmBytesPerSecond
                                 : x.c.latencySeconds + boundary / x.c.linkBytesPerSecond();
    if (s + 1 < k && x.p.workerHost[s] != x.p.workerHost[s + 1]) {
      activationsSent += 2.0 * static_cast<double>(x.w.inputBytes[begin[s + 1]]);
    }
  }
  const std::vector<StageProgram> programs = buildSchedule(x.pipeline.schedule, k, m);
  // Where hosts share a machine's cores, a host's own (a cgroup's quota of cores_per_host per
  // 100 ms period, scripts/netns_hosts.sh) are a budget: a stage computes at the machine's speed
  // until its host has used the period's quota, across its actions, then waits for the next
  // period (the schedule's simulation keeps the budget: StageCosts). So short actions after an
  // idle stretch run unthrottled, and a stage computing more than its share of a period waits
  // (brown-gpt's 2-stage pipelines on 4 namespace hosts: a 16-example micro-batch's backward,
  // ~75 ms of one core, measured 20-30% slower per step than 4-example ones predicted alone).
  // Computing at 1 / scale of a core (sharing cores), a stage spends its CPU budget that much
  // slower. A host's processes split its quota evenly, each its own budget (one stage per host
  // in the layouts measured; a cgroup would let one use what another leaves), and the update
  // after the schedule runs outside it. Cgroups' period timers start wherever they start: with
  // stragglers drawn, each of the min(steps, 32) drawn steps gives every host's period a random
  // start (an estimate of the mean over phases); without, replica 0's schedule alone with host
  // h's period h / hosts after host 0's. The contention's fixed point always uses the latter.
  std::vector<double> quota(k, 1.0);  // > 1: the host's cores are such a budget
  for (int s = 0; s < k; ++s) {
    if (x.c.sharedCores > 0.0) quota[s] = hostQuota(x.p, x.p.workerHost[s], x.w, x.c);
  }
  // The schedule with each stage's contention `scale`, straggler factor `factor` and its host's
  // quota period's start `phase` (seconds).
  auto run = [&](const std::vector<double>& scale, const std::vector<double>& factor,
                 const std::vector<double>& phase) {
    for (int s = 0; s < k; ++s) {
      const double f = factor[s] * scale[s];
      costs[s].forward = f * stageForward[s];
      costs[s].backwardInput = f * stageBackward[s] / 2.0;
      costs[s].backwardWeight = costs[s].backwardInput;
      if (quota[s] > 1.0) {
        costs[s].quotaPeriod = kQuotaPeriodSeconds;
        costs[s].quotaBudget = kQuotaPeriodSeconds / quota[s] * scale[s];
        costs[s].quotaPhase = phase[s];
      }
    }
    return simulateSchedule(programs, costs);
  };
  const std::vector<double> steady(k, 1.0);  // no straggler
  // Each stage's quota phase in replica r's schedule, from its host's (`hostPhase`).
  auto stagePhases = [&](int r, const std::vector<double>& hostPhase) {
    std::vector<double> phase(k);
    for (int s = 0; s < k; ++s) phase[s] = hostPhase[x.p.workerHost[r * k + s]];
    return phase;
  };
  std::vector<double> evenly(x.c.hosts);  // host h's period h / hosts after host 0's
  for (int h = 0; h < x.c.hosts; ++h) evenly[h] = kQuotaPeriodSeconds * h / x.c.hosts;
  const std::vector<double> apart = stagePhases(0, evenly);
  // The replicas of each stage all-reduce its gradients (hosts: one per replica).
  Placement replicaHosts;
  replicaHosts.hostsUsed = std::min(replicas, x.c.hosts);
  replicaHosts.mostPerHost = (replicas + x.c.hosts - 1) / x.c.hosts;
  double exchange = 0.0, sent = 0.0;
  for (int s = 0; s < k && replicas > 1; ++s) {
    exchange = std::max(exchange, allReduceSeconds(stageParams[s], replicaHosts, x.c));
    sent += allReduceSentBytes(stageParams[s], replicaHosts) / k;
  }
  // Processes that share cores contend only while they compute, and a pipeline's stages compute
  // together (its replicas in step): each stage computes slower by the processes computing
  // beside it, on average over its own computing time in the schedule (each replica's stage
  // alike), over the cores they share (the machine's where hosts share one, else its host's),
  // found as a fixed point (from none, a few rounds settle it). Where hosts share a machine's
  // cores, a host's own cores (a cgroup's quota) are a budget per period rather than a speed: a
  // stage computes at the machine's speed while its host has quota left, so the quota bounds the
  // step from below (each host computes its stages' work in its cores' time at most). Measured
  // on 4 namespace hosts (bench/layout_search.py, brown-gpt 4x4): the first stage, idle beside
  // the others' forwards, computed at 1.4x its profile, the middle ones at 2.1x.
  // Worker w runs stage w % K on host w % hosts (place): the processes of each stage per host.
  std::vector<std::vector<int>> onHost(x.c.hosts, std::vector<int>(k, 0));
  for (int wk = 0; wk < x.o.workers; ++wk) ++onHost[x.p.workerHost[wk]][wk % k];
  const bool shared = x.c.sharedCores > 0.0;
  // The processes of stage o sharing cores with stage s's (replica 0's, on its host): every
  // replica's where the hosts share a machine's cores, else those on s's host.
  auto beside = [&](int s, int o) {
    return shared ? static_cast<double>(replicas)
                  : static_cast<double>(onHost[x.p.workerHost[s]][o]);
  };
  const double cores = shared ? x.c.sharedCores : x.c.coresPerHost;
  // The time two stages' spans overlap (each stage's in time order, apart: one sweep).
  auto overlap = [](const std::vector<ScheduleSpan>& a, const std::vector<ScheduleSpan>& b) {
    double both = 0.0;
    for (size_t i = 0, j = 0; i < a.size() && j < b.size();) {
      both += std::max(0.0, std::min(a[i].end, b[j].end) - std::max(a[i].start, b[j].start));
      if (a[i].end < b[j].end) {
        ++i;
      } else {
        ++j;
      }
    }
    return both;
  };
  // The least compute a step takes for its work, with worker w's straggler factor factor(w):
  // each host's work over its own cores (a quota's budget or its cores) and, where the hosts
  // share a machine's cores, everyone's over those.
  auto leastCompute = [&](auto factor) {
    std::vector<double> work(x.c.hosts, 0.0);
    for (int wk = 0; wk < x.o.workers; ++wk) {
      const int o = wk % k;
      work[x.p.workerHost[wk]] +=
          factor(wk) * (m * (stageForward[o] + stageBackward[o]) + x.w.updateSeconds / k);
    }
    double least = 0.0, total = 0.0;
    for (double v : work) {
      least = std::max(least, v * x.w.threads / x.c.coresPerHost);
      total += v;
    }
    return shared ? std::max(least, total * x.w.threads / x.c.sharedCores) : least;
  };
  // Each stage's contention from a schedule's spans (the processes computing beside its own
  // actions, on average, over the cores they share).
  auto contention = [&](const ScheduleSimulation& sim) {
    std::vector<double> next(k, 1.0);
    for (int s = 0; s < k; ++s) {
      if (sim.busy[s] <= 0.0) continue;
      double together = 0.0;  // processes computing beside s (s included), integrated over s's
      for (int o = 0; o < k; ++o) together += beside(s, o) * overlap(sim.spans[s], sim.spans[o]);
      next[s] = std::max(1.0, together / sim.busy[s] * x.w.threads / cores);
    }
    return next;
  };
  // The fixed point: from none, a few rounds (halfway steps after the first few, against a
  // cycle) settle every stage's contention.
  std::vector<double> scale(k, 1.0);
  for (int round = 0; round < 40; ++round) {
    const std::vector<double> next = contention(run(scale, steady, apart));
    double moved = 0.0;
    for (int s = 0; s < k; ++s) moved = std::max(moved, std::abs(next[s] - scale[s]));
    for (int s = 0; s < k; ++s) scale[s] = round < 4 ? next[s] : (scale[s] + next[s]) / 2.0;
    if (moved < 1e-9) break;
  }
  const ScheduleSimulation one = run(scale, steady, apart);
  const double slowest = *std::max_element(scale.begin(), scale.end());
  double busy = 0.0;  // every stage's compute per step
  for (double b : one.busy) busy += b;
  // A step: the slowest replica's schedule and the update (at the slowest stage's contention),
  // at least the least compute, then the exchange. Stragglers as the other modes draw them:
  // each worker's actions per step by its own factor (each replica's schedule run with its
  // own), the mean over min(steps, 32) steps drawn; with no straggler_cv, the schedule as it is.
  const double update = slowest * x.w.updateSeconds / k;
  double stepSeconds =
      std::max(one.makespan + update, leastCompute([](int) { return 1.0; })) + exchange;
  if (x.c.stragglerCv > 0.0) {
    Stragglers noise(x.c.stragglerCvAt(busy / k), x.o.seed);  // a stage's compute, on average
    const int64_t drawn = std::min<int64_t>(x.o.steps, 32);
    std::vector<std::vector<double>> factor(replicas, std::vector<double>(k));
    // Each drawn step's hosts' quota periods start anywhere (a cgroup's timer starts where it
    // starts, and a step where the last one ended): drawn apart from the stragglers' numbers.
    std::mt19937_64 phases(x.o.seed + 1);
    std::uniform_real_distribution<double> within(0.0, kQuotaPeriodSeconds);
    std::vector<double> hostPhase(x.c.hosts);
    double total = 0.0;
    for (int64_t i = 0; i < drawn; ++i) {
      for (double& h : hostPhase) h = within(phases);
      double slowestReplica = 0.0;
      for (int r = 0; r < replicas; ++r) {
        std::vector<double>& replica = factor[r];
        for (double& f : replica) f = noise.next();
        slowestReplica = std::max(slowestReplica,
                                  run(scale, replica, stagePhases(r, hostPhase)).makespan + update);
      }
      const double least = leastCompute([&](int wk) { return factor[wk / k][wk % k]; });
      total += std::max(slowestReplica, least) + exchange;
    }
    stepSeconds = total / static_cast<double>(drawn);
  }
  Totals t;
  t.wall = stepSeconds * x.o.steps;
  t.compute = busy * replicas * x.o.steps;
  t.sent = (sent * x.o.workers + activationsSent * replicas) * x.o.steps;
  t.linkBusy = exchange * x.o.steps;
  t.computeScale = slowest;
  return t;
}

// Whether the workers run the optimizer's step themselves (and hold its state).
bool workerUpdates(SyncMode mode) {
  switch (mode) {
    case SyncMode::kAllReduce:
    case SyncMode::kLocalSgd:
    case SyncMode::kDiloco:
    case SyncMode::kGossip:
    case SyncMode::kPsDiloco: return true;
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp:
    case SyncMode::kOsp: return false;
  }
  return true;
}

}  // namespace

int64_t modelStateBytes(const Workload& w, const RunOptions& job, int workers) {
  if (job.memory.offloadWeights) return w.offload.windowBytes;
  const int64_t p = w.parameterTotal();
  if (job.sync.shard != ShardLevel::kNone) {
    // ZeRO's accounting, and (parameters) the two largest blocks gathered at once (one running,
    // one prefetched; bf16-gathered weights at 2 bytes).
    int64_t bytes = shardedModelState(job.sync.shard, p, w.stateFactor(), workers).total();
    if (job.sync.shard == ShardLevel::kParameters) {
      std::vector<int64_t> blocks = w.gatherBytes.empty() ? w.parameterBytes : w.gatherBytes;
      std::sort(blocks.rbegin(), blocks.rend());
      for (size_t i = 0; i < std::min<size_t>(2, blocks.size()); ++i) bytes += blocks[i];
    }
    return bytes;
  }
  return 2 * p + (workerUpdates(job.sync.mode) ? w.optimizerStateBytes : 0);
}

namespace {

SimResult finish(const Context& x, const Totals& t, double fraction) {
  SimResult r;
  r.workers = x.o.workers;
  r.mode = label(x.job);
  r.placement = x.p.text;
  const int64_t steps = x.o.steps;
  r.stepSeconds = t.wall / steps;
  const int replicas = x.pipeline.stages > 1 ? x.o.workers / x.pipeline.stages : x.o.workers;
  r.samplesPerSecond = replicas * x.w.batchPerWorker / r.stepSeconds;
  // One worker alone on one host of this cluster.
  const double aloneScale = x.c.sharedCores > 0.0 ? std::max(1.0, x.w.threads / x.c.sharedCores)
                                                  : std::max(1.0, x.w.threads / x.c.coresPerHost);
  const double alone =
      x.w.batchPerWorker / (aloneScale * (x.w.computeSeconds() + x.w.updateSeconds));
  r.scalingEfficiency = r.samplesPerSecond / (x.o.workers * alone);
  r.bytesSentPerStep = t.sent / x.o.workers / steps;
  r.computeUtilisation = t.compute / (x.o.workers * t.wall);
  r.linkUtilisation = t.linkBusy / t.wall;
  r.computeScale =
      t.computeScale > 0.0 ? t.computeScale : *std::max_element(x.scale.begin(), x.scale.end());
  r.ospFraction = fraction;
  r.staleness = t.staleness;
  if (x.pipeline.stages <= 1) {
    r.memoryPeakBytes =
        modelStateBytes(x.w, x.job, x.o.workers) +
        (x.job.memory.offloadWeights ? x.w.offload.activationPeakBytes : x.w.activationPeakBytes);
  }
  return r;
}

// osp: the configured fraction, or (sync.osp_auto_fraction) the fastest on the search's grid
// (ties: the larger one).
SimResult simulateOsp(const Context& x) {
  double fraction = x.sync.osp.fraction;
  if (x.sync.osp.autoFraction) {
    SimOptions probe = x.o;
    probe.steps = std::min<int64_t>(x.o.steps, 30);
    double best = 0.0;
    for (int g = 20; g >= 1; --g) {
      const double f = g * 0.05;
      const Context shorter{x.w, x.job, x.sync, x.pipeline, x.c, probe, x.p, x.scale};
      const double wall = ServerLoop(shorter, f).run().wall;
      if (g == 20 || wall < best * 0.999) {
        best = wall;
        fraction = f;
      }
    }
  }
  return finish(x, ServerLoop(x, fraction).run(), fraction);
}

}  // namespace

SimResult simulate(const Workload& workload, const RunOptions& job, const ClusterSpec& cluster,
                   const SimOptions& options) {
  if (const std::string why = unsupported(job); !why.empty()) throw ConfigError(why);
  if (options.steps < 1) throw ConfigError("simulate needs at least one step");
  if (options.workers < 1) throw ConfigError("simulate needs at least one worker");
  if (workload.forwardSeconds.empty()) throw ConfigError("the workload has no blocks");
  const int stages = job.pipeline.stages;
  if (stages > 1 && options.workers % stages != 0) {
    throw ConfigError(fmt::format("{} workers are not a multiple of {} pipeline stages",
                                  options.workers, stages));
  }
  const int servers = usesServers(job.sync.mode) ? job.sync.servers : 0;
  // Out-of-core weights: the tier's cost on the backward, as the profile's plan folds its own.
  Workload offloaded;
  if (job.memory.offloadWeights) {
    if (!workload.offload.measured) {
      throw ConfigError(
          "the workload has no profile of memory.weights = offload (a workload file from "
          "before it); profile again (drop --workload)");
    }
    offloaded = workload;
    const double backward =
        std::accumulate(workload.backwardSeconds.begin(), workload.backwardSeconds.end(), 0.0);
    if (backward > 0.0) {
      for (double& b : offloaded.backwardSeconds) {
        b *= 1.0 + workload.offload.extraSeconds / backward;
      }
    } else {
      offloaded.lossSeconds += workload.offload.extraSeconds;
    }
  }
  Context x{job.memory.offloadWeights ? offloaded : workload,
            job,
            job.sync,
            job.pipeline,
            cluster,
            options,
            {},
            {}};
  x.p = place(options.workers, servers, cluster);
  for (int wk = 0; wk < options.workers; ++wk) {
    x.scale.push_back(contention(x.p, x.p.workerHost[wk], options.workers, workload, cluster));
  }
  if (stages > 1) return finish(x, simulatePipeline(x), -1.0);
  switch (job.sync.mode) {
    case SyncMode::kAllReduce:
      return finish(
          x, job.sync.shard != ShardLevel::kNone ? simulateSharded(x) : simulateAllReduce(x), -1.0);
    case SyncMode::kLocalSgd: return finish(x, simulateLocalSgd(x), -1.0);
    case SyncMode::kGossip: return finish(x, simulateGossip(x), -1.0);
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp: return finish(x, ServerLoop(x, 1.0).run(), -1.0);
    case SyncMode::kOsp: return simulateOsp(x);
    case SyncMode::kDiloco:
    case SyncMode::kPsDiloco: break;  // refused by unsupported()
  }
  CARAVAN_CHECK(false, "sync.mode = {} reached the simulator", syncModeName(job.sync.mode));
  return {};
}

}  // namespace caravan::sim
