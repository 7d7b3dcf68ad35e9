// HierarchicalCommunicator: the communicator of a job whose ranks span several hosts
// (dist.backend = auto). An all-reduce takes three steps, so that the links between hosts carry
// one rank's bytes per host instead of every rank's:
//   1. the ranks of each host all-reduce through shared memory (ShmCommunicator);
//   2. one rank per host, its leader (the host's lowest rank), all-reduce the hosts' sums over
//      Gloo (striped over dist.connections connections, gloo_communicator.h);
//   3. each leader broadcasts the result to its host's ranks through shared memory.
// The other operations (broadcast, all-gather, reduce-scatter, send/recv, barrier) go over one
// Gloo communicator of every rank (`flat`).
//
// Order and rounding: a sum is taken per host (in rank order there), then over hosts (in Gloo's
// ring order), so it differs from a flat Gloo all-reduce by the float32 rounding of a sum of
// size() terms in another order. bfloat16 is reduced in float32 through the three steps and
// rounded once; AVG sums, then divides by size().
//
// Failures: the leaders' step waits at most `flat`'s timeout; the host's steps twice that, since
// a host's other ranks wait in the broadcast while their leader talks to the other hosts (so
// timeout(), the default for callers' waits, is twice `flat`'s on a rank that shares its host). A
// lost peer is named by the step's transport (with the job's rank numbers). The first failure of an
// all-reduce, or a wait for one that timed out, is final for the all-reduces: later ones fail at
// once, and the host's other ranks, which may wait for this one in shared memory, are told
// (ShmCommunicator::fail). The other operations fail as `flat` does.
// Threading: all-reduces run one after another on a thread of this communicator (CommThread),
// in issue order; issue from one thread at a time (communicator.h).
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/comm_thread.h"
#include "comm/communicator.h"
#include "comm/shm_communicator.h"

namespace caravan {

// Who shares a host with `rank`, from every rank's host identity (exchangeHostIdentities).
struct HostGroups {
  std::vector<int> local;    // the ranks on rank's host, ascending (local[0] is its leader)
  std::vector<int> leaders;  // every host's leader, ascending
};
HostGroups hostGroups(const std::vector<std::string>& hosts, int rank);

// Rank `rank`'s communicator, from every rank's host identity: `flat` of every rank; the
// ranks of each host through shared memory (`shm`, under `store`, prefix "host<leader>"); the
// leaders through makeGloo(store prefixed "leaders", rank among them, their number). Every rank
// calls it concurrently (rendezvous: its host's ranks, then the leaders).
using GlooMaker = std::function<std::shared_ptr<Communicator>(c10::intrusive_ptr<c10d::Store> store,
                                                              int rank, int size)>;
std::unique_ptr<Communicator> makeHierarchical(const std::vector<std::string>& hosts, int rank,
                                               std::shared_ptr<Communicator> flat,
                                               c10::intrusive_ptr<c10d::Store> store,
                                               const ShmOptions& shm, const GlooMaker& makeGloo);

class HierarchicalCommunicator final : public Communicator {
 public:
  // `flat`: every rank (Gloo). `local`: the ranks of this host, in rank order (null when this
  // rank is alone on its host). `leaders`: one rank per host (null on a rank that is not its
  // host's leader). `groups` says which ranks those are (for messages).
  HierarchicalCommunicator(std::shared_ptr<Communicator> flat,
                           std::shared_ptr<ShmCommunicator> local,
                           std::shared_ptr<Communicator> leaders, HostGroups groups);
  ~HierarchicalCommunicator() override;

  int rank() const override { return flat_->rank(); }
  int size() const override { return flat_->size(); }
  std::string backend() const override { return "hierarchical"; }
  // An all-reduce's bound: twice `flat`'s timeout on a rank that shares its host (it waits
  // through the leaders' step), `flat`'s otherwise.
  std::chrono::milliseconds timeout() const override;

  WorkPtr allreduce(at::Tensor tensor, ReduceOp op) override;
  WorkPtr broadcast(at::Tensor tensor, int root) override;
  WorkPtr allgather(at::Tensor output, at::Tensor input) override;
  WorkPtr reduceScatter(at::Tensor output, at::Tensor input, ReduceOp op) override;
  WorkPtr send(at::Tensor tensor, int dstRank, int tag) override;
  WorkPtr recv(at::Tensor tensor, int srcRank, int tag) override;
  WorkPtr barrier() override;

 private:
  struct Shared;  // what the Works share with it: the failure latch, the host's communicator
  std::shared_ptr<Communicator> flat_, leaders_;
  std::shared_ptr<Shared> shared_;
  HostGroups groups_;
  uint64_t allreduces_ = 0;
  CommThread thread_;  // last: joined before the communicators go
};

}  // namespace caravan
