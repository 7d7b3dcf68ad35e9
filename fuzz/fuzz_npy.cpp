// libFuzzer target: the .npy reader (src/data/npy.cpp: parseNpyHeader, loadNpyArrays).
//
// Input: one .npy file, written as all four arrays of a data directory (train and test inputs
// and targets). If it loads, every example must be the file's bytes at its offset (uint8 inputs
// scaled to [0, 1], uint8 targets widened), and integer targets must be class ids below the
// number of classes the dataset reports.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>

#include "data/sources.h"
#include "fuzz_util.h"

namespace {

void fail(const char* what) {
  std::fprintf(stderr, "\nfuzz npy: %s\n", what);
  std::abort();
}

// A version-1.0 file as np.save writes it.
std::string npy(const std::string& descr, const std::string& shape, const std::string& payload) {
  std::string header =
      "{'descr': '" + descr + "', 'fortran_order': False, 'shape': (" + shape + "), }";
  while ((10 + header.size() + 1) % 64 != 0) header += ' ';
  header += '\n';
  std::string out("\x93NUMPY\x01\x00", 8);
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  return out + header + payload;
}

void writeSeeds(const std::string& dir) {
  using caravan::fuzz::writeSeed;
  std::string floats, longs, bytes;
  for (int i = 0; i < 12; ++i) {
    const float f = 0.5f * static_cast<float>(i);
    const int64_t l = i % 3;
    floats.append(reinterpret_cast<const char*>(&f), 4);
    longs.append(reinterpret_cast<const char*>(&l), 8);
    bytes += static_cast<char>(i * 20);
  }
  writeSeed(dir, "float32", npy("<f4", "3, 2, 2", floats));
  writeSeed(dir, "int64", npy("<i8", "12,", longs));
  writeSeed(dir, "uint8", npy("|u1", "4, 3", bytes));
  writeSeed(dir, "fortran", npy("<f4", "3, 4", floats));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) { return caravan::fuzz::initialize(writeSeeds); }

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string dir = caravan::fuzz::scratchPath("npy-dir");
  std::filesystem::create_directories(dir);
  for (const char* name : {"train_inputs", "train_targets", "test_inputs", "test_targets"}) {
    caravan::fuzz::writeFile(dir + "/" + name + ".npy", data, size);
  }
  caravan::fuzz::runGuarded("npy", [&] {
    const caravan::NpyHeader h =
        caravan::parseNpyHeader(std::string_view(reinterpret_cast<const char*>(data), size),
                                "input", static_cast<int64_t>(size));
    if (h.payloadBytes() < 0 || h.dataOffset + h.payloadBytes() != static_cast<int64_t>(size)) {
      fail("a header whose payload is not the rest of the file was accepted");
    }
    const caravan::DatasetSplits s = caravan::loadNpyArrays(dir);
    const int64_t rows = s.train->size();
    const int64_t rowBytes = h.payloadBytes() / rows;
    const caravan::DataShape shape = s.train->shape();
    for (int64_t i = 0; i < std::min<int64_t>(rows, 64); ++i) {
      const caravan::Batch b = s.train->get({i});
      const uint8_t* row = data + h.dataOffset + i * rowBytes;
      for (const at::Tensor& t : {b.input, b.target}) {
        if (h.dtype == "uint8") {
          const at::Tensor raw =
              t.scalar_type() == at::kFloat ? t.mul(255).round().to(at::kLong) : t;
          const int64_t* v = raw.contiguous().data_ptr<int64_t>();
          for (int64_t k = 0; k < rowBytes; ++k) {
            if (v[k] != row[k]) fail("a uint8 example is not the file's bytes");
          }
        } else if (t.numel() * t.element_size() != rowBytes ||
                   std::memcmp(t.contiguous().data_ptr(), row, rowBytes) != 0) {
          fail("an example is not the file's bytes");
        }
      }
      if (shape.task != caravan::TaskKind::kRegression &&
          (b.target.min().item<int64_t>() < 0 ||
           b.target.max().item<int64_t>() >= shape.numClasses)) {
        fail("a class id outside the classes loaded");
      }
    }
  });
  return 0;
}
