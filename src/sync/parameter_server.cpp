// Parameter server with BSP consistency (see parameter_server.h).
#include "sync/parameter_server.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include "core/errors.h"
#include "sync/replicas.h"

namespace caravan {
namespace {

constexpr int kTagSetup = 10;  // rank 0 -> server: [count], then the initial shard
constexpr int kTagPush = 11;   // worker -> server: [gradient shard, lr, stop]
constexpr int kTagPull = 12;   // server -> worker: the updated shard

}  // namespace

PsWorkerStrategy::PsWorkerStrategy(std::shared_ptr<Communicator> world,
                                   std::shared_ptr<Communicator> workers, int numServers)
    : world_(std::move(world)), workers_(std::move(workers)), servers_(numServers) {
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

void PsWorkerStrategy::attach(torch::nn::Module& model) {
  broadcastModel(*workers_, model);
  params_ = syncedParameters(model);
  layout_.servers = servers_;
  for (const auto& p : params_) layout_.total += p.numel();
  seedServers(*world_, *workers_, flatten(params_), layout_);
}

void PsWorkerStrategy::finishGradients() {
  const at::Tensor g = flatGradients(params_);
  const at::Tensor control = torch::tensor({static_cast<float>(lr_), 0.0f});
  std::vector<at::Tensor> pushes, pulls;
  std::vector<WorkPtr> work;
  for (int s = 0; s < servers_; ++s) {
    pulls.push_back(at::empty({layout_.size(s)}, at::kFloat));
    work.push_back(world_->recv(pulls.back(), serverRank(s), kTagPull));
  }
  for (int s = 0; s < servers_; ++s) {
    pushes.push_back(at::cat({g.narrow(0, layout_.begin(s), layout_.size(s)), control}));
    work.push_back(world_->send(pushes.back(), serverRank(s), kTagPush));
  }
  for (auto& w : work) w->wait(world_->timeout());
  unflattenInto(at::cat(pulls), params_);
}

void PsWorkerStrategy::finish() {
  if (finished_) return;
  finished_ = true;
  std::vector<at::Tensor> byes;
  std::vector<WorkPtr> work;
  for (int s = 0; s < servers_; ++s) {
    byes.push_back(at::zeros({layout_.size(s) + 2}, at::kFloat));
    byes.back()[-1] = 1.0f;
    work.push_back(world_->send(byes.back(), serverRank(s), kTagPush));
  }
  for (auto& w : work) w->wait(world_->timeout());
}

void runParameterServer(Communicator& world, int numWorkers, const OptimizerFactory& optimizer,
                        const std::function<void(int64_t)>& stepDone) {
  ShardLayout layout;
  at::Tensor shard = receiveShard(world, numWorkers, &layout);
  const int64_t n = shard.numel();
  shard.set_requires_grad(true);
  auto opt = optimizer({shard});
  std::vector<at::Tensor> pushes(numWorkers);
  for (auto& p : pushes) p = at::empty({n + 2}, at::kFloat);
  for (int64_t step = 0;; ++step) {
    std::vector<WorkPtr> work;
    for (int k = 0; k < numWorkers; ++k) work.push_back(world.recv(pushes[k], k, kTagPush));
    for (auto& w : work) w->wait(kServerWait);
    if (allSaidGoodbye(pushes, n + 1, world.rank(), step + 1)) return;
    // The average in rank order, then the optimizer on this shard.
    at::Tensor sum = averagePushes(pushes, n);
    for (auto& group : opt->param_groups()) {
      group.options().set_lr(static_cast<double>(pushes[0][n].item<float>()));
    }
    shard.mutable_grad() = sum;
    opt->step();
    work.clear();
    for (int k = 0; k < numWorkers; ++k) work.push_back(world.send(shard.detach(), k, kTagPull));
    for (auto& w : work) w->wait(world.timeout());
    if (stepDone) stepDone(step + 1);
  }
}

}  // namespace caravan
