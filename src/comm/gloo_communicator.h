// GlooCommunicator: the Communicator over LibTorch's c10d::ProcessGroupGloo (TCP between any
// hosts; rendezvous through a c10d::Store).
//
// What ProcessGroupGloo in LibTorch 2.13 lacks, and how this class fills it in:
//  - bfloat16: Gloo has no bfloat16 type ("Invalid scalar type"). Reductions run on a float32
//    copy and are rounded back once at the end (so a bfloat16 sum equals the float32 sum
//    rounded to bfloat16); broadcast and allgather move bfloat16 viewed as float16, bit for
//    bit; send/recv are untyped anyway.
//  - AVG: Gloo refuses ReduceOp::AVG. We reduce with SUM, then divide by size().
//  - reduce_scatter: ProcessGroupGloo::reduce_scatter throws "does not support" (and
//    _reduce_scatter_base all-reduces a clone). Ours is the bandwidth-optimal ring over Gloo's
//    point-to-point messages, run as one of the process group's collectives (numbered by its
//    collective counter, on its worker threads), so each rank sends and receives (P-1)/P of the
//    input, half an all-reduce's bytes. In P-1 steps rank r sends its partial result of chunk
//    r-s-1 to rank r+1 and adds its own input's chunk r-s-2 to the one rank r-1 sent (indices
//    mod P). So chunk c starts at rank c+1 and is complete at rank c, every element reduced in
//    the fixed order ((x[c+1] + x[c+2]) + ...) + x[c] (x[q] rank q's input), whatever the
//    striping: results repeat bitwise from run to run. Besides the input it needs two
//    chunk-sized buffers (float32 ones for bfloat16, which it sends as float32 and rounds once).
//  - allgather into one flat tensor: _allgather_base is missing; we pass per-rank views of the
//    output to allgather.
//  - send/recv to oneself: Gloo has no pair to its own rank; a local mailbox serves them.
//  - zero-element operations complete at issue on every rank (Gloo's allgather hangs on them).
// Results that need a final step (bfloat16 copy-back, AVG's division) are written into the
// caller's tensors by Work::wait; the reduce-scatter's ring writes its output on the worker
// thread before the operation completes.
//
// Failures: every wait has a timeout; a timed-out wait, a peer that closed its connection and
// ranks missing at the rendezvous all become PeerError naming the rank(s). Gloo tears a pair
// down after a timeout, so the first failure is final: later operations fail at once with it.
//
// Threading: one thread at a time issues operations (see communicator.h); the constructor
// rendezvouses, so every rank constructs its communicator concurrently. ProcessGroupGloo runs
// the collectives on its own worker threads (`threads`). The destructor waits for operations
// still queued; a collective a peer never joins holds it up to `timeout`.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/communicator.h"

namespace caravan {

struct GlooOptions {
  // Default for waits and Gloo's own I/O timeout.
  std::chrono::milliseconds timeout = kDefaultCommTimeout;
  // How long the constructor waits for every rank to join; zero: `timeout`.
  std::chrono::milliseconds joinTimeout{0};
  // Where this rank's Gloo endpoint listens and what peers connect to: a network interface
  // (like GLOO_SOCKET_IFNAME) wins over a hostname/address; neither: this host's name.
  std::string interface;
  std::string hostname;
  // Store key prefix; communicators sharing one store need distinct prefixes.
  std::string prefix = "caravan/gloo";
  int threads = 2;  // ProcessGroupGloo worker threads (at least `connections`)
  // Striping: TCP connections per pair of ranks. An allreduce or broadcast of at least
  // `stripeBytes` is cut into `connections` contiguous pieces that run at once, each on its own
  // connections and worker thread, so one flow's limit is not the operation's. Results equal one
  // connection's bitwise on 2 ranks; on more, Gloo's ring sums an element in an order that
  // depends on where its piece starts (float rounding of a sum of `size` terms).
  int connections = 1;
  int64_t stripeBytes = int64_t{1} << 20;
};

class GlooCommunicator final : public Communicator {
 public:
  // Blocks until all `size` ranks joined through `store` (at most options.joinTimeout); throws
  // PeerError saying how many arrived and naming the ranks that did not, ConfigError for an
  // unusable interface/hostname.
  GlooCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                   const GlooOptions& options);
  ~GlooCommunicator() override;

  int rank() const override;
  int size() const override;
  std::string backend() const override { return "gloo"; }
  std::chrono::milliseconds timeout() const override;

  WorkPtr allreduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr broadcast(at::Tensor tensor, int root) override;
  WorkPtr allgather(at::Tensor output, at::Tensor input) override;
  WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) override;
  WorkPtr send(at::Tensor tensor, int dstRank, int tag) override;
  WorkPtr recv(at::Tensor tensor, int srcRank, int tag) override;
  WorkPtr barrier() override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace caravan
