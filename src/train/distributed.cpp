// Rendezvous, communicator and strategy for a data-parallel run (see distributed.h).
#include "train/distributed.h"

#include <zlib.h>

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
#include "core/errors.h"
#include "core/log.h"
#include "sync/allreduce.h"
#include "sync/diloco.h"
#include "sync/diloco_servers.h"
#include "sync/gossip.h"
#include "sync/local_sgd.h"
#include "sync/osp.h"
#include "sync/parameter_server.h"
#include "train/setup.h"
#include "train/timeline.h"

namespace caravan {

std::string jobSignature(const Config& config) {
  std::string out;
  for (const ConfigOption& o : Config::schema()) {
    const std::string& key = o.key;
    const bool local = key.rfind("dist.", 0) == 0 || key == "data.path" || key == "model.path" ||
                       key == "memory.swap_dir" || key == "train.threads" ||
                       key == "data.prefetch" || key == "parallel.cluster";
    if (local) continue;
    switch (o.type) {
      case ConfigType::kInt: out += fmt::format("{}={}\n", key, config.i64(key)); break;
      case ConfigType::kFloat: out += fmt::format("{}={}\n", key, config.f64(key)); break;
      case ConfigType::kBool: out += fmt::format("{}={}\n", key, config.flag(key)); break;
      case ConfigType::kString: out += fmt::format("{}={:?}\n", key, config.str(key)); break;
    }
  }
  // The mix, not where each source lies on this host.
  for (const DataSource& d : config.dataSources()) {
    out += fmt::format("data.sources={}:{}\n", d.format, d.weight);
  }
  return out;
}

namespace {

// Each rank's signature's CRC-32, gathered: the ranks whose differ from rank 0's are named on
// every rank, which all refuse.
void checkSameJob(Communicator& world, const std::string& job) {
  const auto crc = static_cast<int64_t>(
      crc32(0L, reinterpret_cast<const Bytef*>(job.data()), static_cast<uInt>(job.size())));
  at::Tensor mine = at::full({1}, crc, at::kLong);
  at::Tensor all = at::empty({world.size()}, at::kLong);
  world.allgather(all, mine)->wait(world.timeout());
  std::vector<int> differ;
  for (int r = 1; r < world.size(); ++r) {
    if (all[r].item<int64_t>() != all[0].item<int64_t>()) differ.push_back(r);
  }
  if (differ.empty()) return;
  std::string ranks;
  for (int r : differ) ranks += (ranks.empty() ? "" : ", ") + std::to_string(r);
  throw ConfigError(fmt::format(
      "rank{} {} of {} {} started with another config than rank 0 (model, data, optimizer, sync "
      "or steps differ); start every rank with the same --config and --set options",
      differ.size() > 1 ? "s" : "", ranks, world.size(), differ.size() > 1 ? "were" : "was"));
}

}  // namespace

namespace {

StoreOptions jobStoreOptions(const SyncOptions& sync, const WorldInfo& worldInfo,
                             const std::string& runDir) {
  StoreOptions so;
  so.kind = sync.store;
  so.filePath = sync.storePath.empty() ? (std::filesystem::path(runDir) / "rendezvous").string()
                                       : sync.storePath;
  so.timeout = sync.timeout;
  so.connectTimeout = sync.rendezvousTimeout;
  so.token = worldInfo.token;
  return so;
}

}  // namespace

c10::intrusive_ptr<c10d::Store> makeJobStore(const RunOptions& options, const WorldInfo& world,
                                             const std::string& runDir) {
  // MPI brings its own wire-up (mpirun); the others (gloo, and shm/auto, which use gloo for
  // point-to-point) rendezvous through the store.
  if (options.sync.backend == "mpi") return {};
  return makeStore(world, jobStoreOptions(options.sync, world, runDir));
}

Distributed::Distributed(const RunOptions& runOptions, const WorldInfo& worldInfo,
                         const std::string& runDir, const std::string& job,
                         c10::intrusive_ptr<c10d::Store> store)
    : options_(runOptions) {
  const SyncOptions& sync = options_.sync;
  const auto timeout = sync.timeout;
  const StoreOptions so = jobStoreOptions(sync, worldInfo, runDir);
  const std::string& backend = sync.backend;
  if (!store) store = makeJobStore(options_, worldInfo, runDir);
  world_ = counted(makeCommunicator(backend, worldInfo, store, timeout, sync.rendezvousTimeout,
                                    sync.connections));
  // Gloo's connections carry no credential of their own (comm/auth.h).
  const bool authenticate = backend != "mpi" && !worldInfo.token.empty();
  if (authenticate) authenticatePeers(*world_, worldInfo.token);
  if (!job.empty()) checkSameJob(*world_, job);
  if (backend != "mpi" && worldInfo.token.empty() && worldInfo.rank == 0 &&
      !isLoopbackAddress(worldInfo.masterAddr)) {
    logLine(fmt::format(
        "warning: {} is not set: any process that reaches {}:{} can join this "
        "job; give every rank the same secret in {}",
        kJobTokenVariable, worldInfo.masterAddr, worldInfo.masterPort, kJobTokenVariable));
  }
  comm_ = world_;
  servers_ = sync.servers;
  workers_ = worldInfo.worldSize - servers_;
  CARAVAN_CHECK(workers_ >= 1 && (servers_ == 0 || backend != "mpi"),
                "{} servers on {} in a world of {} (validate() refuses it)", servers_, backend,
                worldInfo.worldSize);
  // A group of the world's ranks with its own rendezvous under `prefix` in the store (not MPI):
  // this rank is `rank` of `size` in it.
  auto group = [&](const std::string& prefix, int rank, int size) {
    WorldInfo g = worldInfo;
    g.rank = rank;
    g.worldSize = size;
    std::shared_ptr<Communicator> c =
        counted(makeCommunicator(backend, g, c10::make_intrusive<c10d::PrefixStore>(prefix, store),
                                 timeout, sync.rendezvousTimeout, sync.connections));
    if (authenticate) authenticatePeers(*c, worldInfo.token);
    return c;
  };
  // The workers' own group: evaluation, the per-step agreement, the initial broadcast.
  if (servers_ > 0 && !isServer()) comm_ = group("workers", worldInfo.rank, workers_);
  // The workers' communicator's counter, for the stall inspector below.
  const std::shared_ptr<CountingCommunicator> workersCounter = counters_.back();
  const int stages = options_.pipeline.stages;
  if (stages > 1 && worldInfo.worldSize > stages) {
    // validate() refused this on MPI (it would need MPI_Comm_split).
    stageReplicas_ = group("stage-" + std::to_string(worldInfo.rank % stages),
                           worldInfo.rank / stages, worldInfo.worldSize / stages);
  } else if (options_.pipeline.active() && stages == 1) {
    stageReplicas_ = comm_;  // gradient accumulation on every worker: they are the replicas
  }
  if (store) {
    HeartbeatOptions ho;
    ho.workers = workers_;
    ho.hostsStore = so.kind == "tcp" && worldInfo.rank == 0;
    ho.storeOnRank0 = so.kind == "tcp";
    ho.storeAddress = so.kind == "tcp"
                          ? fmt::format("{}:{}", worldInfo.masterAddr, worldInfo.masterPort)
                          : so.filePath;
    ho.stallReport = sync.stallReport;
    heartbeat_ = std::make_unique<Heartbeat>(store, worldInfo.rank, worldInfo.worldSize, ho);
    // The stall inspector follows the workers' collectives (servers take part in none).
    if (!isServer()) {
      heartbeat_->setProgressProbe([workersCounter] { return workersCounter->progress(); });
    }
  }
}

void Distributed::serve() {
  auto optimizer = [this](std::vector<at::Tensor> params) {
    return makeOptimizer(options_.optim, std::move(params));
  };
  auto onStep = [this](int64_t step) { stepDone(step); };
  switch (options_.sync.mode) {
    case SyncMode::kOsp:
      runOspServer(*world_, workers_, options_.sync.osp, optimizer, onStep);
      return;
    case SyncMode::kPsDiloco:
      runDilocoServer(*world_, workers_, options_.sync.diloco, onStep);
      return;
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp:
      runParameterServer(*world_, workers_, options_.sync.ps, optimizer, onStep);
      return;
    case SyncMode::kAllReduce:
    case SyncMode::kLocalSgd:
    case SyncMode::kDiloco:
    case SyncMode::kGossip: break;
  }
  CARAVAN_CHECK(false, "sync.mode {} runs no server", syncModeName(options_.sync.mode));
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

Strategy* Distributed::attach(torch::nn::Module& model, AttachContext context) {
  const SyncOptions& sync = options_.sync;
  switch (sync.mode) {
    case SyncMode::kPsBsp:
    case SyncMode::kPsAsp:
    case SyncMode::kPsSsp:
      strategy_ = std::make_unique<PsWorkerStrategy>(world_, comm_, servers_, sync.ps);
      break;
    case SyncMode::kPsDiloco:
      strategy_ = std::make_unique<DilocoStrategy>(comm_, sync.diloco, world_, servers_);
      break;
    case SyncMode::kOsp:
      strategy_ = std::make_unique<OspWorkerStrategy>(world_, comm_, servers_, sync.osp);
      break;
    case SyncMode::kAllReduce:
      strategy_ = std::make_unique<AllReduceStrategy>(comm_, sync.allreduce);
      break;
    case SyncMode::kLocalSgd:
      strategy_ = std::make_unique<LocalSgdStrategy>(comm_, sync.localSgd);
      break;
    case SyncMode::kDiloco: strategy_ = std::make_unique<DilocoStrategy>(comm_, sync.diloco); break;
    case SyncMode::kGossip: strategy_ = std::make_unique<GossipStrategy>(comm_, sync.gossip); break;
  }
  context.sink = [observer = observer_](const std::string& name,
                                        std::chrono::steady_clock::time_point start,
                                        std::chrono::steady_clock::time_point end) {
    std::lock_guard<std::mutex> lock(observer->mutex);
    observer->events = true;
    observer->intervals.emplace_back(start, end);
    if (observer->timeline != nullptr) observer->timeline->complete(name, start, end, /*track=*/1);
  };
  strategy_->attach(model, std::move(context));
  return strategy_.get();
}

void Distributed::setTimeline(Timeline* timeline) {
  std::lock_guard<std::mutex> lock(observer_->mutex);
  observer_->timeline = timeline;
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

Agreement Distributed::agree(double loss, bool interrupted, bool timeUp, double trainSeconds,
                             const RankWindow* window, std::vector<RankWindow>* all) {
  // One sum: [loss, interrupted, time up, training seconds] then, with `window`, three slots
  // per worker of which each fills its own.
  constexpr int kShared = 4, kSlots = 3;
  const int n = comm_->size();
  at::Tensor t = torch::zeros({kShared + (window != nullptr ? kSlots * n : 0)});
  float* v = t.data_ptr<float>();  // filled and read in place: no tensor op per slot
  v[0] = static_cast<float>(loss);
  v[1] = interrupted ? 1.0f : 0.0f;
  v[2] = timeUp ? 1.0f : 0.0f;
  v[3] = static_cast<float>(trainSeconds);
  if (window != nullptr) {
    float* own = v + kShared + kSlots * comm_->rank();
    own[0] = static_cast<float>(window->computeS);
    own[1] = static_cast<float>(window->syncWaitS);
    own[2] = static_cast<float>(window->trackedPeakBytes);
  }
  comm_->allreduce(t, ReduceOp::kSum)->wait(comm_->timeout());
  Agreement a;
  a.meanLoss = static_cast<double>(v[0]) / n;
  a.interrupted = v[1] > 0;
  a.timeUp = v[2] > 0;
  a.meanTrainSeconds = static_cast<double>(v[3]) / n;
  if (window != nullptr && all != nullptr) {
    all->assign(n, RankWindow{});
    for (int r = 0; r < n; ++r) {
      const float* w = v + kShared + kSlots * r;
      (*all)[r] = {w[0], w[1], w[2]};
    }
  }
  return a;
}

}  // namespace caravan
