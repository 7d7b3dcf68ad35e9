// DiLoCo through parameter servers (sync.mode = "ps-diloco", ALGORITHMS.md §1.6 on the §1.2
// topology): the outer optimizer runs on the servers instead of on every worker.
//
// The world's first W ranks are workers, the last S (sync.servers) servers; the flat parameter
// vector is cut into S shards as for ps-bsp (ShardLayout). Server s holds its shard of θ_sync and
// of the outer momentum. A DiLoCo exchange of fragment f (diloco.h's schedule, F = 1: the whole
// vector) is one round: every worker pushes each server the piece of its pseudo-gradient
// Δ = θ̂ − θ where f meets the server's shard (possibly empty), the server averages the W pieces
// in rank order, takes the outer Nesterov step (outerNesterovStep) on θ_sync and replies with
// the piece of θ̂, the parameters the workers continue from, which every worker installs.
//
//   compression none   pushes and replies are float32; θ̂ = θ_sync.
//   int8, int4         pushes are QuantCodec messages (each worker's error feedback, as among
//                      workers); the reply is one QuantCodec message of θ_sync − θ̂, which the
//                      server and every worker add to their θ̂ (error feedback on the way down:
//                      θ̂ follows θ_sync, and is the same on every worker and the server).
//
// Rounds follow the schedule (nextSync): both sides know from the steps done which fragment
// the next round carries, so every message has a size the receiver knows; each push names its
// round's step, and a server whose schedule says otherwise fails with a PeerError instead of
// applying one fragment's change to another (when the sizes disagree as well, the transport's
// receive fails first, also a PeerError). A push's header
// (ps_message.h) says what it asks: a pseudo-gradient, a checkpoint's state (the server sends
// worker 0 its shard's outer momentum, and θ_sync when quantized, as FlatOptimizerState rows)
// or goodbye; every worker sends the same kind in a round. Non-gradient pushes carry zeros of
// the next round's size and do not advance the schedule.
//
// Start: worker 0 seeds each server with its shard of θ̂, the momentum, θ_sync (quantized) and
// the steps done (seedServers); a new run starts with zero momentum and θ_sync = θ̂.
//
// Threading: the worker side is called from DilocoStrategy on the trainer thread; its
// exchange runs on the communicator's thread between launch() and complete(). A server rank
// runs runDilocoServer on its main thread.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "sync/compression.h"
#include "sync/diloco.h"
#include "sync/parameter_server.h"

namespace caravan {

// The worker side: one round at a time.
class DilocoServerRoute {
 public:
  // `world`: workers then servers; `workers`: the workers' group (its rank 0 seeds).
  DilocoServerRoute(std::shared_ptr<Communicator> world, std::shared_ptr<Communicator> workers,
                    int servers, const DilocoOptions& options, int64_t numel);
  ~DilocoServerRoute();
  // Worker 0 sends each server its shards of `anchor` (θ̂), `momentum` and `serverParams`
  // (θ_sync; undefined: θ̂) and `stepsDone`; the other workers do nothing.
  void seed(const at::Tensor& anchor, const at::Tensor& momentum, const at::Tensor& serverParams,
            int64_t stepsDone);
  // Pushes the pseudo-gradient `delta` of [begin, end) (float32, end - begin values), the round
  // of step `round` (nextSync's t); with int8/int4 `residual` (the same range of this worker's
  // error feedback) is updated.
  void launch(int64_t round, int64_t begin, int64_t end, const at::Tensor& delta,
              const at::Tensor& residual);
  // Waits for the replies of the launched round and writes θ̂ into `anchor` (the whole flat
  // vector; only [begin, end) changes).
  void complete(at::Tensor anchor);
  // A checkpoint, between rounds, the next one being step `round`'s of [begin, end): worker 0
  // gets the servers' outer momentum and θ_sync (the whole flat vector each; θ_sync undefined
  // when it is θ̂).
  void fetchState(int64_t round, int64_t begin, int64_t end, at::Tensor* momentum,
                  at::Tensor* serverParams);
  // The end (the next round as for fetchState): every server returns once every worker said it.
  void goodbye(int64_t round, int64_t begin, int64_t end);

 private:
  struct Round;
  // One message per server for step `round`'s round of [begin, end): `kind`'s header, then the
  // pieces (zeros unless a pseudo-gradient).
  std::vector<at::Tensor> pushes(int64_t round, int64_t begin, int64_t end, PushKind kind,
                                 const at::Tensor& delta, const at::Tensor& residual);

  std::shared_ptr<Communicator> world_;
  std::shared_ptr<Communicator> workers_;
  ShardLayout layout_;
  std::optional<QuantCodec> codec_;
  std::unique_ptr<Round> round_;
};

// A server rank's whole life under ps-diloco: receives its shard from worker 0, then serves
// rounds until every worker said goodbye. `stepDone(t)` after the round of step t, for the
// heartbeat.
void runDilocoServer(Communicator& world, int numWorkers, const DilocoOptions& options,
                     const std::function<void(int64_t)>& stepDone = {});

}  // namespace caravan
