// Checkpoint files (see checkpoint.h).
#include "train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>

#include <caffe2/serialize/inline_container.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/jit/serialization/export.h>
#include <torch/csrc/jit/serialization/pickler.h>
#include <torch/torch.h>

#include "core/errors.h"
#include "core/files.h"
#include "train/checkpoint_file.h"
#include "train/sharded_checkpoint.h"

namespace caravan {
namespace fs = std::filesystem;
namespace {

constexpr char kMagic[8] = {'C', 'R', 'V', 'N', 'C', 'K', 'P', '1'};
constexpr size_t kHeaderSize = 24;

void putLe(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t getLe(const std::string& in, size_t off, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<uint8_t>(in[off + i])) << (8 * i);
  return v;
}

// An output stream buffer onto a file descriptor that keeps the CRC-32 and the length of what
// went through it: a checkpoint's payload goes to the file as it is serialized, never whole in
// memory (with out-of-core weights the model itself is all the memory there is to spare).
// A failed write (a full disk) is remembered and the rest is dropped, so LibTorch's archive
// writer finishes normally (an exception inside it would end the process in its destructor);
// throwIfFailed() then reports it.
class CrcFileBuf final : public std::streambuf {
 public:
  CrcFileBuf(int fd, std::string path) : fd_(fd), path_(std::move(path)), buffer_(1 << 20) {
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }
  uint32_t crc() const { return static_cast<uint32_t>(crc_); }
  void throwIfFailed() const {
    if (!error_.empty()) throw IoError(error_);
  }
  uint64_t size() const { return size_; }
  void flush() {
    const size_t n = static_cast<size_t>(pptr() - pbase());
    if (n == 0) return;
    crc_ = crc32(crc_, reinterpret_cast<const Bytef*>(pbase()), static_cast<uInt>(n));
    if (error_.empty()) {
      try {
        writeAll(fd_, pbase(), n, path_);
      } catch (const IoError& e) {
        error_ = e.what();
      }
    }
    size_ += n;
    setp(buffer_.data(), buffer_.data() + buffer_.size());
  }

 protected:
  int_type overflow(int_type c) override {
    flush();
    if (!traits_type::eq_int_type(c, traits_type::eof())) {
      *pptr() = traits_type::to_char_type(c);
      pbump(1);
    }
    return traits_type::not_eof(c);
  }
  int sync() override {
    flush();
    return 0;
  }

 private:
  int fd_;
  std::string path_;
  std::vector<char> buffer_;
  uLong crc_ = crc32(0L, Z_NULL, 0);
  uint64_t size_ = 0;
  std::string error_;  // the first failed write's message
};

// Optimizer state as LibTorch's Optimizer::load reads it, except that each parameter's state
// key is read as a 1.13 build wrote it. LibTorch keys a parameter's state by its TensorImpl's
// address written as text (torch/optim/serialize.h: state/<key>, and param_groups/<i>/params/<j>
// naming the same key in parameter order). 1.13 wrote the address as "0x55d0..."; 2.x writes
// and reads decimal, and its std::stoull read every 1.13 key as 0: all states under one key,
// and glibc aborted ("free(): invalid size"). The keys only pair states with parameters, so the
// pairing is by the text itself here, the values unchanged.
template <typename State, typename Options>
void loadOptimizerOf113(torch::serialize::InputArchive& archive,
                        torch::optim::Optimizer& optimizer) {
  c10::IValue version;
  archive.read("pytorch_version", version);
  torch::serialize::InputArchive stateArchive;
  archive.read("state", stateArchive);
  std::map<std::string, std::unique_ptr<State>> saved;
  for (const std::string& key : stateArchive.keys()) {
    torch::serialize::InputArchive one;
    stateArchive.read(key, one);
    auto state = std::make_unique<State>();
    state->serialize(one);
    saved[key] = std::move(state);
  }
  torch::serialize::InputArchive groupsArchive;
  archive.read("param_groups", groupsArchive);
  at::Tensor groups;
  groupsArchive.read("param_groups/size", groups);
  auto& ours = optimizer.param_groups();
  if (groups.item<int64_t>() != static_cast<int64_t>(ours.size())) {
    throw std::runtime_error("its optimizer has another number of parameter groups");
  }
  for (size_t i = 0; i < ours.size(); ++i) {
    torch::serialize::InputArchive group;
    groupsArchive.read("param_groups/" + std::to_string(i), group);
    at::Tensor size;
    group.read("params/size", size);
    const std::vector<at::Tensor>& params = ours[i].params();
    if (size.item<int64_t>() != static_cast<int64_t>(params.size())) {
      throw std::runtime_error("its optimizer has another number of parameters");
    }
    for (size_t j = 0; j < params.size(); ++j) {
      c10::IValue key;
      group.read("params/" + std::to_string(j), key);
      auto it = saved.find(key.toStringRef());
      // A key named twice moves nothing the second time: checkOptimizerState refuses the null.
      if (it != saved.end())
        optimizer.state()[params[j].unsafeGetTensorImpl()] = std::move(it->second);
    }
    torch::serialize::InputArchive optionsArchive;
    group.read("options", optionsArchive);
    Options options(0);
    options.serialize(optionsArchive);
    static_cast<Options&>(ours[i].options()) = options;
  }
  for (const auto& [key, state] : saved) {
    if (state) throw std::runtime_error("its optimizer has a state for no parameter of the model");
  }
}

// True when the optimizer archive was written by a 1.13 build (its keys are "0x..." text).
bool writtenBy113(torch::serialize::InputArchive& archive) {
  torch::serialize::InputArchive groupsArchive;
  archive.read("param_groups", groupsArchive);
  torch::serialize::InputArchive first;
  if (!groupsArchive.try_read("param_groups/0", first)) return false;
  c10::IValue key;
  return first.try_read("params/0", key) && key.isString() && key.toStringRef().rfind("0x", 0) == 0;
}

// Every state the checkpoint gave a parameter fits it. A damaged or crafted file whose keys name
// one state twice, or pair a state with a parameter of another shape, loaded and then crashed the
// first step (a null state, or the fused loops writing past a buffer: SIGSEGV).
void checkOptimizerState(torch::optim::Optimizer& optimizer) {
  for (const auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      auto it = optimizer.state().find(p.unsafeGetTensorImpl());
      if (it == optimizer.state().end()) continue;
      if (!it->second) throw std::runtime_error("its optimizer names one state for two parameters");
      std::vector<at::Tensor> tensors;
      if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get())) {
        tensors = {s->exp_avg(), s->exp_avg_sq()};
      } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(it->second.get())) {
        tensors = {s->momentum_buffer()};
      }
      for (const at::Tensor& t : tensors) {
        if (!t.defined() || t.sizes() != p.sizes() || t.scalar_type() != p.scalar_type()) {
          throw std::runtime_error(fmt::format(
              "its optimizer state for a parameter of shape [{}] is {}", fmt::join(p.sizes(), ", "),
              t.defined() ? fmt::format("[{}] {}", fmt::join(t.sizes(), ", "),
                                        c10::toString(t.scalar_type()))
                          : std::string("empty")));
        }
      }
    }
  }
}

void loadOptimizer(torch::serialize::InputArchive& archive, torch::optim::Optimizer& optimizer) {
  if (!writtenBy113(archive)) {
    optimizer.load(archive);
    checkOptimizerState(optimizer);
    return;
  }
  if (dynamic_cast<torch::optim::AdamW*>(&optimizer)) {
    loadOptimizerOf113<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(archive,
                                                                                  optimizer);
  } else if (dynamic_cast<torch::optim::SGD*>(&optimizer)) {
    loadOptimizerOf113<torch::optim::SGDParamState, torch::optim::SGDOptions>(archive, optimizer);
  } else {
    throw std::runtime_error(
        "its optimizer state was written by LibTorch 1.13 for an optimizer this build reads "
        "only from LibTorch 2.x checkpoints");
  }
  checkOptimizerState(optimizer);
}

}  // namespace

void writeTrainingState(torch::serialize::OutputArchive& archive, const TrainingState& state) {
  archive.write("step", c10::IValue(state.step));
  archive.write("epoch", c10::IValue(state.position.epoch));
  archive.write("batch_in_epoch", c10::IValue(state.position.batchInEpoch));
  archive.write("rng", state.rngState, /*is_buffer=*/true);
  archive.write("elapsed_s", c10::IValue(state.elapsedSeconds));
  archive.write("bf16_blocks", c10::IValue(state.bf16Blocks));
  archive.write("meta", c10::IValue(state.meta.dump()));
  archive.write("workers", c10::IValue(state.workers));
  archive.write("batch_size", c10::IValue(state.batchSize));
  torch::serialize::OutputArchive strategyArchive;
  for (const auto& [name, tensor] : state.strategy) strategyArchive.write(name, tensor);
  archive.write("strategy", strategyArchive);
}

namespace {

// The container around what `payload` writes to its stream: the header (magic, payload length,
// CRC-32) written last, over a placeholder, the payload streamed to the file.
ArchiveSum writeContainer(const std::string& path,
                          const std::function<void(std::ostream&)>& payload) {
  ArchiveSum sum;
  writeFileAtomic(path, [&](int fd, const std::string& tmp) {
    writeAll(fd, std::string(kHeaderSize, '\0').data(), kHeaderSize, tmp);
    CrcFileBuf buf(fd, tmp);
    {
      std::ostream out(&buf);
      payload(out);
      out.flush();
    }
    buf.flush();
    buf.throwIfFailed();
    sum.size = buf.size();
    sum.crc = buf.crc();
    std::string header(kMagic, sizeof(kMagic));
    putLe(header, sum.size, 8);
    putLe(header, sum.crc, 4);
    putLe(header, 0, 4);
    if (::pwrite(fd, header.data(), header.size(), 0) != static_cast<ssize_t>(header.size())) {
      throw IoError(fmt::format("cannot write {}: {} (free disk space and retry)", tmp,
                                std::strerror(errno)));
    }
  });
  return sum;
}

// A zip writer onto `out` (what it writes goes to the stream at once).
caffe2::serialize::PyTorchStreamWriter zipOnto(std::ostream& out) {
  return caffe2::serialize::PyTorchStreamWriter([&out](const void* data, size_t n) {
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    return n;
  });
}

}  // namespace

ArchiveSum writeArchiveFile(const std::string& path, torch::serialize::OutputArchive& archive) {
  return writeContainer(path, [&](std::ostream& out) { archive.save_to(out); });
}

ArchiveSum writeRecordsFile(
    const std::string& path,
    const std::function<void(caffe2::serialize::PyTorchStreamWriter&)>& write) {
  return writeContainer(path, [&](std::ostream& out) {
    caffe2::serialize::PyTorchStreamWriter zip = zipOnto(out);
    write(zip);
    zip.writeEndOfFile();
  });
}

void saveCheckpoint(const std::string& path, torch::nn::Module& model,
                    torch::optim::Optimizer& optimizer, const TrainingState& state) {
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive modelArchive;
  model.save(modelArchive);
  archive.write("model", modelArchive);
  torch::serialize::OutputArchive optimArchive;
  optimizer.save(optimArchive);
  archive.write("optimizer", optimArchive);
  writeTrainingState(archive, state);
  writeArchiveFile(path, archive);
}

namespace {

// What a message about a damaged file says to do: `remedy`, or for a checkpoint of its own.
std::string remedyOr(const std::string& remedy) {
  return remedy.empty() ? "move it out of checkpoints/ to resume from the previous checkpoint"
                        : remedy;
}

// `path`'s header, checked against the file's size, with `in` left at the payload. The length
// is checked against the file before anything that size is allocated.
ArchiveSum checkHeader(const std::string& path, std::ifstream& in, const std::string& remedy) {
  if (!in) throw CheckpointError(fmt::format("cannot read checkpoint {}: file not found", path));
  std::string header(kHeaderSize, '\0');
  in.read(header.data(), static_cast<std::streamsize>(kHeaderSize));
  if (in.gcount() != static_cast<std::streamsize>(kHeaderSize) ||
      std::memcmp(header.data(), kMagic, sizeof(kMagic)) != 0) {
    // A run's model.pt (exportStateDict) is a zip archive, as every torch.save file.
    const bool zip = in.gcount() >= 4 && std::memcmp(header.data(), "PK\x03\x04", 4) == 0;
    throw CheckpointError(fmt::format(
        "{} is not a Caravan checkpoint ({}); {}", path,
        zip ? "it is a PyTorch file, such as a run's model.pt, the weights exported for Python"
            : "bad header",
        remedy.empty() ? "pass one of RUN_DIR/checkpoints/step-*.ckpt, or move it out of "
                         "checkpoints/ to resume from the others"
                       : remedy));
  }
  ArchiveSum sum;
  sum.size = getLe(header, 8, 8);
  sum.crc = static_cast<uint32_t>(getLe(header, 16, 4));
  std::error_code ec;
  const uint64_t fileSize = fs::file_size(path, ec);
  const uint64_t holds = ec || fileSize < kHeaderSize ? 0 : fileSize - kHeaderSize;
  if (ec || holds != sum.size) {
    throw CheckpointError(fmt::format(
        "checkpoint {} is truncated or damaged: header says {} bytes, file holds {}; {}", path,
        sum.size, holds, remedyOr(remedy)));
  }
  return sum;
}

}  // namespace

ArchiveSum readArchiveHeader(const std::string& path, const std::string& remedy) {
  std::ifstream in(path, std::ios::binary);
  return checkHeader(path, in, remedy);
}

namespace {

// A checkpoint file's payload (past its header) for LibTorch's readers, read from the file as
// they ask.
class PayloadReader final : public caffe2::serialize::ReadAdapterInterface {
 public:
  PayloadReader(const std::string& path, uint64_t size) : size_(size) {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      throw CheckpointError(
          fmt::format("cannot read checkpoint {}: {}", path, std::strerror(errno)));
    }
  }
  ~PayloadReader() override { ::close(fd_); }
  PayloadReader(const PayloadReader&) = delete;
  PayloadReader& operator=(const PayloadReader&) = delete;
  size_t size() const override { return static_cast<size_t>(size_); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/ = "") const override {
    if (pos >= size_) return 0;
    n = static_cast<size_t>(std::min<uint64_t>(n, size_ - pos));
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd_, static_cast<char*>(buf) + done, n - done,
                                static_cast<off_t>(kHeaderSize + pos + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    return done;
  }

 private:
  int fd_ = -1;
  uint64_t size_;
};

// `path`'s header, and its payload's CRC against it. The CRC is computed in 1 MiB pieces and
// the readers read the payload from the file, so no copy of the payload is ever in memory
// (out-of-core weights: nor the model).
ArchiveSum checkPayload(const std::string& path, const std::string& remedy) {
  std::ifstream in(path, std::ios::binary);
  const ArchiveSum sum = checkHeader(path, in, remedy);
  uLong running = crc32(0L, Z_NULL, 0);
  std::vector<char> piece(1 << 20);
  uint64_t left = sum.size;
  while (left > 0) {
    const auto want = static_cast<std::streamsize>(std::min<uint64_t>(left, piece.size()));
    in.read(piece.data(), want);
    if (in.gcount() != want) {
      throw CheckpointError(
          fmt::format("cannot read checkpoint {}: it changed while being read", path));
    }
    running = crc32(running, reinterpret_cast<const Bytef*>(piece.data()), static_cast<uInt>(want));
    left -= static_cast<uint64_t>(want);
  }
  if (static_cast<uint32_t>(running) != sum.crc) {
    throw CheckpointError(
        fmt::format("checkpoint {} is corrupt (CRC mismatch); {}", path, remedyOr(remedy)));
  }
  return sum;
}

// Runs `read`; what it throws is a CheckpointError naming `path` (its first line).
void asCheckpointErrors(const std::string& path, const std::function<void()>& read) {
  try {
    read();
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    throw CheckpointError(fmt::format("cannot load checkpoint {}: {}", path, what));
  }
}

}  // namespace

ArchiveSum readArchiveFile(const std::string& path,
                           const std::function<void(torch::serialize::InputArchive&)>& read,
                           const std::string& remedy) {
  const ArchiveSum sum = checkPayload(path, remedy);
  asCheckpointErrors(path, [&] {
    const auto payload = std::make_shared<PayloadReader>(path, sum.size);
    torch::serialize::InputArchive archive;
    archive.load_from([payload](uint64_t pos, void* buf,
                                size_t n) -> size_t { return payload->read(pos, buf, n); },
                      [payload] { return payload->size(); });
    read(archive);
  });
  return sum;
}

ArchiveSum readRecordsFile(const std::string& path,
                           const std::function<void(caffe2::serialize::PyTorchStreamReader&)>& read,
                           const std::string& remedy) {
  const ArchiveSum sum = checkPayload(path, remedy);
  asCheckpointErrors(path, [&] {
    caffe2::serialize::PyTorchStreamReader zip(std::make_shared<PayloadReader>(path, sum.size));
    read(zip);
  });
  return sum;
}

bool recordsFileHas(const std::string& path, const std::string& name) {
  const ArchiveSum sum = readArchiveHeader(path);
  try {
    caffe2::serialize::PyTorchStreamReader zip(std::make_shared<PayloadReader>(path, sum.size));
    return zip.hasRecord(name);
  } catch (const std::exception&) {
    return false;  // no zip: readArchiveFile's CRC or archive says what is wrong
  }
}

void readTrainingState(const std::string& path, torch::serialize::InputArchive& archive,
                       TrainingState& state) {
  c10::IValue v;
  archive.read("step", v);
  state.step = v.toInt();
  archive.read("epoch", v);
  state.position.epoch = v.toInt();
  archive.read("batch_in_epoch", v);
  state.position.batchInEpoch = v.toInt();
  archive.read("rng", state.rngState, /*is_buffer=*/true);
  archive.read("elapsed_s", v);
  state.elapsedSeconds = v.toDouble();
  // Checkpoints from before these were stored: 0, the resuming job's own.
  if (archive.try_read("workers", v)) state.workers = v.toInt();
  if (archive.try_read("batch_size", v)) state.batchSize = v.toInt();
  if (archive.try_read("bf16_blocks", v)) state.bf16Blocks = v.toStringRef();
  if (state.workers < 0 || state.workers > (1 << 20) || state.batchSize < 0 ||
      state.batchSize > (int64_t{1} << 30)) {
    throw CheckpointError(
        fmt::format("checkpoint {} says it was written by {} workers with "
                    "batch size {}; it is damaged",
                    path, state.workers, state.batchSize));
  }
  torch::serialize::InputArchive strategyArchive;
  if (archive.try_read("strategy", strategyArchive)) {
    for (const auto& name : strategyArchive.keys()) {
      at::Tensor t;
      strategyArchive.read(name, t);
      state.strategy[name] = t;
    }
  }
}

TrainingState loadCheckpoint(const std::string& path, torch::nn::Module& model,
                             torch::optim::Optimizer& optimizer, const nlohmann::json& expectedMeta,
                             const std::optional<SliceOwner>& own) {
  TrainingState state;
  if (isSliceFile(path)) {
    throw CheckpointError(
        fmt::format("{} is one rank's slice of a sharded checkpoint; pass its manifest, "
                    "checkpoints/step-<8 digits>.ckpt of the same step",
                    path));
  }
  readArchiveFile(path, [&](torch::serialize::InputArchive& archive) {
    c10::IValue meta;
    archive.read("meta", meta);
    state.meta = nlohmann::json::parse(meta.toStringRef());
    // Keys this run knows that the checkpoint predates (added to the identity later) are not
    // compared; every key the checkpoint has must agree.
    nlohmann::json comparable = expectedMeta;
    if (state.meta.is_object() && comparable.is_object()) {
      for (const auto& [key, value] : expectedMeta.items()) {
        if (!state.meta.contains(key)) comparable.erase(key);
      }
    }
    if (state.meta != comparable) {
      throw CheckpointError(fmt::format(
          "checkpoint {} belongs to another run configuration: it has {}, the config has {}",
          path, state.meta.dump(), expectedMeta.dump()));
    }
    if (isShardedManifest(archive)) {
      state.ownSlices = loadShardedCheckpoint(path, archive, model, optimizer, own);
    } else {
      torch::serialize::InputArchive modelArchive;
      archive.read("model", modelArchive);
      model.load(modelArchive);
      torch::serialize::InputArchive optimArchive;
      archive.read("optimizer", optimArchive);
      loadOptimizer(optimArchive, optimizer);
    }
    readTrainingState(path, archive, state);
  });
  return state;
}

CheckpointDir::CheckpointDir(std::string runDir, int64_t keep)
    : dir_((fs::path(runDir) / "checkpoints").string()), keep_(keep) {}

std::string CheckpointDir::pathFor(int64_t step) const {
  return (fs::path(dir_) / fmt::format("step-{:08d}.ckpt", step)).string();
}

namespace {

// What file name `name` has between `head` and `tail` (not empty), or nullopt.
std::optional<std::string> nameBetween(const std::string& name, const std::string& head,
                                       const std::string& tail) {
  if (name.size() <= head.size() + tail.size() || name.rfind(head, 0) != 0 ||
      name.compare(name.size() - tail.size(), tail.size(), tail) != 0) {
    return std::nullopt;
  }
  return name.substr(head.size(), name.size() - head.size() - tail.size());
}

// The step of a file name's step-<digits> part.
std::optional<int64_t> stepDigits(const std::string& digits) {
  if (digits.empty() || digits.size() > 15 ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) {
    return std::nullopt;
  }
  return std::stoll(digits);
}

}  // namespace

std::optional<int64_t> CheckpointDir::stepOf(const std::string& path) {
  const std::optional<std::string> digits =
      nameBetween(fs::path(path).filename().string(), "step-", ".ckpt");
  return digits ? stepDigits(*digits) : std::nullopt;
}

std::vector<std::string> CheckpointDir::list() const {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  if (!fs::is_directory(dir_, ec)) return {};
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    // Only regular files named step-<digits>.ckpt, in step order (not name order: a run past
    // 10^8 steps has longer names).
    const auto step = stepOf(entry.path().string());
    if (step && entry.is_regular_file(ec)) found.emplace_back(*step, entry.path().string());
  }
  std::sort(found.begin(), found.end());
  std::vector<std::string> out;
  for (auto& f : found) out.push_back(std::move(f.second));
  return out;
}

std::optional<int64_t> CheckpointDir::sliceStepOf(const std::string& path) {
  // step-<digits>.<...>.slice: the step's digits end at the first dot.
  const std::optional<std::string> middle =
      nameBetween(fs::path(path).filename().string(), "step-", ".slice");
  return middle ? stepDigits(middle->substr(0, middle->find('.'))) : std::nullopt;
}

int CheckpointDir::removeStaleTemporaries() const {
  std::error_code ec;
  int removed = 0;
  if (!fs::is_directory(dir_, ec)) return removed;
  std::set<int64_t> steps;  // those with a checkpoint file
  for (const std::string& path : list()) steps.insert(*stepOf(path));
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    const bool temporary =
        name.rfind(".step-", 0) == 0 && (name.find(".ckpt.tmp-") != std::string::npos ||
                                         name.find(".slice.tmp-") != std::string::npos);
    const std::optional<int64_t> sliceStep = sliceStepOf(name);
    if (temporary || (sliceStep && steps.count(*sliceStep) == 0)) {
      removed += fs::remove(entry.path(), ec) ? 1 : 0;
    }
  }
  return removed;
}

void CheckpointDir::prune(int64_t step, const std::vector<std::string>& slices) const {
  std::error_code ec;
  const std::vector<std::string> all = list();
  std::set<int64_t> kept;
  for (size_t i = 0; i < all.size(); ++i) {
    if (i + static_cast<size_t>(keep_) < all.size()) {
      fs::remove(all[i], ec);
    } else {
      kept.insert(*stepOf(all[i]));
    }
  }
  const std::set<std::string> current(slices.begin(), slices.end());
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    const std::optional<int64_t> sliceStep = sliceStepOf(name);
    if (!sliceStep) continue;
    if (kept.count(*sliceStep) == 0 || (*sliceStep == step && current.count(name) == 0)) {
      fs::remove(entry.path(), ec);
    }
  }
}

std::optional<std::string> CheckpointDir::latest() const {
  auto all = list();
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::string CheckpointDir::save(torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                                const TrainingState& state) {
  std::error_code ec;
  fs::create_directories(dir_, ec);
  if (ec) {
    throw IoError(fmt::format("cannot create {}: {}", dir_, ec.message()));
  }
  std::string path = pathFor(state.step);
  saveCheckpoint(path, model, optimizer, state);
  prune(state.step, {});
  return path;
}

namespace {

// `value` pickled as torch.load reads it (pickleForTorchLoad); each storage named
// `storageKey(tensor)`, or by the order it comes in when that is null. The tensors whose
// storages it names, in that order, go to `storages`.
std::vector<char> pickleValue(
    const c10::IValue& value, std::vector<at::Tensor>* storages,
    const std::function<std::string(const at::Tensor&)>& storageKey = nullptr) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* bytes, size_t n) { pickled.insert(pickled.end(), bytes, bytes + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/storageKey, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  if (storages != nullptr) *storages = pickler.tensorData();
  return pickled;
}

// A tensor of `t`'s dtype and shape (contiguous) over a storage of its elements' size that
// holds no bytes: what data.pkl says of a tensor whose bytes were written already.
at::Tensor placeholderOf(const at::Tensor& t) {
  const c10::Storage storage(c10::Storage::use_byte_size_t(),
                             static_cast<size_t>(t.numel()) * t.element_size(),
                             c10::DataPtr(nullptr, c10::Device(c10::kCPU)),
                             /*allocator=*/nullptr, /*resizable=*/false);
  return at::empty({0}, at::TensorOptions().dtype(t.dtype())).set_(storage, 0, t.sizes());
}

}  // namespace

std::vector<char> pickleForTorchLoad(const c10::IValue& value) {
  std::vector<at::Tensor> storages;
  const std::vector<char> pickled = pickleValue(value, &storages);
  std::vector<char> file;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
    const char* bytes = static_cast<const char*>(data);
    file.insert(file.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), storages, writer);
  writer.writeEndOfFile();
  return file;
}

at::Tensor ownStorage(const at::Tensor& t) {
  const bool whole = t.storage_offset() == 0 && t.is_contiguous() &&
                     t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
  return whole ? t : t.clone(at::MemoryFormat::Contiguous);
}

void exportStateDict(const std::string& path, torch::nn::Module& model, const ExportNames& rename,
                     const ParameterStream& stream) {
  // The dict's entries in the model's order (its parameters, then its buffers), each one
  // storage under every name `rename` gives it (a tied tensor under each, as torch.save writes
  // a tied model). Entry k's elements are the record data/<k>, as torch.save names them.
  struct Entry {
    std::vector<std::string> names;
    at::Tensor tensor;
    at::Tensor written;  // placeholderOf what was written: a stream may write another dtype
  };
  std::vector<Entry> entries;
  std::map<const c10::TensorImpl*, size_t> entryOf;
  auto add = [&](const std::string& n, const at::Tensor& t) {
    std::vector<std::string> names = rename ? rename(n) : std::vector<std::string>{n};
    if (names.empty()) return;
    entryOf[t.unsafeGetTensorImpl()] = entries.size();
    entries.push_back({std::move(names), t});
  };
  for (const auto& p : model.named_parameters()) add(p.key(), p.value());
  for (const auto& b : model.named_buffers()) add(b.key(), b.value());
  writeFileAtomic(path, [&](int fd, const std::string& tmp) {
    CrcFileBuf buf(fd, tmp);
    {
      std::ostream out(&buf);
      caffe2::serialize::PyTorchStreamWriter zip = zipOnto(out);
      // A tensor's own elements (a view of a larger storage, such as a sharded unit's flat
      // buffer, as its elements only), written at once.
      auto write = [&](size_t k, const at::Tensor& t) {
        const at::Tensor elements = t.detach().contiguous();
        zip.writeRecord(fmt::format("data/{}", k), elements.data_ptr(), elements.nbytes());
        entries[k].written = placeholderOf(elements);
      };
      if (stream) {
        stream([&](const at::Tensor& t) {
          const auto it = entryOf.find(t.unsafeGetTensorImpl());
          if (it != entryOf.end() && !entries[it->second].written.defined()) write(it->second, t);
        });
      }
      for (size_t k = 0; k < entries.size(); ++k) {
        if (!entries[k].written.defined()) write(k, entries[k].tensor);
      }
      // data.pkl: the dict, its tensors placeholders of the written ones (the dtype written:
      // a sharded unit gathered in bf16 streams its float32 masters while its parameters are
      // bf16 views again by now), each storage named by its record.
      c10::Dict<std::string, at::Tensor> dict;
      std::map<const c10::StorageImpl*, std::string> keys;
      for (size_t k = 0; k < entries.size(); ++k) {
        const at::Tensor& placeholder = entries[k].written;
        keys[placeholder.storage().unsafeGetStorageImpl()] = std::to_string(k);
        for (const std::string& name : entries[k].names) dict.insert(name, placeholder);
      }
      const std::vector<char> pickled = pickleValue(
          c10::IValue(dict), nullptr,
          [&](const at::Tensor& t) { return keys.at(t.storage().unsafeGetStorageImpl()); });
      zip.writeRecord("data.pkl", pickled.data(), pickled.size());
      zip.writeEndOfFile();
      out.flush();
    }
    buf.flush();
    buf.throwIfFailed();
  });
}

}  // namespace caravan
