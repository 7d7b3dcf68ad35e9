// 16-bit ring all-reduce and top-k with error feedback (see compression.h).
#include "sync/compression.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/errors.h"

namespace caravan {

Compression parseCompression(const std::string& name) {
  if (name == "none") return Compression::kNone;
  if (name == "fp16") return Compression::kFp16;
  if (name == "bf16") return Compression::kBf16;
  if (name == "topk") return Compression::kTopK;
  if (name == "int8") return Compression::kInt8;
  if (name == "int4") return Compression::kInt4;
  throw ConfigError(
      fmt::format("unknown compression \"{}\"; use none, fp16, bf16, topk, int8 or int4", name));
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

QuantCodec::QuantCodec(Compression compression) {
  CARAVAN_CHECK(compression == Compression::kInt8 || compression == Compression::kInt4,
                "QuantCodec is for int8 and int4");
  bits_ = compression == Compression::kInt8 ? 8 : 4;
  qmax_ = compression == Compression::kInt8 ? 127 : 7;
}

int64_t QuantCodec::words(int64_t n) const {
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  const int64_t bytes = (n * bits_ + 7) / 8;
  return blocks + (bytes + 3) / 4;
}

at::Tensor QuantCodec::encode(const at::Tensor& values, at::Tensor residual) const {
  CARAVAN_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() &&
                    residual.scalar_type() == at::kFloat && residual.is_contiguous() &&
                    values.numel() == residual.numel(),
                "QuantCodec::encode needs contiguous float32 values and residual of one size");
  const int64_t n = values.numel();
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  at::Tensor message = at::zeros({words(n)}, at::kFloat);
  float* scales = message.data_ptr<float>();
  auto* packed = reinterpret_cast<uint8_t*>(scales + blocks);
  const float* v = values.data_ptr<float>();
  float* r = residual.data_ptr<float>();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kQuantBlock, end = std::min(n, begin + kQuantBlock);
    float largest = 0.0f;
    for (int64_t i = begin; i < end; ++i) {
      r[i] += v[i];
      if (!std::isfinite(r[i])) {
        throw NonFiniteError(fmt::format(
            "a parameter change to send holds a non-finite value (element {} of {}): the run "
            "diverged; lower optim.lr or sync.outer_lr",
            i, n));
      }
      largest = std::max(largest, std::fabs(r[i]));
    }
    const float scale = largest / static_cast<float>(qmax_);
    scales[b] = scale;
    for (int64_t i = begin; i < end; ++i) {
      int q = 0;
      if (scale > 0.0f) {
        q = static_cast<int>(std::nearbyint(r[i] / scale));
        q = std::clamp(q, -qmax_, qmax_);
      }
      r[i] -= static_cast<float>(q) * scale;
      if (bits_ == 8) {
        packed[i] = static_cast<uint8_t>(static_cast<int8_t>(q));
      } else {
        packed[i / 2] |= static_cast<uint8_t>((q + 8) << (4 * (i % 2)));
      }
    }
  }
  return message;
}

void QuantCodec::addDecoded(const at::Tensor& message, at::Tensor out) const {
  const int64_t n = out.numel();
  CARAVAN_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous(),
                "QuantCodec::addDecoded needs a contiguous float32 output");
  if (message.numel() != words(n) || message.scalar_type() != at::kFloat) {
    throw PeerError(fmt::format(
        "an int{} message holds {} words where {} elements take {} (a peer runs another "
        "version of caravan, or the message was damaged)",
        bits_, message.numel(), n, words(n)));
  }
  const at::Tensor m = message.contiguous();
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  const float* scales = m.data_ptr<float>();
  const auto* packed = reinterpret_cast<const uint8_t*>(scales + blocks);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const int q = bits_ == 8 ? static_cast<int>(static_cast<int8_t>(packed[i]))
                             : static_cast<int>((packed[i / 2] >> (4 * (i % 2))) & 0xF) - 8;
    o[i] += static_cast<float>(q) * scales[i / kQuantBlock];
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
    case Compression::kInt8:
    case Compression::kInt4:
      CARAVAN_CHECK(false, "parameter-server pushes are not int8/int4 (validate() refuses it)");
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
    case Compression::kInt8:
    case Compression::kInt4: break;
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
    case Compression::kInt8:
    case Compression::kInt4: break;
  }
  return {};
}

}  // namespace caravan
