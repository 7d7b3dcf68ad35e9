// libFuzzer target: the token-file reader (src/data/tokens.cpp, loadTokenFiles).
//
// Input: byte 0 picks the id type (bit 0: uint32, else uint16), byte 1 the vocabulary size
// (1-256) and byte 2 the sequence length (1-16); the rest is train.bin, and its first half
// val.bin. A split that loads must give, for every window, exactly the file's ids (the target
// shifted by one), each below the vocabulary.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "data/sources.h"
#include "fuzz_util.h"

namespace {

void fail(const char* what) {
  std::fprintf(stderr, "\nfuzz tokens: %s\n", what);
  std::abort();
}

void writeSeeds(const std::string& dir) {
  using caravan::fuzz::writeSeed;
  std::string ids16, ids32;
  for (uint32_t i = 0; i < 64; ++i) {
    const uint16_t a = static_cast<uint16_t>(i * 5 % 40);
    ids16.append(reinterpret_cast<const char*>(&a), 2);
    ids32.append(reinterpret_cast<const char*>(&i), 4);
  }
  writeSeed(dir, "uint16", std::string("\x00\x28\x08", 3) + ids16);
  writeSeed(dir, "uint32", std::string("\x01\x40\x04", 3) + ids32);
  writeSeed(dir, "odd", std::string("\x00\x28\x02", 3) + ids16 + "x");
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) { return caravan::fuzz::initialize(writeSeeds); }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 3) return 0;
  static const std::string dir = caravan::fuzz::scratchPath("tokens-dir");
  std::filesystem::create_directories(dir);
  caravan::TokenFileOptions o;
  o.dir = dir;
  o.dtype = (data[0] & 1) ? "uint32" : "uint16";
  o.vocabSize = data[1] + 1;
  o.seqLen = data[2] % 16 + 1;
  const uint8_t* body = data + 3;
  const size_t n = size - 3;
  caravan::fuzz::writeFile(dir + "/train.bin", body, n);
  caravan::fuzz::writeFile(dir + "/val.bin", body, n / 2);
  caravan::fuzz::runGuarded("tokens", [&] {
    const caravan::DatasetSplits s = caravan::loadTokenFiles(o);
    const int width = (data[0] & 1) ? 4 : 2;
    auto id = [&](int64_t k) {
      uint32_t v = 0;
      std::memcpy(&v, body + k * width, width);  // little-endian host
      return static_cast<int64_t>(v);
    };
    for (const auto& split : {s.train, s.test}) {
      for (int64_t i = 0; i < split->size(); ++i) {
        const caravan::Batch b = split->get({i});
        for (int64_t t = 0; t < o.seqLen; ++t) {
          const int64_t in = b.input[0][t].item<int64_t>(), out = b.target[0][t].item<int64_t>();
          if (in != id(i * o.seqLen + t) || out != id(i * o.seqLen + t + 1)) {
            fail("a window is not the file's ids");
          }
          if (in >= o.vocabSize || out >= o.vocabSize) fail("an id past the vocabulary loaded");
        }
      }
    }
  });
  return 0;
}
