// Rendezvous, communicator and strategy for a data-parallel run (see distributed.h).
#include "train/distributed.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/torch.h>

#include "comm/auth.h"
#include "comm/counting_communicator.h"
#include "comm/factory.h"
#include "comm/liveness.h"
#include "comm/store.h"
#include "sync/allreduce.h"
#include "sync/gossip.h"
#include "sync/local_sgd.h"
#include "sync/osp.h"
#include "sync/parameter_server.h"
#include "train/setup.h"
#include "train/timeline.h"

namespace caravan {

bool usesServers(const std::string& mode) { return mode.rfind("ps-", 0) == 0 || mode == "osp"; }

int serverCount(const Config& config) {
  return usesServers(config.str("sync.mode")) ? static_cast<int>(config.i64("sync.servers")) : 0;
}

namespace {

PsOptions serverOptions(const Config& config) {
  PsOptions o = psOptions(config.str("sync.mode"), config.i64("sync.staleness"));
  o.compression = parseCompression(config.str("sync.compression"));
  o.topkRatio = config.f64("sync.topk_ratio");
  return o;
}

OspOptions ospOptions(const Config& config) {
  OspOptions o;
  o.fraction = config.f64("sync.osp_fraction");
  o.autoFraction = config.flag("sync.osp_auto_fraction");
  o.policy = config.str("sync.osp_policy");
  o.lgp = config.flag("sync.osp_lgp");
  if (config.str("optim.name") == "sgd") o.lgpMomentum = config.f64("optim.momentum");
  o.chunkElements = config.i64("sync.osp_chunk");
  return o;
}

}  // namespace

Distributed::Distributed(const Config& config, const TrainerOptions& options) : config_(config) {
  const auto timeout = std::chrono::milliseconds(
      static_cast<int64_t>(config.f64("fault.timeout") * 1000.0));
  StoreOptions so;
  so.kind = config.str("dist.store");
  so.filePath = config.str("dist.store_path").empty()
                    ? (std::filesystem::path(options.runDir) / "rendezvous").string()
                    : config.str("dist.store_path");
  so.timeout = timeout;
  so.token = options.world.token;
  const std::string& backend = config.str("dist.backend");
  // MPI brings its own wire-up (mpirun); only Gloo rendezvouses through the store.
  c10::intrusive_ptr<c10d::Store> store;
  if (backend != "mpi") store = makeStore(options.world, so);
  world = counted(makeCommunicator(backend, options.world, store, timeout));
  // Gloo's connections carry no credential of their own (comm/auth.h).
  const bool authenticate = backend == "gloo" && !options.world.token.empty();
  if (authenticate) authenticatePeers(*world, options.world.token);
  if (backend == "gloo" && options.world.token.empty() && options.world.rank == 0 &&
      !isLoopbackAddress(options.world.masterAddr)) {
    std::fprintf(stderr,
                 "caravan: warning: %s is not set: any process that reaches %s:%d can join this "
                 "job; give every rank the same secret in %s\n",
                 kJobTokenVariable, options.world.masterAddr.c_str(), options.world.masterPort,
                 kJobTokenVariable);
  }
  comm = world;
  const std::string& mode = config.str("sync.mode");
  servers_ = serverCount(config);
  workers_ = options.world.worldSize - servers_;
  if (workers_ < 1) {
    throw ConfigError(fmt::format("sync.mode {} with sync.servers = {} leaves no worker in a "
                                  "world of {}; start more processes or use fewer servers",
                                  mode, servers_, options.world.worldSize));
  }
  if (servers_ > 0) {
    if (backend != "gloo") {
      throw ConfigError(fmt::format("sync.mode {} runs on dist.backend = gloo only so far", mode));
    }
    // The workers' own group: evaluation, the per-step agreement, the initial broadcast.
    if (!isServer()) {
      WorldInfo group = options.world;
      group.worldSize = workers_;
      comm = counted(makeCommunicator(
          backend, group, c10::make_intrusive<c10d::PrefixStore>("workers", store), timeout));
      if (authenticate) authenticatePeers(*comm, options.world.token);
    }
  }
  if (store) {
    HeartbeatOptions ho;
    ho.workers = workers_;
    ho.hostsStore = so.kind == "tcp" && options.world.rank == 0;
    ho.storeOnRank0 = so.kind == "tcp";
    ho.storeAddress = so.kind == "tcp"
                          ? fmt::format("{}:{}", options.world.masterAddr, options.world.masterPort)
                          : so.filePath;
    ho.stallReport = std::chrono::milliseconds(
        static_cast<int64_t>(config.f64("fault.stall_report") * 1000.0));
    heartbeat_ = std::make_unique<Heartbeat>(store, options.world.rank, options.world.worldSize,
                                             ho);
    // The stall inspector follows the workers' collectives (servers take part in none).
    if (!isServer()) {
      std::shared_ptr<CountingCommunicator> workersComm = counters_.back();
      heartbeat_->setProgressProbe([workersComm] { return workersComm->progress(); });
    }
  }
}

void Distributed::serve() {
  auto optimizer = [this](std::vector<at::Tensor> params) {
    return makeOptimizer(config_, std::move(params));
  };
  auto onStep = [this](int64_t step) { stepDone(step); };
  if (config_.str("sync.mode") == "osp") {
    runOspServer(*world, workers_, ospOptions(config_), optimizer, onStep);
  } else {
    runParameterServer(*world, workers_, serverOptions(config_), optimizer, onStep);
  }
}

std::shared_ptr<Communicator> Distributed::counted(std::shared_ptr<Communicator> inner) {
  auto c = std::make_shared<CountingCommunicator>(std::move(inner));
  counters_.push_back(c);
  return c;
}

ByteCount Distributed::bytes() const {
  ByteCount total;
  for (const auto& c : counters_) {
    const ByteCount b = c->bytes();
    total.sent += b.sent;
    total.received += b.received;
  }
  return total;
}

void Distributed::stepDone(int64_t step) {
  if (heartbeat_) heartbeat_->setStep(step);
}

std::string Distributed::explain(const std::string& seen) {
  return heartbeat_ ? heartbeat_->explain(seen) : seen;
}

void Distributed::leave(const std::string& reason) {
  if (heartbeat_) heartbeat_->leave(reason);
}

Distributed::~Distributed() = default;

Strategy* Distributed::attach(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                              const TrainingState* resumed,
                              std::vector<std::vector<at::Tensor>> groups) {
  AllReduceOptions o;
  o.bucketBytes = static_cast<int64_t>(config_.f64("sync.bucket_mb") * (1 << 20));
  o.firstBucketBytes = static_cast<int64_t>(config_.f64("sync.first_bucket_mb") * (1 << 20));
  o.compression = parseCompression(config_.str("sync.compression"));
  o.topkRatio = config_.f64("sync.topk_ratio");
  const std::string& mode = config_.str("sync.mode");
  const bool psMode = usesServers(mode) && mode != "osp";  // ps-bsp, ps-asp, ps-ssp
  if (o.compression != Compression::kNone && mode != "allreduce" && !psMode) {
    throw ConfigError(fmt::format("sync.compression = {} works with sync.mode = allreduce, "
                                  "ps-bsp, ps-asp and ps-ssp; set sync.compression = none for {}",
                                  config_.str("sync.compression"), mode));
  }
  if (usesServers(mode) && config_.f64("optim.grad_clip") > 0.0) {
    throw ConfigError("optim.grad_clip is not supported with parameter-server modes yet (the "
                      "global norm spans the servers' shards); set optim.grad_clip = 0");
  }
  if (psMode) {
    strategy_ = std::make_unique<PsWorkerStrategy>(world, comm, servers_, serverOptions(config_));
  } else if (mode == "osp") {
    strategy_ = std::make_unique<OspWorkerStrategy>(world, comm, servers_, ospOptions(config_));
  } else if (mode == "allreduce") {
    strategy_ = std::make_unique<AllReduceStrategy>(comm, o);
  } else if (mode == "local-sgd") {
    LocalSgdOptions l;
    l.period = config_.i64("sync.local_period");
    l.postLocalAfter = config_.i64("sync.post_local_steps");
    l.allreduce = o;
    strategy_ = std::make_unique<LocalSgdStrategy>(comm, l);
  } else if (mode == "gossip") {
    GossipOptions g;
    g.topology = config_.str("sync.gossip_topology");
    strategy_ = std::make_unique<GossipStrategy>(comm, g);
  } else {
    throw ConfigError(fmt::format("sync.mode \"{}\" is not built yet", mode));
  }
  if (!groups.empty()) {
    if (!strategy_->supportsParameterGroups()) {
      throw ConfigError(fmt::format(
          "memory.weights = offload works with sync.mode = allreduce (or one process), not {}; "
          "set memory.weights = core or sync.mode = allreduce",
          mode));
    }
    if (o.compression != Compression::kNone) {
      throw ConfigError("memory.weights = offload exchanges uncompressed per-block buckets; set "
                        "sync.compression = none");
    }
    strategy_->setParameterGroups(std::move(groups));
  }
  strategy_->setOptimizer(&optimizer);
  if (resumed != nullptr) strategy_->restoreState(resumed->strategy, resumed->workers);
  strategy_->attach(model);
  return strategy_.get();
}

void Distributed::observeCommunication(Timeline* timeline) {
  observer_->timeline = timeline;
  strategy_->setEventSink([observer = observer_](const std::string& name,
                                                 std::chrono::steady_clock::time_point start,
                                                 std::chrono::steady_clock::time_point end) {
    std::lock_guard<std::mutex> lock(observer->mutex);
    observer->events = true;
    observer->intervals.emplace_back(start, end);
    if (observer->timeline != nullptr) observer->timeline->complete(name, start, end, /*track=*/1);
  });
}

void Distributed::forgetTimeline() {
  std::lock_guard<std::mutex> lock(observer_->mutex);
  observer_->timeline = nullptr;
}

std::optional<double> Distributed::takeOutstandingSeconds() {
  std::lock_guard<std::mutex> lock(observer_->mutex);
  if (!observer_->events) return std::nullopt;
  // The union of the intervals (events come from more than one thread, in any order).
  auto& v = observer_->intervals;
  std::sort(v.begin(), v.end());
  double seconds = 0.0;
  std::chrono::steady_clock::time_point coveredUntil{};
  for (const auto& [start, end] : v) {
    const auto from = std::max(start, coveredUntil);
    if (end > from) seconds += std::chrono::duration<double>(end - from).count();
    coveredUntil = std::max(coveredUntil, end);
  }
  v.clear();
  return seconds;
}

Agreement Distributed::agree(double loss, bool interrupted, bool timeUp, const RankWindow* window,
                             std::vector<RankWindow>* all) {
  // One sum: [loss, interrupted, time up] then, with `window`, two slots per worker of which
  // each fills its own.
  const int n = comm->size();
  at::Tensor t = torch::zeros({3 + (window != nullptr ? 2 * n : 0)});
  float* v = t.data_ptr<float>();  // filled and read in place: no tensor op per slot
  v[0] = static_cast<float>(loss);
  v[1] = interrupted ? 1.0f : 0.0f;
  v[2] = timeUp ? 1.0f : 0.0f;
  if (window != nullptr) {
    v[3 + 2 * comm->rank()] = static_cast<float>(window->computeS);
    v[4 + 2 * comm->rank()] = static_cast<float>(window->syncWaitS);
  }
  comm->allreduce(t, ReduceOp::kSum)->wait(comm->timeout());
  Agreement a;
  a.meanLoss = static_cast<double>(v[0]) / n;
  a.interrupted = v[1] > 0;
  a.timeUp = v[2] > 0;
  if (window != nullptr && all != nullptr) {
    all->assign(n, RankWindow{});
    for (int r = 0; r < n; ++r) (*all)[r] = {v[3 + 2 * r], v[4 + 2 * r]};
  }
  return a;
}

}  // namespace caravan
