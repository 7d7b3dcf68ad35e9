// ShmCommunicator: the collectives and point-to-point operations of ranks that share one host,
// through one shared-memory segment.
//
// The segment: a header (each rank's phase counter, pid and doorbell, a failure word), then two
// buffers of one slot per rank (`slotBytes` each), then one ring of slotBytes / (2 size) per
// ordered pair of ranks for send/recv (shm_channels.h: tag matching, a progress thread per rank,
// its own completion and failure rules). A collective moves its tensors through the slots in
// chunks; each chunk is: every rank copies its part into its own slot, all arrive at a phase
// (a barrier on the counters), then each rank reads what it needs from the others' slots.
// Consecutive chunks alternate buffers, so a slot is written again only after every rank has
// passed the phase that follows its last reader. All-reduce is reduce-scatter + all-gather:
// rank r reduces slice r of the chunk over every rank's slot in rank order (0, 1, ...) into its
// result and its slot, a phase, then every rank copies every slice. Reductions are ATen's
// vectorised kernels; bfloat16 is reduced in float32 and rounded once, AVG divides the float
// sum (as the Gloo backend does). So results equal the Gloo backend's bitwise where the order of
// a sum does not matter (2 ranks, integers, MAX/MIN, broadcast, all-gather) and otherwise differ
// by float32 rounding of a sum of `size` terms in another order.
//
// Safety: rank 0 creates the segment private to the job's user (mode 0600) under an
// unpredictable name (segmentPrefix(token) and a random nonce, passed to the others through the
// rendezvous store) and removes the name as soon as every rank has mapped it, so after the
// rendezvous no exit path (a SIGKILL included) can leave it behind: the memory goes when the
// last rank unmaps it. A rank that fails to map it, or does not arrive within `joinTimeout`, is
// named (PeerError) and the name removed; only a rank 0 killed during the rendezvous leaves a
// name, which `caravan train --workers` removes when its workers are gone (removeSegments).
// rank 0 sizes the slots to at most half of what /dev/shm has free.
//
// Waiting: a rank waiting at a phase spins briefly, then yields, then sleeps in short steps (on
// a busy host the ranks it waits for need the cores). It gives up with PeerError naming the
// ranks that did not arrive after `timeout`, at once when one of their processes has exited,
// and when another rank gave up (the failure word): every rank of a broken collective learns
// it. A failure is final (communicator.h).
//
// Threading: collectives run one after another on a thread of this communicator, in issue
// order, so they overlap the caller's compute like the other backends' do; issue from one
// thread at a time (communicator.h). A thread that waits for a collective runs it itself when it
// is next and the op thread has not started it (a wait at least `timeout` long): the waiter
// would only sleep meanwhile, and two thread hand-offs cost more than a small collective does.
// A collective of at most `deferBytes` does not wake the op thread at issue (waking it takes a
// core from the ranks for several microseconds); the op thread still takes it within 2 ms
// when no one waits for it. The destructor finishes what was issued, then joins.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/communicator.h"
#include "core/errors.h"

namespace caravan {

struct ShmOptions {
  std::chrono::milliseconds timeout = kDefaultCommTimeout;
  std::chrono::milliseconds joinTimeout{0};  // zero: `timeout`
  // Per rank and buffer. 1 MiB (a segment of 5 MiB for 2 ranks, rings included) stays in the
  // caches: against 4 MiB it took the 2-rank all-reduce of 16-64 MB from about 5 to about
  // 8-10 GB/s here.
  int64_t slotBytes = int64_t{1} << 20;
  // Collectives up to this size do not wake the op thread: their waiter runs them (see below).
  int64_t deferBytes = int64_t{64} << 10;
  std::string token;  // the job token (names the segment)
  // The job's rank numbers of ranks 0..size-1, for messages (a host's ranks in a hierarchical
  // communicator); empty: the same numbers.
  std::vector<int> globalRanks;
};

// What makes two processes able to share memory and count as one host: the kernel's boot id
// and the network and mount namespaces (ranks in different network namespaces stand for
// different hosts, as in scripts/netns_hosts.sh, even on one machine).
std::string hostIdentity();

// Every rank publishes hostIdentity() under `prefix` in `store` and reads the others': the
// rank -> host identity map, in rank order. It claims the rank first (claimRank: a second
// process with the same rank is refused at once). Named PeerError when a rank does not publish
// within `timeout`.
std::vector<std::string> exchangeHostIdentities(c10d::Store& store, int rank, int size,
                                                std::chrono::milliseconds timeout);

// A job's segment names in /dev/shm start with this: "caravan-" + the job token's hash + "-".
std::string segmentPrefix(const std::string& token);
// Removes the job's segment names still in /dev/shm (left only when rank 0 died while the
// others were mapping it) and returns how many; the launcher calls it once its workers are gone.
int removeSegments(const std::string& token);

// /dev/shm cannot hold the job's segment: rank 0 could not create or reserve it (a read-only or
// full /dev/shm). Every rank of the rendezvous throws it (the others learn it through the
// store), so they can agree to use another backend (dist.backend = auto falls back to Gloo).
class ShmUnavailable : public IoError {
 public:
  explicit ShmUnavailable(const std::string& m) : IoError(m) {}
};

class ShmCommunicator final : public Communicator {
 public:
  // Every rank constructs it concurrently (a rendezvous through `store`).
  ShmCommunicator(c10::intrusive_ptr<c10d::Store> store, int rank, int size, ShmOptions options);
  ~ShmCommunicator() override;
  ShmCommunicator(const ShmCommunicator&) = delete;
  ShmCommunicator& operator=(const ShmCommunicator&) = delete;

  int rank() const override;
  int size() const override;
  std::string backend() const override { return "shm"; }
  std::chrono::milliseconds timeout() const override;

  WorkPtr allreduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr broadcast(at::Tensor tensor, int root) override;
  WorkPtr allgather(at::Tensor output, at::Tensor input) override;
  WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) override;
  WorkPtr send(at::Tensor tensor, int dstRank, int tag) override;
  WorkPtr recv(at::Tensor tensor, int srcRank, int tag) override;
  WorkPtr barrier() override;

  // Makes this communicator's failure final with `message` (a failure the caller saw elsewhere,
  // while the other ranks may wait in a collective for this one) and tells the other ranks:
  // their current and later collectives fail, naming this rank.
  void fail(const std::string& message);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace caravan
