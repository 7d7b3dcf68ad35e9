// 16-bit ring all-reduce and top-k with error feedback (see compression.h).
#include "sync/compression.h"

#include <cmath>

#include <fmt/format.h>

#include "core/errors.h"

namespace caravan {

Compression parseCompression(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "fp16") return Compression::kFp16;
  if (name == "bf16") return Compression::kBf16;
  if (name == "topk") return Compression::kTopK;
  throw ConfigError(fmt::format("unknown compression \"{}\"; use none, fp16, bf16 or topk", name));
}

void ringAllreduce16(Communicator& comm, at::Tensor buffer, at::ScalarType wire, int tag,
                     std::chrono::milliseconds timeout) {
  CARAVAN_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous(),
                "ringAllreduce16 needs a contiguous float32 buffer");
  CARAVAN_CHECK(wire == at::kHalf || wire == at::kBFloat16, "wire type must be 16-bit");
  const int w = comm.size(), r = comm.rank();
  if (w == 1) return;
  const int64_t n = buffer.numel();
  auto chunk = [&](int i) {
    const int64_t begin = n * i / w, end = n * (i + 1) / w;
    return buffer.narrow(0, begin, end - begin);
  };
  const int right = (r + 1) % w, left = (r + w - 1) % w;
  auto mod = [w](int i) { return ((i % w) + w) % w; };
  // One hop: send chunk `out` to the right, receive chunk `in` from the left.
  auto hop = [&](int out, int in, bool accumulate) {
    at::Tensor sent = chunk(out).to(wire);
    at::Tensor got = at::empty({chunk(in).numel()}, at::TensorOptions().dtype(wire));
    WorkPtr recv = comm.recv(got, left, tag);
    WorkPtr send = comm.send(sent, right, tag);
    recv->wait(timeout);
    send->wait(timeout);
    if (accumulate) {
      chunk(in).add_(got.to(at::kFloat));
    } else {
      chunk(in).copy_(got);
    }
  };
  for (int s = 0; s < w - 1; ++s) hop(mod(r - s), mod(r - s - 1), true);
  // This rank now holds the full sum of chunk r+1: round it as the others will receive it.
  at::Tensor owned = chunk(mod(r + 1));
  owned.copy_(owned.to(wire));
  for (int s = 0; s < w - 1; ++s) hop(mod(r + 1 - s), mod(r - s), false);
}

TopKCodec::TopKCodec(int64_t numel, double ratio) {
  CARAVAN_CHECK(ratio > 0.0 && ratio <= 1.0, "top-k ratio {} outside (0, 1]", ratio);
  CARAVAN_CHECK(numel < (int64_t{1} << 31), "top-k indices are int32; bucket of {} elements",
                numel);
  k_ = numel == 0 ? 0
                  : std::min<int64_t>(numel, std::max<int64_t>(1, static_cast<int64_t>(std::ceil(
                                                                      ratio * numel))));
  residual_ = at::zeros({numel}, at::kFloat);
}

at::Tensor TopKCodec::encode(const at::Tensor& grad) {
  residual_.add_(grad.reshape({-1}));
  at::Tensor idx = k_ == residual_.numel()
                       ? at::arange(k_, at::kLong)
                       : std::get<1>(residual_.abs().topk(k_, 0, /*largest=*/true,
                                                          /*sorted=*/false));
  at::Tensor values = residual_.index_select(0, idx);
  residual_.index_fill_(0, idx, 0.0);
  return at::cat({values, idx.to(at::kInt).view(at::kFloat)});
}

void TopKCodec::decode(const at::Tensor& gathered, int world, at::Tensor& out) const {
  out.zero_();
  for (int j = 0; j < world; ++j) {
    at::Tensor msg = gathered.narrow(0, j * 2 * k_, 2 * k_);
    at::Tensor idx = msg.narrow(0, k_, k_).view(at::kInt).to(at::kLong);
    const at::Tensor outside = idx.lt(0).logical_or_(idx.ge(out.numel()));
    if (outside.any().item<bool>()) {
      throw PeerError(fmt::format(
          "a top-k message holds index {}, outside the {} entries of its bucket (a peer runs "
          "another version of caravan, or the message was damaged)",
          idx.masked_select(outside)[0].item<int64_t>(), out.numel()));
    }
    out.index_add_(0, idx, msg.narrow(0, 0, k_));
  }
}

ShardCodec::ShardCodec(Compression compression, int64_t numel, double topkRatio)
    : compression_(compression), numel_(numel) {
  switch (compression_) {
    case Compression::kNone: words_ = numel; break;
    case Compression::kFp16:
    case Compression::kBf16: words_ = (numel + 1) / 2; break;
    case Compression::kTopK:
      topk_ = std::make_unique<TopKCodec>(numel, topkRatio);
      words_ = 2 * topk_->k();
      break;
  }
}

at::Tensor ShardCodec::encode(const at::Tensor& grad) {
  CARAVAN_CHECK_EQ(grad.numel(), numel_, "ShardCodec: the gradient's elements vs the codec's");
  switch (compression_) {
    case Compression::kNone: return grad.reshape({-1});
    case Compression::kFp16:
    case Compression::kBf16: {
      const auto wire = compression_ == Compression::kFp16 ? at::kHalf : at::kBFloat16;
      at::Tensor packed = at::zeros({2 * words_}, at::TensorOptions().dtype(wire));
      packed.narrow(0, 0, numel_).copy_(grad.reshape({-1}));
      return packed.view(at::kFloat);
    }
    case Compression::kTopK: return topk_->encode(grad);
  }
  return {};
}

at::Tensor ShardCodec::decode(const at::Tensor& words) const {
  CARAVAN_CHECK(words.numel() == words_ && words.scalar_type() == at::kFloat,
                "ShardCodec: {} words, expected {}", words.numel(), words_);
  switch (compression_) {
    case Compression::kNone: return words;
    case Compression::kFp16:
    case Compression::kBf16: {
      const auto wire = compression_ == Compression::kFp16 ? at::kHalf : at::kBFloat16;
      return words.contiguous().view(wire).narrow(0, 0, numel_).to(at::kFloat);
    }
    case Compression::kTopK: {
      at::Tensor out = at::empty({numel_}, at::kFloat);
      topk_->decode(words.contiguous(), 1, out);
      return out;
    }
  }
  return {};
}

}  // namespace caravan
