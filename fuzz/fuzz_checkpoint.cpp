// libFuzzer target: the checkpoint loader (src/train/checkpoint.cpp, loadCheckpoint) into a
// small model (Linear 4 -> 3) and optimizer (SGD with momentum).
//
// Input: one mode byte, then bytes:
//   mode bit 0 set    the bytes are the whole file (exercises the 24-byte header checks);
//   mode bit 0 clear  the bytes are the payload (a LibTorch zip archive) and the target writes a
//                     valid header (magic, size, CRC-32) in front, so mutations reach the
//                     archive reader, the unpickler and the tensors (LibTorch's zip reader does
//                     not check the entries' CRCs).
// Only CheckpointError may escape loadCheckpoint (it wraps c10::Error from the archive reader).
// Archives that would hit LibTorch defects found here (fuzz/README.md: TorchScript sources other
// than the ones saveCheckpoint writes, pickle lengths past the pickle's end) are skipped unless
// CARAVAN_FUZZ_LIBTORCH is set. With CARAVAN_FUZZ_CHECK_SHAPES=1 a load that changes a
// parameter's shape is a finding too.
#include <zlib.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "fuzz_util.h"
#include "train/checkpoint.h"

namespace {

constexpr size_t kHeaderSize = 24;

const nlohmann::json& expectedMeta() {
  static const nlohmann::json meta = {{"model", "fuzz-linear"}, {"in", 4}, {"out", 3}};
  return meta;
}

uint32_t get32(std::string_view s, size_t off) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= uint32_t{static_cast<uint8_t>(s[off + i])} << (8 * i);
  return v;
}
uint16_t get16(std::string_view s, size_t off) {
  return static_cast<uint16_t>(static_cast<uint8_t>(s[off]) |
                               (static_cast<uint8_t>(s[off + 1]) << 8));
}

// The entries of a zip archive, one per central-directory record: name, compression method
// and the bytes as stored (deflated or not); "?" for an entry that cannot be located.
struct ZipEntry {
  std::string name;
  uint16_t method = 0;
  std::string bytes = "?";
  bool operator<(const ZipEntry& o) const {
    return std::tie(name, method, bytes) < std::tie(o.name, o.method, o.bytes);
  }
};
std::vector<ZipEntry> zipEntries(std::string_view zip) {
  std::vector<ZipEntry> out;
  for (size_t c = 0; c + 46 <= zip.size(); ++c) {
    if (get32(zip, c) != 0x02014b50u) continue;  // central directory file header
    ZipEntry e;
    e.name = zip.substr(c + 46, get16(zip, c + 28));
    e.method = get16(zip, c + 10);
    const uint64_t size = get32(zip, c + 20), local = get32(zip, c + 42);
    if (local + 30 <= zip.size() && get32(zip, local) == 0x04034b50u) {
      const uint64_t start = local + 30 + get16(zip, local + 26) + get16(zip, local + 28);
      if (start + size <= zip.size()) e.bytes = zip.substr(start, size);
    }
    out.push_back(std::move(e));
  }
  return out;
}

bool isCode(const std::string& name) { return name.find("/code/") != std::string::npos; }

// Whether no length in the pickle `p` (opcodes walked as LibTorch's Unpickler reads them)
// exceeds the bytes that follow it, nor a memo index the pickle's size. LibTorch 1.13 reserves
// such lengths before reading (Unpickler::readBytes; LONG_BINPUT reserves 2x the index):
// gigabytes from a few bytes (fuzz/README.md). Stops at STOP or an opcode it does not know.
bool picklePlausible(std::string_view p) {
  auto le = [&](size_t at, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(p[at + i])} << (8 * i);
    return v;
  };
  for (size_t i = 0; i < p.size();) {
    const auto op = static_cast<uint8_t>(p[i++]);
    const size_t left = p.size() - i;
    int fixed = -1, lenBytes = 0, lines = 0;
    switch (op) {
      case '(': case ')': case 't': case 0x85: case 0x86: case 0x87: case '}': case ']':
      case 'e': case 'a': case 'u': case 's': case 0x88: case 0x89: case 'N': case 'R':
      case 'b': case 0x81: case 'Q': case 0x94: case '0': case '1': case '2': case 'l':
      case 'd': case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93:
        fixed = 0; break;
      case 0x80: case 'q': case 'h': case 'K': fixed = 1; break;
      case 'M': fixed = 2; break;
      case 'J': case 'j': fixed = 4; break;
      case 'r':  // LONG_BINPUT: memo indices count up from 0, one per opcode at most
        if (left < 4 || le(i, 4) > p.size()) return false;
        fixed = 4; break;
      case 'G': case 0x95: fixed = 8; break;
      case 0x8a: case 'U': case 'C': lenBytes = 1; break;
      case 0x8b: case 'X': case 'T': case 'B': lenBytes = 4; break;
      case 0x8d: case 0x8e: case 0x96: lenBytes = 8; break;
      case 'I': case 'L': case 'F': case 'S': case 'V': case 'p': case 'g': lines = 1; break;
      case 'c': case 'i': lines = 2; break;
      default: return true;  // STOP, or an opcode LibTorch refuses anyway
    }
    if (fixed >= 0) {
      if (left < static_cast<size_t>(fixed)) return true;
      i += fixed;
    } else if (lenBytes > 0) {
      if (left < static_cast<size_t>(lenBytes)) return true;
      const uint64_t n = le(i, lenBytes);
      if (n > left - lenBytes) return false;
      i += lenBytes + n;
    } else {
      for (int k = 0; k < lines && i < p.size(); ++k) {
        const size_t nl = p.find('\n', i);
        i = nl == std::string_view::npos ? p.size() : nl + 1;
      }
    }
  }
  return true;
}

std::string withHeader(const std::string& payload) {
  std::string file("CRVNCKP1", 8);
  const uint64_t size = payload.size();
  for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>((size >> (8 * i)) & 0xff));
  const uint32_t crc = static_cast<uint32_t>(crc32(
      crc32(0L, Z_NULL, 0), reinterpret_cast<const Bytef*>(payload.data()), payload.size()));
  for (int i = 0; i < 4; ++i) file.push_back(static_cast<char>((crc >> (8 * i)) & 0xff));
  file.append(4, '\0');
  return file + payload;
}

struct Victim {
  torch::nn::Linear model{4, 3};
  torch::optim::SGD optimizer{model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9)};
};

std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Payloads saveCheckpoint writes for the victim: fresh, and after a step (momentum buffers,
// a strategy state).
std::vector<std::string> savedPayloads() {
  torch::manual_seed(0);
  Victim v;
  caravan::TrainingState state;
  state.meta = expectedMeta();
  state.rngState = at::detail::getDefaultCPUGenerator().get_state();
  const std::string path = caravan::fuzz::scratchPath("checkpoint-seed");
  std::vector<std::string> payloads;
  for (int steps = 0; steps < 2; ++steps) {
    if (steps > 0) {
      v.optimizer.zero_grad();
      v.model(torch::ones({2, 4})).sum().backward();
      v.optimizer.step();
      state.step = steps;
      state.position = {1, 7};
      state.elapsedSeconds = 1.5;
      state.workers = 2;
      state.batchSize = 8;
      state.strategy["residual"] = at::linspace(-1.0, 1.0, 15, at::kFloat);
    }
    caravan::saveCheckpoint(path, *v.model, v.optimizer, state);
    payloads.push_back(readAll(path).substr(kHeaderSize));
  }
  std::remove(path.c_str());
  return payloads;
}

// Seeds: the real checkpoints as payloads (mode 0) and one as a whole file (mode 1).
void writeSeeds(const std::string& dir) {
  const std::vector<std::string> payloads = savedPayloads();
  for (size_t i = 0; i < payloads.size(); ++i) {
    caravan::fuzz::writeSeed(dir, "step-" + std::to_string(i) + "-payload",
                             std::string(1, '\0') + payloads[i]);
  }
  caravan::fuzz::writeSeed(dir, "step-1-file", std::string(1, '\1') + withHeader(payloads[1]));
}

// Whether `zip` stays clear of the LibTorch defects that fuzz/README.md describes: its
// TorchScript sources are exactly the ones saveCheckpoint writes for the victim (one of its
// checkpoints', byte for byte) and its stored pickles' lengths are plausible.
bool clearOfKnownLibTorchDefects(std::string_view zip) {
  static const auto knownCode = [] {
    std::set<std::multiset<ZipEntry>> all;
    for (const auto& payload : savedPayloads()) {
      std::multiset<ZipEntry> code;
      for (auto& e : zipEntries(payload)) {
        if (isCode(e.name)) code.insert(std::move(e));
      }
      all.insert(std::move(code));
    }
    return all;
  }();
  std::multiset<ZipEntry> code;
  for (auto& e : zipEntries(zip)) {
    if (isCode(e.name)) {
      code.insert(std::move(e));
    } else if (e.name.size() >= 4 && e.name.compare(e.name.size() - 4, 4, ".pkl") == 0 &&
               (e.method != 0 || !picklePlausible(e.bytes))) {
      return false;  // (saveCheckpoint stores pickles uncompressed)
    }
  }
  return knownCode.count(code) > 0;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  at::set_num_threads(1);
  return caravan::fuzz::initialize(writeSeeds);
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  std::string bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  static const bool allOfLibTorch = std::getenv("CARAVAN_FUZZ_LIBTORCH") != nullptr;
  if (!allOfLibTorch &&
      !clearOfKnownLibTorchDefects(std::string_view(bytes).substr(
          (mode & 1) ? std::min(bytes.size(), kHeaderSize) : 0))) {
    return -1;  // not added to the corpus
  }
  if ((mode & 1) == 0) bytes = withHeader(bytes);
  static const std::string path = caravan::fuzz::scratchPath("checkpoint");
  caravan::fuzz::writeFile(path, bytes.data(), bytes.size());

  static const bool checkShapes = [] {
    const char* v = std::getenv("CARAVAN_FUZZ_CHECK_SHAPES");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  Victim v;
  caravan::fuzz::runGuarded("checkpoint", [&] {
    caravan::loadCheckpoint(path, *v.model, v.optimizer, expectedMeta());
    if (checkShapes && (v.model->weight.sizes() != at::IntArrayRef{3, 4} ||
                        v.model->bias.sizes() != at::IntArrayRef{3})) {
      std::fprintf(stderr, "\nfuzz checkpoint: the load changed the model's shapes: weight %s, "
                           "bias %s\n",
                   c10::str(v.model->weight.sizes()).c_str(),
                   c10::str(v.model->bias.sizes()).c_str());
      std::abort();
    }
  });
  return 0;
}
