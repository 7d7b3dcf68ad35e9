// The messages between parameter-server workers and servers (ps-bsp/asp/ssp in
// parameter_server.h, osp in osp.h, ps-diloco in diloco_servers.h), encoded and decoded here and
// nowhere else, and the round trips these modes make with a group of peers.
//
// A message is one float32 tensor (the communicator moves tensors): a typed header, then the
// payload (gradient values or codec words to a server; parameter values back). The header's
// fields are written as bytes into its first words, not as float values, so a double keeps
// every bit and an integer is never rounded:
//   push (worker -> server)  magic u32 | kind u32 | learning rate f64 | requested fraction f64
//                            | previous stage-1 seconds f64 | seconds since stage 1 f64
//                            | round i64
//   pull (server -> worker)  magic u32 | 0 u32    | staleness i64
//   split (OSP's stage-2 reply, server -> worker)  magic u32 | move reason u32 (0: none) |
//                            next fraction f64 | move step i64 | from f64 | centre f64 |
//                            centre seconds f64 | probe seconds f64
// A header a server cannot read (another magic, an unknown kind, a learning rate that is
// negative or not finite) is a PeerError naming the worker: another version of caravan or a
// process that is not part of this job.
//
// Threading: free functions and a const group; any thread (OSP's stage 2 exchanges on its own).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>

#include "comm/communicator.h"
#include "sync/fraction_search.h"

namespace caravan {

// What a worker's push asks of a server.
enum class PushKind : uint32_t {
  kGradient = 0,  // apply this gradient at the header's learning rate (ps-diloco: this
                  // pseudo-gradient with the outer optimizer's)
  kGoodbye = 1,   // the worker is done (payload zeros); the server returns once all said it
  kSync = 2,      // reply with the current values, apply nothing (asynchronous modes)
  kState = 3,     // a checkpoint: as kSync, then send worker 0 the shard's optimizer state
};

struct PushHeader {
  PushKind kind = PushKind::kGradient;
  double learningRate = 0.0;
  // osp with sync.osp_auto_fraction: the worker's model-based stage-1 share (the search's
  // starting guess); how long its previous stage-1 round took, push to reply, and the time
  // from that reply to this push (0: not measured, fraction_search.h's splitSeconds).
  double requestedFraction = 0.0;
  double stage1Seconds = 0.0;
  double sinceStage1Seconds = 0.0;
  // ps-diloco: the step whose round this push belongs to (nextSync's t; the next round's for a
  // checkpoint or goodbye), which the server checks against its own schedule. 0 elsewhere.
  int64_t round = 0;
  static constexpr int64_t kWords = 12;
};

struct PullHeader {
  int64_t staleness = 0;  // ASP/SSP: the replying server's c_k - min_j c_j (0 under BSP)
  static constexpr int64_t kWords = 4;
};

// OSP's stage-2 reply: the fraction the next split uses, and why it moved, if it did.
struct SplitHeader {
  double fraction = 0.0;
  std::optional<FractionMove> move;
  static constexpr int64_t kWords = 14;
};

// [header | payload]: a float32 tensor of Header::kWords + payload.numel() elements.
at::Tensor encodePush(const PushHeader& header, const at::Tensor& payload);
at::Tensor encodePull(const PullHeader& header, const at::Tensor& payload);
at::Tensor encodeSplit(const SplitHeader& header, const at::Tensor& payload);
// A receive buffer for a message with `payloadWords` after its header.
at::Tensor pushBuffer(int64_t payloadWords);
at::Tensor pullBuffer(int64_t payloadWords);
at::Tensor splitBuffer(int64_t payloadWords);
// The payload of a received message (a view).
at::Tensor pushPayload(const at::Tensor& message);
at::Tensor pullPayload(const at::Tensor& message);
at::Tensor splitPayload(const at::Tensor& message);

// A received push's header; PeerError (naming `worker` and `serverRank`) when it is not one.
PushHeader decodePush(const at::Tensor& message, int worker, int serverRank);
PullHeader decodePull(const at::Tensor& message, int serverRank);
// PeerError naming `serverRank` when it is not one (a fraction outside (0, 1], a reason unknown).
SplitHeader decodeSplit(const at::Tensor& message, int serverRank);

// One synchronous round's pushes (one per worker, in rank order): every worker's header, in
// rank order, all of one kind (PeerError naming the worker that disagrees or whose header is
// not one). Worker 0's learning rate is the round's.
std::vector<PushHeader> decodeRound(const std::vector<at::Tensor>& messages, int serverRank,
                                    int64_t step);

// The mean of the first `n` elements of each payload, summed in rank order.
at::Tensor averagePayloads(const std::vector<at::Tensor>& payloads, int64_t n);

// A worker's peers in a parameter-server job: the servers, the world's last `count` ranks.
class ServerGroup {
 public:
  ServerGroup(Communicator* world, int count) : world_(world), count_(count) {}
  int size() const { return count_; }
  int rank(int s) const { return world_->size() - count_ + s; }

  // One round trip: receives `replies[s]` from server s with `replyTag` (posted first, so a
  // server may answer at once), sends `messages[s]` to it with `tag`, and waits for all, at
  // most `timeout` each. Without `replies`, sends only.
  void exchange(int tag, const std::vector<at::Tensor>& messages, int replyTag,
                const std::vector<at::Tensor>* replies, std::chrono::milliseconds timeout) const;

 private:
  Communicator* world_;
  int count_;
};

// A server's side: receives one message from each of the world's first `workers` ranks with
// `tag` into `messages` (sized by the caller), waiting at most `timeout`.
void receiveFromWorkers(Communicator& world, int tag, std::vector<at::Tensor>& messages,
                        std::chrono::milliseconds timeout);
// Sends `message` to each of the first `workers` ranks with `tag` and waits for the sends.
void sendToWorkers(Communicator& world, int workers, const at::Tensor& message, int tag);

}  // namespace caravan
