// libFuzzer target: the IDX reader (src/data/idx.cpp), Fashion-MNIST's gzipped IDX files.
//
// Input: the file's bytes, written to a scratch file and read with readIdx (zlib reads plain
// files transparently, so plain IDX inputs exercise the header checks directly and gzip ones
// the stream checks). A file that loads must hold exactly the bytes its header describes.
#include <zlib.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "data/sources.h"
#include "fuzz_util.h"

namespace {

std::string idx(const std::vector<uint32_t>& dims, uint8_t seed) {
  std::string out{'\0', '\0', '\x08', static_cast<char>(dims.size())};
  size_t n = 1;
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back(static_cast<char>(d >> shift));
    n *= d;
  }
  for (size_t i = 0; i < n; ++i) out.push_back(static_cast<char>((i * 37 + seed) % 256));
  return out;
}

std::string gzip(const std::string& plain) {
  const std::string path = caravan::fuzz::scratchPath("idx-seed");
  gzFile f = gzopen(path.c_str(), "wb9");
  gzwrite(f, plain.data(), static_cast<unsigned>(plain.size()));
  gzclose(f);
  std::FILE* in = std::fopen(path.c_str(), "rb");
  std::string out;
  for (int c; (c = std::fgetc(in)) != EOF;) out.push_back(static_cast<char>(c));
  std::fclose(in);
  std::remove(path.c_str());
  return out;
}

void writeSeeds(const std::string& dir) {
  using caravan::fuzz::writeSeed;
  writeSeed(dir, "images-2x28x28.gz", gzip(idx({2, 28, 28}, 1)));  // Fashion-MNIST's shapes
  writeSeed(dir, "labels-10.gz", gzip(idx({10}, 3)));
  writeSeed(dir, "images-3x5x5.idx", idx({3, 5, 5}, 7));
  writeSeed(dir, "4d-2x1x3x2.idx", idx({2, 1, 3, 2}, 9));
  writeSeed(dir, "labels-4.idx", idx({4}, 0));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  return caravan::fuzz::initialize(writeSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = caravan::fuzz::scratchPath("idx");
  caravan::fuzz::writeFile(path, data, size);
  caravan::fuzz::runGuarded("idx", [&] {
    const caravan::IdxArray a = caravan::readIdx(path);
    int64_t elements = 1;
    for (int64_t d : a.dims) elements *= d;
    if (a.dims.empty() || a.data.scalar_type() != at::kByte || a.data.numel() != elements ||
        a.data.sizes().vec() != a.dims) {
      std::fprintf(stderr, "\nfuzz idx: readIdx returned a tensor that disagrees with its dims\n");
      std::abort();
    }
  });
  return 0;
}
