// libFuzzer target: what a parameter server does with the contents of the workers' pushes
// (src/sync/compression.cpp ShardCodec::decode for none/fp16/bf16/topk; decodeRound,
// decodePush, pushPayload and averagePayloads from src/sync/ps_message.cpp), as serveBsp,
// serveAsync and the OSP server call them.
//
// Input: 4 header bytes, then float32 words (native byte order):
//   [0] compression (none, fp16, bf16, topk: value % 4)   [1] shard elements n (value % 65)
//   [2] top-k ratio ((value + 1) / 256)                    [3] workers W (1 + value % 4)
//   then W pushes of (PushHeader::kWords + codec words) float32 each: the header (ps_message.h's
//   push layout, as bytes), the encoded gradient; missing bytes are zeros. The
//   communicator fixes the push size; its contents are the peer's.
// A PeerError is the documented answer to a hostile push; nothing else may escape. Every push
// is decoded whatever its kind says.
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "comm/communicator.h"
#include "fuzz_util.h"
#include "sync/compression.h"
#include "sync/ps_message.h"

namespace {

constexpr caravan::Compression kKinds[] = {caravan::Compression::kNone,
                                           caravan::Compression::kFp16,
                                           caravan::Compression::kBf16,
                                           caravan::Compression::kTopK};

struct Header {
  caravan::Compression compression;
  int64_t numel;
  double ratio;
  int workers;
};

Header parseHeader(const uint8_t* data) {
  return {kKinds[data[0] % 4], data[1] % 65, (data[2] + 1) / 256.0, 1 + data[3] % 4};
}

// Seeds: pushes as real workers encode them (gradients, a goodbye, a sync request).
void writeSeeds(const std::string& dir) {
  const uint8_t ratios[] = {0, 63, 255};  // 1/256, 1/4, 1
  int count = 0;
  for (uint8_t kind = 0; kind < 4; ++kind) {
    for (uint8_t numel : {1, 7, 64}) {
      for (uint8_t workers : {0, 2}) {  // W = 1, 3
        const uint8_t ratio = ratios[count % 3];
        const uint8_t head[4] = {kind, numel, ratio, workers};
        const Header h = parseHeader(head);
        caravan::ShardCodec codec(h.compression, h.numel, h.ratio);
        std::string seed(reinterpret_cast<const char*>(head), 4);
        for (int k = 0; k < h.workers; ++k) {
          caravan::PushHeader header;
          header.kind = (count + k) % 4 == 3
                            ? (count % 2 ? caravan::PushKind::kSync : caravan::PushKind::kState)
                            : caravan::PushKind::kGradient;
          header.learningRate = 0.05;
          header.requestedFraction = 0.25 * k;
          at::Tensor grad = at::linspace(-1.0 - k, 2.0 + k, h.numel, at::kFloat);
          at::Tensor push = caravan::encodePush(header, codec.encode(grad).contiguous());
          seed.append(static_cast<const char*>(push.data_ptr()), push.numel() * sizeof(float));
        }
        caravan::fuzz::writeSeed(dir, "push-" + std::to_string(count++), seed);
      }
    }
  }
  // Every worker says goodbye (kind 1, zero gradient).
  const uint8_t head[4] = {3, 16, 63, 1};
  std::string bye(reinterpret_cast<const char*>(head), 4);
  caravan::ShardCodec codec(caravan::Compression::kTopK, 16, 0.25);
  caravan::PushHeader goodbye;
  goodbye.kind = caravan::PushKind::kGoodbye;
  for (int k = 0; k < 2; ++k) {
    at::Tensor push = caravan::encodePush(goodbye, at::zeros({codec.words()}, at::kFloat));
    bye.append(static_cast<const char*>(push.data_ptr()), push.numel() * sizeof(float));
  }
  caravan::fuzz::writeSeed(dir, "goodbye", bye);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return caravan::fuzz::initialize(writeSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  const Header h = parseHeader(data);
  caravan::fuzz::runGuarded("codec", [&] {
    const caravan::ShardCodec codec(h.compression, h.numel, h.ratio);
    const int64_t words = codec.words();
    // W pushes of header + codec words from the input, zero-filled past its end.
    const int64_t pushWords = caravan::PushHeader::kWords + words;
    std::vector<at::Tensor> pushes;
    size_t offset = 4;
    for (int k = 0; k < h.workers; ++k) {
      at::Tensor p = at::zeros({pushWords}, at::kFloat);
      const size_t want = static_cast<size_t>(pushWords) * sizeof(float);
      const size_t have = offset < size ? std::min(want, size - offset) : 0;
      if (have > 0) std::memcpy(p.data_ptr(), data + offset, have);
      offset += want;
      pushes.push_back(p);
    }
    // serveBsp: the round's kind; serveAsync: each push's (a PeerError names the worker).
    try {
      caravan::decodeRound(pushes, /*serverRank=*/h.workers, /*step=*/1);
    } catch (const caravan::PeerError&) {
    }
    for (int k = 0; k < h.workers; ++k) {
      try {
        caravan::decodePush(pushes[k], k, /*serverRank=*/h.workers);
      } catch (const caravan::PeerError&) {
      }
    }
    std::vector<at::Tensor> grads;
    for (const auto& p : pushes) {
      at::Tensor g = codec.decode(caravan::pushPayload(p));
      if (g.scalar_type() != at::kFloat || g.dim() != 1 || g.numel() != h.numel) {
        std::fprintf(stderr, "\nfuzz codec: decode returned %s of %lld elements, expected %lld\n",
                     c10::toString(g.scalar_type()), static_cast<long long>(g.numel()),
                     static_cast<long long>(h.numel));
        std::abort();
      }
      grads.push_back(g);
    }
    const at::Tensor mean = caravan::averagePayloads(grads, h.numel);
    if (mean.numel() != h.numel) {
      std::fprintf(stderr, "\nfuzz codec: averagePushes returned %lld elements, expected %lld\n",
                   static_cast<long long>(mean.numel()), static_cast<long long>(h.numel));
      std::abort();
    }
  });
  return 0;
}
