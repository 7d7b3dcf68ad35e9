// Communicator: the collective and point-to-point operations distributed strategies use,
// independent of the transport (Gloo through c10d, shared memory on one host, MPI, or the
// hierarchical pair of them).
//
// Every operation is asynchronous and returns a Work; Work::wait(timeout) blocks until the
// operation finished, rethrows a failure that happened on a communication thread, and throws
// PeerError naming the peer rank(s) when the timeout passes. Tensors passed to an operation
// must stay alive and untouched until its Work completed (the Work keeps them referenced).
// Results are in the caller's tensors once wait() returned: some operations finish there
// (a bfloat16 copy-back, AVG's division), so call wait() even when isCompleted() said true.
//
// Tensors are CPU, contiguous; a wrong shape or dtype is a bug (CARAVAN_CHECK). Zero-element
// operations complete at issue on every rank. send/recv to one's own rank work. Tags are >= 0.
//
// A PeerError is final: the ranks' operation sequences no longer line up, so every later
// operation on that communicator fails at once with the first error.
//
// Threading: operations may be issued from any one thread at a time per communicator (the
// trainer thread, or autograd's thread during backward); collectives must be issued in the
// same order on every rank. Work::wait may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "core/errors.h"

namespace caravan {

// A peer died, stopped answering, or could not be reached. Exit code: kPeer.
class PeerError : public Error {
 public:
  explicit PeerError(const std::string& m) : Error(ExitCode::kPeer, m) {}
};

enum class ReduceOp { kSum, kAvg, kMax, kMin };

// Default for waits when the config sets no fault.timeout.
inline constexpr std::chrono::milliseconds kDefaultCommTimeout{300000};

class Work {
 public:
  virtual ~Work() = default;
  // Blocks until done; throws PeerError after `timeout` (under 1 ms counts as 1 ms), or the
  // operation's own error. A second wait() returns (or throws) the same at once.
  virtual void wait(std::chrono::milliseconds timeout) = 0;
  // True when wait() would not block. Never blocks. (Gloo's send/recv only learn completion
  // inside wait(), so for them it stays false until then.)
  virtual bool isCompleted() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;
  // The default timeout for waits (fault.timeout).
  virtual std::chrono::milliseconds timeout() const = 0;

  // In place: every rank's `tensor` becomes the reduction over ranks. float32/float64/
  // bfloat16 (reduced in float32, rounded once)/int32/int64; AVG needs a floating type.
  virtual WorkPtr allreduce(at::Tensor tensor, ReduceOp op) = 0;
  // In place: every rank's `tensor` becomes root's.
  virtual WorkPtr broadcast(at::Tensor tensor, int root) = 0;
  // output (size() * input.numel() elements, contiguous) = concatenation of every rank's input
  // in rank order.
  virtual WorkPtr allgather(at::Tensor output, at::Tensor input) = 0;
  // input has size() * output.numel() elements; rank r's output = reduction over ranks of
  // input's r-th chunk.
  virtual WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) = 0;
  virtual WorkPtr send(at::Tensor tensor, int dstRank, int tag) = 0;
  virtual WorkPtr recv(at::Tensor tensor, int srcRank, int tag) = 0;
  virtual WorkPtr barrier() = 0;
};

}  // namespace caravan
