// Parameter server with BSP, ASP and SSP consistency (see parameter_server.h).
#include "sync/parameter_server.h"

#include <algorithm>
#include <limits>
#include <utility>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/completion_queue.h"
#include "core/errors.h"
#include "sync/replicas.h"

namespace caravan {
namespace {

constexpr int kTagSetup = 10;  // rank 0 -> server: [count], then the initial shard
constexpr int kTagPush = 11;   // worker -> server: [gradient shard, lr, kind]
constexpr int kTagPull = 12;   // server -> worker: [updated shard, staleness]

// The last element of a push.
constexpr float kPushGradient = 0.0f;
constexpr float kPushGoodbye = 1.0f;
constexpr float kPushSync = 2.0f;

}  // namespace

int64_t PsOptions::bound() const {
  switch (consistency) {
    case PsConsistency::kBsp: return 0;
    case PsConsistency::kSsp: return staleness;
    case PsConsistency::kAsp: break;
  }
  return std::numeric_limits<int64_t>::max();
}

PsOptions psOptions(const std::string& mode, int64_t staleness) {
  PsOptions o;
  o.staleness = staleness;
  if (mode == "ps-bsp") {
    o.consistency = PsConsistency::kBsp;
  } else if (mode == "ps-asp") {
    o.consistency = PsConsistency::kAsp;
  } else if (mode == "ps-ssp") {
    o.consistency = PsConsistency::kSsp;
  } else {
    CARAVAN_CHECK(false, "not a parameter-server mode: {}", mode);
  }
  return o;
}

PsWorkerStrategy::PsWorkerStrategy(std::shared_ptr<Communicator> world,
                                   std::shared_ptr<Communicator> workers, int numServers,
                                   PsOptions options)
    : world_(std::move(world)),
      workers_(std::move(workers)),
      servers_(numServers),
      options_(options) {
  CARAVAN_CHECK(world_ && workers_, "the parameter server needs both communicators");
  CARAVAN_CHECK(servers_ >= 1 && workers_->size() + servers_ == world_->size(),
                "{} workers + {} servers in a world of {}", workers_->size(), servers_,
                world_->size());
}

void seedServers(Communicator& world, const Communicator& workers, const at::Tensor& flat,
                 const ShardLayout& layout) {
  if (workers.rank() != 0) return;
  at::Tensor count = at::full({1}, layout.total, at::kLong);
  for (int s = 0; s < layout.servers; ++s) {
    const int server = workers.size() + s;
    world.send(count, server, kTagSetup)->wait(world.timeout());
    at::Tensor shard = flat.narrow(0, layout.begin(s), layout.size(s)).contiguous();
    world.send(shard, server, kTagSetup)->wait(world.timeout());
  }
}

at::Tensor receiveShard(Communicator& world, int numWorkers, ShardLayout* layout) {
  const int s = world.rank() - numWorkers;
  layout->servers = world.size() - numWorkers;
  CARAVAN_CHECK(s >= 0 && s < layout->servers, "rank {} is not a server", world.rank());
  at::Tensor count = at::empty({1}, at::kLong);
  world.recv(count, 0, kTagSetup)->wait(kServerWait);  // rank 0 may be loading a checkpoint
  layout->total = count.item<int64_t>();
  at::Tensor shard = at::empty({layout->size(s)}, at::kFloat);
  world.recv(shard, 0, kTagSetup)->wait(world.timeout());
  return shard;
}

bool allSaidGoodbye(const std::vector<at::Tensor>& pushes, int64_t stopAt, int serverRank,
                    int64_t step) {
  size_t goodbyes = 0;
  for (const auto& p : pushes) goodbyes += p[stopAt].item<float>() != 0.0f;
  if (goodbyes == 0) return false;
  if (goodbyes == pushes.size()) return true;
  throw PeerError(fmt::format("rank {} (server): at step {} some workers said goodbye and others "
                              "pushed gradients; the workers disagree about the last step",
                              serverRank, step));
}

at::Tensor averagePushes(const std::vector<at::Tensor>& pushes, int64_t n) {
  at::Tensor sum = pushes[0].narrow(0, 0, n).clone();
  for (size_t k = 1; k < pushes.size(); ++k) sum.add_(pushes[k].narrow(0, 0, n));
  return sum.mul_(1.0 / static_cast<double>(pushes.size()));
}

std::string PsWorkerStrategy::name() const {
  switch (options_.consistency) {
    case PsConsistency::kBsp: return "ps-bsp";
    case PsConsistency::kAsp: return "ps-asp";
    case PsConsistency::kSsp: return "ps-ssp";
  }
  return "ps";
}

void PsWorkerStrategy::attach(torch::nn::Module& model) {
  broadcastModel(*workers_, model);
  params_ = syncedParameters(model);
  layout_.servers = servers_;
  for (const auto& p : params_) layout_.total += p.numel();
  seedServers(*world_, *workers_, flatten(params_), layout_);
  codecs_.clear();
  for (int s = 0; s < servers_; ++s) {
    codecs_.emplace_back(options_.compression, layout_.size(s), options_.topkRatio);
  }
}

at::Tensor PsWorkerStrategy::pushMessage(int s, const at::Tensor& g, float kind) {
  const at::Tensor control = torch::tensor({static_cast<float>(lr_), kind});
  const at::Tensor payload = kind == kPushGradient
                                 ? codecs_[s].encode(g.narrow(0, layout_.begin(s), layout_.size(s)))
                                 : at::zeros({codecs_[s].words()}, at::kFloat);
  return at::cat({payload, control});
}

void PsWorkerStrategy::exchange(const at::Tensor& g, float kind) {
  std::vector<at::Tensor> pushes, pulls;
  std::vector<WorkPtr> work;
  for (int s = 0; s < servers_; ++s) {
    pulls.push_back(at::empty({layout_.size(s) + 1}, at::kFloat));
    work.push_back(world_->recv(pulls.back(), serverRank(s), kTagPull));
  }
  for (int s = 0; s < servers_; ++s) {
    pushes.push_back(pushMessage(s, g, kind));
    work.push_back(world_->send(pushes.back(), serverRank(s), kTagPush));
  }
  for (auto& w : work) w->wait(options_.asynchronous() ? kServerWait : world_->timeout());
  std::vector<at::Tensor> shards;
  double staleness = 0.0;
  for (int s = 0; s < servers_; ++s) {
    shards.push_back(pulls[s].narrow(0, 0, layout_.size(s)));
    staleness = std::max(staleness, static_cast<double>(pulls[s][-1].item<float>()));
  }
  unflattenInto(at::cat(shards), params_);
  if (kind == kPushGradient) {
    stalenessSum_ += staleness;
    stalenessMax_ = std::max(stalenessMax_, staleness);
    ++stalenessSteps_;
  }
}

void PsWorkerStrategy::finishGradients() { exchange(flatGradients(params_), kPushGradient); }

double PsWorkerStrategy::consolidate() {
  // Synchronous: every replica already holds the servers' values. After finish() the servers
  // are gone; finish() synchronized the replicas and left the distance it measured.
  if (!options_.asynchronous() || finished_) return std::exchange(finalDistance_, 0.0);
  const double distance = consensusDistance(*workers_, params_);
  exchange(at::Tensor(), kPushSync);
  return distance;
}

std::map<std::string, double> PsWorkerStrategy::takeMetrics() {
  std::map<std::string, double> m;
  if (stalenessSteps_ > 0) {
    m["staleness"] = stalenessSum_ / static_cast<double>(stalenessSteps_);
    m["staleness_max"] = stalenessMax_;
  }
  stalenessSum_ = stalenessMax_ = 0.0;
  stalenessSteps_ = 0;
  return m;
}

void PsWorkerStrategy::finish() {
  if (finished_) return;
  // The final evaluation and checkpoint come after the goodbye: give every replica the
  // servers' values first.
  if (options_.asynchronous()) finalDistance_ = consolidate();
  finished_ = true;
  std::vector<at::Tensor> byes;
  std::vector<WorkPtr> work;
  for (int s = 0; s < servers_; ++s) {
    byes.push_back(pushMessage(s, at::Tensor(), kPushGoodbye));
    work.push_back(world_->send(byes.back(), serverRank(s), kTagPush));
  }
  for (auto& w : work) w->wait(world_->timeout());
}

void setServerLearningRate(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

namespace {

// [shard, staleness] to `worker`, waited for.
void reply(Communicator& world, const at::Tensor& shard, int worker, int64_t staleness) {
  at::Tensor message = at::cat({shard.detach(), at::full({1}, static_cast<float>(staleness))});
  world.send(message, worker, kTagPull)->wait(world.timeout());
}

void serveBsp(Communicator& world, int numWorkers, const ShardCodec& codec, at::Tensor shard,
              torch::optim::Optimizer& opt, const std::function<void(int64_t)>& stepDone) {
  const int64_t n = shard.numel(), words = codec.words();
  std::vector<at::Tensor> pushes(numWorkers), grads(numWorkers);
  for (auto& p : pushes) p = at::empty({words + 2}, at::kFloat);
  for (int64_t step = 0;; ++step) {
    std::vector<WorkPtr> work;
    for (int k = 0; k < numWorkers; ++k) work.push_back(world.recv(pushes[k], k, kTagPush));
    for (auto& w : work) w->wait(kServerWait);
    if (allSaidGoodbye(pushes, words + 1, world.rank(), step + 1)) return;
    // The average in rank order, then the optimizer on this shard.
    for (int k = 0; k < numWorkers; ++k) grads[k] = codec.decode(pushes[k].narrow(0, 0, words));
    shard.mutable_grad() = averagePushes(grads, n);
    setServerLearningRate(opt, static_cast<double>(pushes[0][words].item<float>()));
    opt.step();
    for (int k = 0; k < numWorkers; ++k) reply(world, shard, k, 0);
    if (stepDone) stepDone(step + 1);
  }
}

// ASP / SSP: pushes applied on arrival, replies held back while they would exceed the bound.
void serveAsync(Communicator& world, int numWorkers, const PsOptions& options,
                const ShardCodec& codec, at::Tensor shard, torch::optim::Optimizer& opt,
                const std::function<void(int64_t)>& stepDone) {
  const int64_t words = codec.words();
  const int64_t bound = options.bound();
  const double scale = 1.0 / static_cast<double>(numWorkers);
  std::vector<at::Tensor> pushes(numWorkers);
  for (auto& p : pushes) p = at::empty({words + 2}, at::kFloat);
  std::vector<int64_t> clock(numWorkers, 0);
  std::vector<uint8_t> gone(numWorkers, 0), owed(numWorkers, 0), syncing(numWorkers, 0);
  CompletionQueue arrivals(kServerWait);
  for (int k = 0; k < numWorkers; ++k) arrivals.add(k, world.recv(pushes[k], k, kTagPush));
  int64_t slowestDone = 0;
  while (arrivals.outstanding() > 0) {
    const int k = arrivals.next();
    const float kind = pushes[k][words + 1].item<float>();
    if (kind == kPushGoodbye) {
      gone[k] = 1;
      owed[k] = syncing[k] = 0;
    } else if (kind == kPushSync) {
      syncing[k] = 1;
    } else {
      // lr/W, not gradient/W: weight decay (and Adam's normalized step) scale with lr.
      shard.mutable_grad() = codec.decode(pushes[k].narrow(0, 0, words));
      setServerLearningRate(opt, scale * static_cast<double>(pushes[k][words].item<float>()));
      opt.step();
      ++clock[k];
      owed[k] = 1;
    }
    if (kind != kPushGoodbye) arrivals.add(k, world.recv(pushes[k], k, kTagPush));
    // The slowest clock among the workers still training.
    int64_t slowest = std::numeric_limits<int64_t>::max();
    bool allSyncing = true, anySyncing = false;
    for (int j = 0; j < numWorkers; ++j) {
      if (gone[j]) continue;
      slowest = std::min(slowest, clock[j]);
      allSyncing = allSyncing && syncing[j];
      anySyncing = anySyncing || syncing[j];
    }
    for (int j = 0; j < numWorkers; ++j) {
      if (owed[j] && clock[j] - slowest <= bound) {
        reply(world, shard, j, clock[j] - slowest);
        owed[j] = 0;
      }
    }
    if (anySyncing && allSyncing) {
      for (int j = 0; j < numWorkers; ++j) {
        if (!syncing[j]) continue;
        reply(world, shard, j, clock[j] - slowest);
        syncing[j] = 0;
      }
    }
    if (stepDone && slowest != std::numeric_limits<int64_t>::max() && slowest > slowestDone) {
      slowestDone = slowest;
      stepDone(slowest);
    }
  }
}

}  // namespace

void runParameterServer(Communicator& world, int numWorkers, const PsOptions& options,
                        const OptimizerFactory& optimizer,
                        const std::function<void(int64_t)>& stepDone) {
  ShardLayout layout;
  at::Tensor shard = receiveShard(world, numWorkers, &layout);
  shard.set_requires_grad(true);
  auto opt = optimizer({shard});
  const ShardCodec codec(options.compression, shard.numel(), options.topkRatio);
  if (options.asynchronous()) {
    serveAsync(world, numWorkers, options, codec, shard, *opt, stepDone);
  } else {
    serveBsp(world, numWorkers, codec, shard, *opt, stepDone);
  }
}

}  // namespace caravan
