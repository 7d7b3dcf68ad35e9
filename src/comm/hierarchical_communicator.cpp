// HierarchicalCommunicator (see hierarchical_communicator.h).
#include "comm/hierarchical_communicator.h"

#include <algorithm>
#include <exception>
#include <mutex>

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
  HostGroups groups = hostGroups(hosts, rank);
  auto indexIn = [&](const std::vector<int>& ranks) {
    return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
  };
  const int leader = groups.local.front();
  std::shared_ptr<ShmCommunicator> local;
  std::shared_ptr<Communicator> leaders;
  if (groups.local.size() > 1) {
    ShmOptions options = shm;
    // The broadcast waits through the leaders' step too; the rendezvous keeps its own limit.
    if (options.joinTimeout.count() <= 0) options.joinTimeout = shm.timeout;
    options.timeout = 2 * shm.timeout;
    options.globalRanks = groups.local;
    local = std::make_shared<ShmCommunicator>(
        c10::make_intrusive<c10d::PrefixStore>(fmt::format("host{}", leader), store),
        indexIn(groups.local), static_cast<int>(groups.local.size()), options);
  }
  if (rank == leader) {
    leaders = makeGloo(c10::make_intrusive<c10d::PrefixStore>("leaders", store),
                       indexIn(groups.leaders), static_cast<int>(groups.leaders.size()));
  }
  return std::make_unique<HierarchicalCommunicator>(std::move(flat), std::move(local),
                                                    std::move(leaders), std::move(groups));
}

struct HierarchicalCommunicator::Shared {
  comm::FailureLatch failure;
  std::shared_ptr<ShmCommunicator> local;
  // Final: later all-reduces fail with `message`, and the host's other ranks learn it.
  void fail(const std::string& message) {
    failure.set(message);
    if (local) local->fail(*failure.get());
  }
};

namespace {

// The all-reduce's Work: its first outcome stays (a second wait gives it at once), and a wait
// that times out makes the failure final (Shared::fail).
class HierarchicalWork final : public Work {
 public:
  HierarchicalWork(WorkPtr task, std::function<void(const std::string&)> fail)
      : task_(std::move(task)), fail_(std::move(fail)) {}
  void wait(std::chrono::milliseconds timeout) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!decided_) {
      try {
        task_->wait(timeout);
      } catch (const PeerError& e) {
        fail_(e.what());
        error_ = std::current_exception();
      } catch (...) {
        error_ = std::current_exception();
      }
      decided_ = true;
    }
    if (error_) std::rethrow_exception(error_);
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return decided_ || task_->isCompleted();
  }

 private:
  WorkPtr task_;
  std::function<void(const std::string&)> fail_;
  std::mutex mutex_;
  bool decided_ = false;
  std::exception_ptr error_;
};

}  // namespace

HierarchicalCommunicator::HierarchicalCommunicator(std::shared_ptr<Communicator> flat,
                                                   std::shared_ptr<ShmCommunicator> local,
                                                   std::shared_ptr<Communicator> leaders,
                                                   HostGroups groups)
    : flat_(std::move(flat)),
      leaders_(std::move(leaders)),
      shared_(std::make_shared<Shared>()),
      groups_(std::move(groups)) {
  CARAVAN_CHECK(flat_, "a hierarchical communicator needs a communicator of every rank");
  CARAVAN_CHECK(local || leaders_, "rank {}: alone on its host but not its leader", rank());
  shared_->local = std::move(local);
}

HierarchicalCommunicator::~HierarchicalCommunicator() = default;

std::chrono::milliseconds HierarchicalCommunicator::timeout() const {
  return shared_->local ? shared_->local->timeout() : flat_->timeout();
}

WorkPtr HierarchicalCommunicator::allreduce(at::Tensor tensor, ReduceOp op) {
  comm::checkTensor(tensor, "allreduce", "tensor");
  comm::checkReducible(tensor, op, "allreduce");
  if (auto refused = shared_->failure.refuseIfFailed()) return refused;
  ++allreduces_;
  if (tensor.numel() == 0) return std::make_shared<comm::ReadyWork>();
  const std::string what = fmt::format("rank {}: hierarchical allreduce #{} ({})", rank(),
                                       allreduces_, comm::describeTensor(tensor));
  WorkPtr task = thread_.submit(what, [this, what, tensor, op]() mutable {
    if (auto message = shared_->failure.get()) throw PeerError(*message);
    bool betweenHosts = false;  // the step that runs
    try {
      // bfloat16 in float32 through the three steps, rounded once.
      at::Tensor buf = tensor.scalar_type() == at::kBFloat16 ? tensor.to(at::kFloat) : tensor;
      const ReduceOp sum = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
      const auto& local = shared_->local;
      if (local) local->allreduce(buf, sum)->wait(local->timeout());
      betweenHosts = true;
      if (leaders_) leaders_->allreduce(buf, sum)->wait(flat_->timeout());
      betweenHosts = false;
      if (local) local->broadcast(buf, 0)->wait(local->timeout());
      if (op == ReduceOp::kAvg) buf.div_(size());
      if (!buf.is_same(tensor)) tensor.copy_(buf);
    } catch (const std::exception& e) {
      // The leaders' Gloo numbers them 0, 1, ...; shared memory uses the job's numbers.
      const std::string message =
          betweenHosts
              ? fmt::format("{} failed between the hosts' leaders ({}, numbered 0-{} there): {}",
                            what, comm::formatRanks(groups_.leaders), groups_.leaders.size() - 1,
                            comm::errorLine(e))
              : fmt::format("{} failed inside this host ({}): {}", what,
                            comm::formatRanks(groups_.local), comm::errorLine(e));
      shared_->fail(message);
      throw PeerError(message);
    }
  });
  return std::make_shared<HierarchicalWork>(
      std::move(task), [shared = shared_](const std::string& m) { shared->fail(m); });
}

// The rest goes over `flat`, unless an all-reduce failed (final for every operation).
WorkPtr HierarchicalCommunicator::broadcast(at::Tensor tensor, int root) {
  if (auto refused = shared_->failure.refuseIfFailed()) return refused;
  return flat_->broadcast(std::move(tensor), root);
}

WorkPtr HierarchicalCommunicator::allgather(at::Tensor output, at::Tensor input) {
  if (auto refused = shared_->failure.refuseIfFailed()) return refused;
  return flat_->allgather(std::move(output), std::move(input));
}

WorkPtr HierarchicalCommunicator::reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) {
  if (auto refused = shared_->failure.refuseIfFailed()) return refused;
  return flat_->reduceScatter(std::move(output), std::move(input), op);
}

WorkPtr HierarchicalCommunicator::send(at::Tensor tensor, int dstRank, int tag) {
  if (auto refused = shared_->failure.refuseIfFailed()) return refused;
  return flat_->send(std::move(tensor), dstRank, tag);
}

WorkPtr HierarchicalCommunicator::recv(at::Tensor tensor, int srcRank, int tag) {
  if (auto refused = shared_->failure.refuseIfFailed()) return refused;
  return flat_->recv(std::move(tensor), srcRank, tag);
}

WorkPtr HierarchicalCommunicator::barrier() {
  if (auto refused = shared_->failure.refuseIfFailed()) return refused;
  return flat_->barrier();
}

}  // namespace caravan
