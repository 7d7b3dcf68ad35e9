// CountingCommunicator (see counting_communicator.h).
#include "comm/counting_communicator.h"

namespace caravan {
namespace {

double bytesOf(const at::Tensor& t) {
  return static_cast<double>(t.numel()) * static_cast<double>(t.element_size());
}

}  // namespace

CountingCommunicator::CountingCommunicator(std::shared_ptr<Communicator> inner)
    : inner_(std::move(inner)) {}

void CountingCommunicator::count(double sent, double received) {
  sent_ += static_cast<int64_t>(sent);
  received_ += static_cast<int64_t>(received);
}

WorkPtr CountingCommunicator::allreduce(at::Tensor tensor, ReduceOp op) {
  const double p = size();
  const double each = 2.0 * (p - 1.0) / p * bytesOf(tensor);
  count(each, each);
  return inner_->allreduce(std::move(tensor), op);
}

WorkPtr CountingCommunicator::broadcast(at::Tensor tensor, int root) {
  if (rank() == root) {
    count((size() - 1) * bytesOf(tensor), 0.0);
  } else {
    count(0.0, bytesOf(tensor));
  }
  return inner_->broadcast(std::move(tensor), root);
}

WorkPtr CountingCommunicator::allgather(at::Tensor output, at::Tensor input) {
  const double each = (size() - 1) * bytesOf(input);
  count(each, each);
  return inner_->allgather(std::move(output), std::move(input));
}

WorkPtr CountingCommunicator::reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) {
  const double p = size();
  const double each = 2.0 * (p - 1.0) / p * bytesOf(input);
  count(each, each);
  return inner_->reduceScatter(std::move(output), std::move(input), op);
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
