// CountingCommunicator (see counting_communicator.h).
#include "comm/counting_communicator.h"

#include <fmt/format.h>

#include "comm/comm_util.h"
#include "core/scope_guard.h"

namespace caravan {
namespace {

double bytesOf(const at::Tensor& t) {
  return static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
}

std::string describe(const char* name, const at::Tensor& t) {
  return fmt::format("{}, {}", name, comm::describeTensor(t));
}

// A collective's work whose waits are visible to the stall inspector.
class TrackedWork final : public Work {
 public:
  TrackedWork(WorkPtr inner, std::shared_ptr<CountingCommunicator::Waits> waits, int64_t number,
              std::string what)
      : inner_(std::move(inner)), waits_(std::move(waits)), number_(number),
        what_(std::move(what)) {}
  void wait(std::chrono::milliseconds timeout) override {
    {
      std::lock_guard<std::mutex> lock(waits_->mutex);
      waits_->byNumber.emplace(number_, std::make_pair(what_, std::chrono::steady_clock::now()));
    }
    const auto done = onScopeExit([this] {
      std::lock_guard<std::mutex> lock(waits_->mutex);
      waits_->byNumber.erase(number_);
    });
    inner_->wait(timeout);
  }
  bool isCompleted() override { return inner_->isCompleted(); }

 private:
  WorkPtr inner_;
  std::shared_ptr<CountingCommunicator::Waits> waits_;
  int64_t number_;
  std::string what_;
};

}  // namespace

CountingCommunicator::CountingCommunicator(std::shared_ptr<Communicator> inner)
    : inner_(std::move(inner)) {}

WorkPtr CountingCommunicator::track(WorkPtr work, std::string what) {
  return std::make_shared<TrackedWork>(std::move(work), waits_, ++collectives_, std::move(what));
}

CollectiveProgress CountingCommunicator::progress() const {
  CollectiveProgress p;
  p.issued = collectives_.load();
  std::lock_guard<std::mutex> lock(waits_->mutex);
  if (!waits_->byNumber.empty()) {
    const auto& [number, waiting] = *waits_->byNumber.begin();
    p.waitingIn = number;
    p.what = waiting.first;
    p.waitedSeconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - waiting.second).count();
  }
  return p;
}

WorkPtr CountingCommunicator::barrier() { return track(inner_->barrier(), "barrier"); }

void CountingCommunicator::count(double sent, double received) {
  sent_ += static_cast<int64_t>(sent);
  received_ += static_cast<int64_t>(received);
}

WorkPtr CountingCommunicator::allreduce(at::Tensor tensor, ReduceOp op) {
  const double p = size();
  const double each = 2.0 * (p - 1.0) / p * bytesOf(tensor);
  count(each, each);
  std::string what = describe("allreduce", tensor);
  return track(inner_->allreduce(std::move(tensor), op), std::move(what));
}

WorkPtr CountingCommunicator::broadcast(at::Tensor tensor, int root) {
  if (rank() == root) {
    count((size() - 1) * bytesOf(tensor), 0.0);
  } else {
    count(0.0, bytesOf(tensor));
  }
  std::string what = describe("broadcast", tensor);
  return track(inner_->broadcast(std::move(tensor), root), std::move(what));
}

WorkPtr CountingCommunicator::allgather(at::Tensor output, at::Tensor input) {
  const double each = (size() - 1) * bytesOf(input);
  count(each, each);
  std::string what = describe("allgather", input);
  return track(inner_->allgather(std::move(output), std::move(input)), std::move(what));
}

WorkPtr CountingCommunicator::reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) {
  // Every rank's share of the others' chunks: half an all-reduce of the input.
  const double p = size();
  const double each = (p - 1.0) / p * bytesOf(input);
  count(each, each);
  std::string what = describe("reduce-scatter", input);
  return track(inner_->reduceScatter(std::move(output), std::move(input), op), std::move(what));
}

WorkPtr CountingCommunicator::send(at::Tensor tensor, int dstRank, int tag) {
  if (dstRank != rank()) count(bytesOf(tensor), 0.0);
  return inner_->send(std::move(tensor), dstRank, tag);
}

WorkPtr CountingCommunicator::recv(at::Tensor tensor, int srcRank, int tag) {
  if (srcRank != rank()) count(0.0, bytesOf(tensor));
  return inner_->recv(std::move(tensor), srcRank, tag);
}

}  // namespace caravan
