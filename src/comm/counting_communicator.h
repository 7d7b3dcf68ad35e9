// CountingCommunicator: a Communicator that forwards every operation to another and counts the
// bytes this rank puts on and takes off the wire, for the bytes-per-step metrics.
//
// send/recv count exactly (recv counts when issued; a recv that never completes still counts).
// Collectives count what a ring algorithm moves per rank, since the transport picks its own
// algorithm and does not report bytes: allreduce and reduce-scatter 2(P-1)/P of the tensor
// each way (Gloo's reduce-scatter here is an allreduce), allgather (P-1) inputs each way,
// broadcast the tensor received by every rank but the root and sent P-1 times by the root.
// Operations on oneself and on one-rank communicators count nothing.
//
// Threading: as the wrapped communicator; the counters are atomic.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "comm/communicator.h"

namespace caravan {

struct ByteCount {
  int64_t sent = 0;
  int64_t received = 0;
};

class CountingCommunicator final : public Communicator {
 public:
  explicit CountingCommunicator(std::shared_ptr<Communicator> inner);

  ByteCount bytes() const { return {sent_.load(), received_.load()}; }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  std::chrono::milliseconds timeout() const override { return inner_->timeout(); }
  WorkPtr allreduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr broadcast(at::Tensor tensor, int root) override;
  WorkPtr allgather(at::Tensor output, at::Tensor input) override;
  WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) override;
  WorkPtr send(at::Tensor tensor, int dstRank, int tag) override;
  WorkPtr recv(at::Tensor tensor, int srcRank, int tag) override;
  WorkPtr barrier() override { return inner_->barrier(); }

 private:
  void count(double sent, double received);

  std::shared_ptr<Communicator> inner_;
  std::atomic<int64_t> sent_{0}, received_{0};
};

}  // namespace caravan
