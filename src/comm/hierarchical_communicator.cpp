// HierarchicalCommunicator (see hierarchical_communicator.h).
#include "comm/hierarchical_communicator.h"

#include <algorithm>

#include <fmt/format.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "comm/comm_util.h"
#include "core/errors.h"

namespace caravan {

HostGroups hostGroups(const std::vector<std::string>& hosts, int rank) {
  CARAVAN_CHECK(rank >= 0 && rank < static_cast<int>(hosts.size()), "rank {} of {} hosts' ranks",
                rank, hosts.size());
  HostGroups g;
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) {
    if (hosts[r] == hosts[rank]) g.local.push_back(r);
    const auto first = std::find(hosts.begin(), hosts.end(), hosts[r]) - hosts.begin();
    if (first == r) g.leaders.push_back(r);
  }
  return g;
}

std::unique_ptr<Communicator> makeHierarchical(const std::vector<std::string>& hosts, int rank,
                                               std::shared_ptr<Communicator> flat,
                                               c10::intrusive_ptr<c10d::Store> store,
                                               const ShmOptions& shm, const GlooMaker& makeGloo) {
  const HostGroups groups = hostGroups(hosts, rank);
  auto indexIn = [&](const std::vector<int>& ranks) {
    return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  };
  const int leader = groups.local.front();
  std::shared_ptr<Communicator> local, leaders;
  if (groups.local.size() > 1) {
    local = std::make_shared<ShmCommunicator>(
        c10::make_intrusive<c10d::PrefixStore>(fmt::format("host{}", leader), store),
        indexIn(groups.local), static_cast<int>(groups.local.size()), shm, nullptr);
  }
  if (rank == leader) {
    leaders = makeGloo(c10::make_intrusive<c10d::PrefixStore>("leaders", store),
                       indexIn(groups.leaders), static_cast<int>(groups.leaders.size()));
  }
  return std::make_unique<HierarchicalCommunicator>(std::move(flat), std::move(local),
                                                    std::move(leaders));
}

HierarchicalCommunicator::HierarchicalCommunicator(std::shared_ptr<Communicator> flat,
                                                   std::shared_ptr<Communicator> local,
                                                   std::shared_ptr<Communicator> leaders)
    : flat_(std::move(flat)), local_(std::move(local)), leaders_(std::move(leaders)) {
  CARAVAN_CHECK(flat_, "a hierarchical communicator needs a communicator of every rank");
  CARAVAN_CHECK(local_ || leaders_, "rank {}: alone on its host but not its leader", rank());
}

HierarchicalCommunicator::~HierarchicalCommunicator() = default;

WorkPtr HierarchicalCommunicator::allreduce(at::Tensor tensor, ReduceOp op) {
  comm::checkTensor(tensor, "allreduce", "tensor");
  comm::checkReducible(tensor, op, "allreduce");
  ++allreduces_;
  if (tensor.numel() == 0) return std::make_shared<comm::ReadyWork>();
  const std::string what = fmt::format("rank {}: hierarchical allreduce #{} ({})", rank(),
                                       allreduces_, comm::describeTensor(tensor));
  return thread_.submit(what, [this, tensor, op]() mutable {
    // bfloat16 in float32 through the three steps, rounded once.
    at::Tensor buf = tensor.scalar_type() == at::kBFloat16 ? tensor.to(at::kFloat) : tensor;
    const ReduceOp step = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    const auto timeout = this->timeout();
    if (local_) local_->allreduce(buf, step)->wait(timeout);
    if (leaders_) leaders_->allreduce(buf, step)->wait(timeout);
    if (local_) local_->broadcast(buf, 0)->wait(timeout);
    if (op == ReduceOp::kAvg) buf.div_(size());
    if (!buf.is_same(tensor)) tensor.copy_(buf);
  });
}

WorkPtr HierarchicalCommunicator::broadcast(at::Tensor tensor, int root) {
  return flat_->broadcast(std::move(tensor), root);
}

WorkPtr HierarchicalCommunicator::allgather(at::Tensor output, at::Tensor input) {
  return flat_->allgather(std::move(output), std::move(input));
}

WorkPtr HierarchicalCommunicator::reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) {
  return flat_->reduceScatter(std::move(output), std::move(input), op);
}

WorkPtr HierarchicalCommunicator::send(at::Tensor tensor, int dstRank, int tag) {
  return flat_->send(std::move(tensor), dstRank, tag);
}

WorkPtr HierarchicalCommunicator::recv(at::Tensor tensor, int srcRank, int tag) {
  return flat_->recv(std::move(tensor), srcRank, tag);
}

WorkPtr HierarchicalCommunicator::barrier() { return flat_->barrier(); }

}  // namespace caravan
