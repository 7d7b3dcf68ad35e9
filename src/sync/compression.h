// Gradient compression (sync.compression), ALGORITHMS.md §1.5, for the all-reduce strategy
// and the parameter servers' pushes (ShardCodec below):
//
//   fp16, bf16  the bucket travels as 16-bit values: a ring reduce-scatter then all-gather over
//               send/recv (ringAllreduce16), each hop adding in float32, so every rank sends
//               and receives 2(W-1)/W x 2 bytes per element (float32's ring: x 4). The reduced
//               chunks are rounded to 16 bits once more before the all-gather, so every rank
//               ends with identical values.
//   topk        (DGC, Lin et al. 2018) with error feedback: each rank adds the gradient to its
//               residual, sends the k = ceil(ratio * n) largest-magnitude entries as (value,
//               index) through one all-gather and keeps the rest in the residual; nothing is
//               dropped, only delayed. Ratio 1 sends everything (= no compression up to the
//               order of the float sums).
//   int8, int4  (pseudo-gradients of diloco and local-sgd, diloco.h) blocks of kQuantBlock
//               values travel as one float32 scale (the block's largest magnitude / 127 or / 7)
//               and rounded 8- or 4-bit integers, with error feedback: what rounding lost stays
//               in the sender's residual and goes with its next exchange. QuantCodec below;
//               every rank gathers every rank's message and sums them in rank order, so every
//               rank ends with the same float32 values.
//
// Threading: ringAllreduce16 blocks its caller (the strategy runs it on its communication
// thread); TopKCodec is used by one thread at a time.
#pragma once

#include <memory>
#include <string>

#include <ATen/ATen.h>

#include "comm/communicator.h"

namespace caravan {

enum class Compression { kNone, kFp16, kBf16, kTopK, kInt8, kInt4 };

// "none" | "fp16" | "bf16" | "topk" | "int8" | "int4" (ConfigError otherwise).
// int8 and int4: for parameter changes (diloco, local-sgd), never gradients.
inline bool isQuantized(Compression c) {
  return c == Compression::kInt8 || c == Compression::kInt4;
}

Compression parseCompression(const std::string& name);

// In place: `buffer` (float32, contiguous) becomes the sum over ranks, with 16-bit `wire`
// values (kHalf or kBFloat16) on the wire. Every rank calls it with the same numel; blocking;
// waits at most `timeout` per hop (PeerError naming the neighbour after that).
void ringAllreduce16(Communicator& comm, at::Tensor buffer, at::ScalarType wire, int tag,
                     std::chrono::milliseconds timeout);

// Top-k selection with error feedback for one bucket of n elements.
class TopKCodec {
 public:
  TopKCodec(int64_t numel, double ratio);
  int64_t k() const { return k_; }
  // residual += grad; returns the packed message: k values then k int32 indices (as float32
  // bits); the sent entries leave the residual.
  at::Tensor encode(const at::Tensor& grad);
  // The sum over ranks of what `gathered` (W packed messages back to back) carries, into `out`
  // (numel elements, overwritten).
  void decode(const at::Tensor& gathered, int world, at::Tensor& out) const;
  const at::Tensor& residual() const { return residual_; }

 private:
  int64_t k_;
  at::Tensor residual_;
};

// Block-scaled int8/int4 with error feedback (kInt8, kInt4): a message for n elements is ceil(n /
// kQuantBlock) float32 scales then the values packed (int8: one byte each; int4: two per byte, as
// value + 8), padded to whole float32 words.
inline constexpr int64_t kQuantBlock = 256;
class QuantCodec {
 public:
  explicit QuantCodec(Compression compression);
  int bits() const { return bits_; }
  // The message's float32 words for n elements.
  int64_t words(int64_t n) const;
  // The message for `values` (float32, contiguous); `residual` (same numel) holds what earlier
  // messages did not carry: it is added to the values before rounding and left holding what
  // this message does not carry.
  at::Tensor encode(const at::Tensor& values, at::Tensor residual) const;
  // `out` (n elements, float32, contiguous) += what `message` (words(n) words) carries.
  void addDecoded(const at::Tensor& message, at::Tensor out) const;

 private:
  int bits_;
  int qmax_;
};

// How a parameter-server push carries a gradient shard of n elements as float32 words, so the
// push stays one float32 message with its control tail: none n words; fp16/bf16 ceil(n/2) words
// of packed 16-bit values (half the bytes); topk 2k words (values, int32 indices), the worker
// keeping the rest in its residual (error feedback). Pulls (parameters) stay float32.
class ShardCodec {
 public:
  ShardCodec(Compression compression, int64_t numel, double topkRatio);
  int64_t words() const { return words_; }
  // Worker: the words for gradient `grad` (numel elements); topk updates the residual.
  at::Tensor encode(const at::Tensor& grad);
  // Server: the dense float32 gradient (numel elements) that `words` carry.
  at::Tensor decode(const at::Tensor& words) const;
  // topk: the worker's residual (numel elements; written in place when resuming); else
  // undefined.
  at::Tensor residual() const { return topk_ ? topk_->residual() : at::Tensor(); }

 private:
  Compression compression_;
  int64_t numel_;
  int64_t words_;
  std::unique_ptr<TopKCodec> topk_;
};

}  // namespace caravan
