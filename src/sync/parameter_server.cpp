// Parameter server with BSP, ASP and SSP consistency (see parameter_server.h).
#include "sync/parameter_server.h"

#include <algorithm>
#include <cmath>
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
constexpr int kTagPush = 11;   // worker -> server: PushHeader, gradient shard
constexpr int kTagPull = 12;   // server -> worker: PullHeader, updated shard
constexpr int kPsTagState = 13;  // server -> worker 0: its shard's optimizer state

}  // namespace

int64_t PsOptions::bound() const {
  switch (consistency) {
    case PsConsistency::kBsp: return 0;
    case PsConsistency::kSsp: return staleness;
    case PsConsistency::kAsp: break;
  }
  return std::numeric_limits<int64_t>::max();
}

PsOptions psOptions(SyncMode mode, int64_t staleness) {
  PsOptions o;
  o.staleness = staleness;
  switch (mode) {
    case SyncMode::kPsBsp: o.consistency = PsConsistency::kBsp; break;
    case SyncMode::kPsAsp: o.consistency = PsConsistency::kAsp; break;
    case SyncMode::kPsSsp: o.consistency = PsConsistency::kSsp; break;
    case SyncMode::kAllReduce:
    case SyncMode::kLocalSgd:
    case SyncMode::kDiloco:
    case SyncMode::kGossip:
    case SyncMode::kPsDiloco:
    case SyncMode::kOsp:
      CARAVAN_CHECK(false, "not a parameter-server mode: {}", syncModeName(mode));
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
                 const FlatOptimizerState& state, const ShardLayout& layout) {
  if (workers.rank() != 0) return;
  at::Tensor count = at::full({1}, layout.total, at::kLong);
  for (int s = 0; s < layout.servers; ++s) {
    const int server = workers.size() + s;
    world.send(count, server, kTagSetup)->wait(world.timeout());
    at::Tensor shard = flat.narrow(0, layout.begin(s), layout.size(s)).contiguous();
    world.send(shard, server, kTagSetup)->wait(world.timeout());
    sendOptimizerState(world, state.narrow(layout.begin(s), layout.size(s)), server, kTagSetup);
  }
}

FlatOptimizerState takeStateForServers(torch::optim::Optimizer* optimizer,
                                       const std::vector<at::Tensor>& params, bool firstWorker) {
  FlatOptimizerState state;
  if (optimizer == nullptr) return state;
  if (firstWorker) state = gatherOptimizerState(*optimizer, params);
  scatterOptimizerState(*optimizer, params, FlatOptimizerState{});
  return state;
}

at::Tensor receiveShard(Communicator& world, int numWorkers, ShardLayout* layout,
                        FlatOptimizerState* state) {
  const int s = world.rank() - numWorkers;
  layout->servers = world.size() - numWorkers;
  CARAVAN_CHECK(s >= 0 && s < layout->servers, "rank {} is not a server", world.rank());
  at::Tensor count = at::empty({1}, at::kLong);
  world.recv(count, 0, kTagSetup)->wait(kServerWait);  // rank 0 may be loading a checkpoint
  layout->total = count.item<int64_t>();
  if (layout->total < 0) {
    throw PeerError(fmt::format("rank 0 announced {} parameters; it runs another version of "
                                "caravan or is not part of this job",
                                layout->total));
  }
  at::Tensor shard = at::empty({layout->size(s)}, at::kFloat);
  world.recv(shard, 0, kTagSetup)->wait(world.timeout());
  *state = recvOptimizerState(world, layout->size(s), 0, kTagSetup, world.timeout());
  return shard;
}

void receiveServerStates(Communicator& world, const ShardLayout& layout, int tag,
                         torch::optim::Optimizer& optimizer,
                         const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> slots;
  FlatOptimizerState all;
  for (int s = 0; s < layout.servers; ++s) {
    const int server = world.size() - layout.servers + s;
    FlatOptimizerState part =
        recvOptimizerState(world, layout.size(s), server, tag, world.timeout());
    if (s == 0) all.step = part.step;
    if (part.rows() > 0) slots.push_back(part.slots);
  }
  if (!slots.empty()) {
    CARAVAN_CHECK(static_cast<int>(slots.size()) == layout.servers, "some servers sent no state");
    all.slots = at::cat(slots, 1);
  }
  scatterOptimizerState(optimizer, params, all);
}

std::string PsWorkerStrategy::name() const {
  switch (options_.consistency) {
    case PsConsistency::kBsp: return syncModeName(SyncMode::kPsBsp);
    case PsConsistency::kAsp: return syncModeName(SyncMode::kPsAsp);
    case PsConsistency::kSsp: return syncModeName(SyncMode::kPsSsp);
  }
  return "ps";
}

void PsWorkerStrategy::attachModel(torch::nn::Module& model) {
  broadcastModel(*workers_, model);
  params_ = syncedParameters(model);
  layout_.servers = servers_;
  for (const auto& p : params_) layout_.total += p.numel();
  // Rank 0's optimizer holds the servers' state when resuming (saveState put it there); it
  // goes to the servers cut for their number.
  seedServers(*world_, *workers_, flatten(params_),
              takeStateForServers(optimizer_, params_, workers_->rank() == 0), layout_);
  codecs_.clear();
  const at::Tensor residual =
      restoredResidual_.defined()
          ? rowForRank(restoredResidual_, workers_->rank(), workers_->size(), layout_.total)
          : at::Tensor();
  for (int s = 0; s < servers_; ++s) {
    codecs_.emplace_back(options_.compression, layout_.size(s), options_.topkRatio);
    if (residual.defined()) {
      codecs_.back().residual().copy_(residual.narrow(0, layout_.begin(s), layout_.size(s)));
    }
  }
  restoredResidual_ = at::Tensor();
}

std::map<std::string, at::Tensor> PsWorkerStrategy::saveState() {
  std::map<std::string, at::Tensor> out;
  if (options_.compression == Compression::kTopK) {
    std::vector<at::Tensor> mine;
    for (const auto& c : codecs_) mine.push_back(c.residual());
    out["ps_residuals"] = gatherRows(*workers_, at::cat(mine));
  }
  // Answered like a sync; then each server sends worker 0 its shard's optimizer state.
  exchange(at::Tensor(), PushKind::kState);
  if (workers_->rank() == 0) {
    CARAVAN_CHECK(optimizer_ != nullptr, "the parameter-server strategy has no optimizer");
    receiveServerStates(*world_, layout_, kPsTagState, *optimizer_, params_);
  }
  return out;
}

void PsWorkerStrategy::restoreState(const std::map<std::string, at::Tensor>& state,
                                    int64_t savedWorkers) {
  auto it = state.find("ps_residuals");
  if (it != state.end() && options_.compression == Compression::kTopK) {
    restoredResidual_ = it->second;  // every worker's rows: attach() picks this rank's
  }
}

at::Tensor PsWorkerStrategy::pushMessage(int s, const at::Tensor& g, PushKind kind) {
  PushHeader header;
  header.kind = kind;
  header.learningRate = lr_;
  return encodePush(header, kind == PushKind::kGradient
                                ? codecs_[s].encode(g.narrow(0, layout_.begin(s), layout_.size(s)))
                                : at::zeros({codecs_[s].words()}, at::kFloat));
}

void PsWorkerStrategy::exchange(const at::Tensor& g, PushKind kind) {
  std::vector<at::Tensor> pushes, pulls;
  for (int s = 0; s < servers_; ++s) {
    pulls.push_back(pullBuffer(layout_.size(s)));
    pushes.push_back(pushMessage(s, g, kind));
  }
  servers().exchange(kTagPush, pushes, kTagPull, &pulls,
                     options_.asynchronous() ? kServerWait : world_->timeout());
  std::vector<at::Tensor> shards;
  double staleness = 0.0;
  for (int s = 0; s < servers_; ++s) {
    shards.push_back(pullPayload(pulls[s]));
    staleness =
        std::max(staleness, static_cast<double>(decodePull(pulls[s], servers().rank(s)).staleness));
  }
  unflattenInto(at::cat(shards), params_);
  if (kind == PushKind::kGradient) {
    stalenessSum_ += staleness;
    stalenessMax_ = std::max(stalenessMax_, staleness);
    ++stalenessSteps_;
  }
}

void PsWorkerStrategy::finishGradients() { exchange(flatGradients(params_), PushKind::kGradient); }

double PsWorkerStrategy::consolidate() {
  // Synchronous: every replica already holds the servers' values. After finish() the servers
  // are gone; finish() synchronized the replicas and left the distance it measured.
  if (!options_.asynchronous() || finished_) return std::exchange(finalDistance_, 0.0);
  const double distance = consensusDistance(*workers_, params_);
  exchange(at::Tensor(), PushKind::kSync);
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
  for (int s = 0; s < servers_; ++s)
    byes.push_back(pushMessage(s, at::Tensor(), PushKind::kGoodbye));
  servers().exchange(kTagPush, byes, 0, nullptr, world_->timeout());
}

void setServerLearningRate(torch::optim::Optimizer& opt, double lr) {
  for (auto& group : opt.param_groups()) group.options().set_lr(lr);
}

namespace {

// The shard and its staleness to `worker`, waited for.
void reply(Communicator& world, const at::Tensor& shard, int worker, int64_t staleness) {
  PullHeader header;
  header.staleness = staleness;
  world.send(encodePull(header, shard.detach()), worker, kTagPull)->wait(world.timeout());
}

// A state request: worker 0 gets this server's optimizer state (after the pulls went out).
void sendState(Communicator& world, torch::optim::Optimizer& opt, const at::Tensor& shard) {
  sendOptimizerState(world, gatherOptimizerState(opt, {shard}), 0, kPsTagState);
}

void serveBsp(Communicator& world, int numWorkers, const ShardCodec& codec, at::Tensor shard,
              torch::optim::Optimizer& opt, const std::function<void(int64_t)>& stepDone) {
  const int64_t n = shard.numel(), words = codec.words();
  std::vector<at::Tensor> pushes(numWorkers), grads(numWorkers);
  for (auto& p : pushes) p = pushBuffer(words);
  for (int64_t step = 0;;) {
    receiveFromWorkers(world, kTagPush, pushes, kServerWait);
    const std::vector<PushHeader> round = decodeRound(pushes, world.rank(), step + 1);
    const PushKind kind = round[0].kind;
    if (kind == PushKind::kGoodbye) return;
    if (kind != PushKind::kGradient) {  // a checkpoint's state request (sync: nothing to do)
      for (int k = 0; k < numWorkers; ++k) reply(world, shard, k, 0);
      if (kind == PushKind::kState) sendState(world, opt, shard);
      continue;
    }
    ++step;
    // The average in rank order, then the optimizer on this shard.
    for (int k = 0; k < numWorkers; ++k) grads[k] = codec.decode(pushPayload(pushes[k]));
    shard.mutable_grad() = averagePayloads(grads, n);
    setServerLearningRate(opt, round[0].learningRate);  // worker 0's
    opt.step();
    for (int k = 0; k < numWorkers; ++k) reply(world, shard, k, 0);
    if (stepDone) stepDone(step);
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
  for (auto& p : pushes) p = pushBuffer(words);
  std::vector<int64_t> clock(numWorkers, 0);
  std::vector<uint8_t> gone(numWorkers, 0), owed(numWorkers, 0), syncing(numWorkers, 0);
  bool stateRequested = false;  // a sync that also sends worker 0 the optimizer state
  CompletionQueue arrivals(kServerWait);
  for (int k = 0; k < numWorkers; ++k) arrivals.add(k, world.recv(pushes[k], k, kTagPush));
  int64_t slowestDone = 0;
  while (arrivals.outstanding() > 0) {
    const int k = arrivals.next();
    const PushHeader push = decodePush(pushes[k], k, world.rank());
    const PushKind kind = push.kind;
    if (kind == PushKind::kGoodbye) {
      gone[k] = 1;
      owed[k] = syncing[k] = 0;
    } else if (kind == PushKind::kSync || kind == PushKind::kState) {
      syncing[k] = 1;
      stateRequested = stateRequested || kind == PushKind::kState;
    } else {
      // lr/W, not gradient/W: weight decay (and Adam's normalized step) scale with lr.
      shard.mutable_grad() = codec.decode(pushPayload(pushes[k]));
      setServerLearningRate(opt, scale * push.learningRate);
      opt.step();
      ++clock[k];
      owed[k] = 1;
    }
    if (kind != PushKind::kGoodbye) arrivals.add(k, world.recv(pushes[k], k, kTagPush));
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
      if (stateRequested) sendState(world, opt, shard);
      stateRequested = false;
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
  FlatOptimizerState state;
  at::Tensor shard = receiveShard(world, numWorkers, &layout, &state);
  shard.set_requires_grad(true);
  auto opt = optimizer({shard});
  scatterOptimizerState(*opt, {shard}, state);
  const ShardCodec codec(options.compression, shard.numel(), options.topkRatio);
  if (options.asynchronous()) {
    serveAsync(world, numWorkers, options, codec, shard, *opt, stepDone);
  } else {
    serveBsp(world, numWorkers, codec, shard, *opt, stepDone);
  }
}

}  // namespace caravan
