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
#include "core/scope_guard.h"
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

ArchiveSum writeArchiveFile(const std::string& path, torch::serialize::OutputArchive& archive) {
  ArchiveSum sum;
  // Header (magic, payload length, CRC-32) written last, over a placeholder: the payload is
  // streamed to the file.
  writeFileAtomic(path, [&](int fd, const std::string& tmp) {
    writeAll(fd, std::string(kHeaderSize, '\0').data(), kHeaderSize, tmp);
    CrcFileBuf buf(fd, tmp);
    {
      std::ostream out(&buf);
      archive.save_to(out);
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

ArchiveSum readArchiveFile(const std::string& path,
                           const std::function<void(torch::serialize::InputArchive&)>& read,
                           const std::string& remedy) {
  // The CRC is computed in 1 MiB pieces and the archive reads the payload from the file, so
  // no copy of the payload is ever in memory (out-of-core weights: nor the model).
  std::ifstream in(path, std::ios::binary);
  const ArchiveSum sum = checkHeader(path, in, remedy);
  const uint64_t size = sum.size;
  uLong running = crc32(0L, Z_NULL, 0);
  {
    std::vector<char> piece(1 << 20);
    uint64_t left = size;
    while (left > 0) {
      const auto want = static_cast<std::streamsize>(std::min<uint64_t>(left, piece.size()));
      in.read(piece.data(), want);
      if (in.gcount() != want) {
        throw CheckpointError(
            fmt::format("cannot read checkpoint {}: it changed while being read", path));
      }
      running = crc32(running, reinterpret_cast<const Bytef*>(piece.data()),
                      static_cast<uInt>(want));
      left -= static_cast<uint64_t>(want);
    }
  }
  if (static_cast<uint32_t>(running) != sum.crc) {
    throw CheckpointError(
        fmt::format("checkpoint {} is corrupt (CRC mismatch); {}", path, remedyOr(remedy)));
  }
  try {
    torch::serialize::InputArchive archive;
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      throw CheckpointError(
          fmt::format("cannot read checkpoint {}: {}", path, std::strerror(errno)));
    }
    const auto closeFd = onScopeExit([fd] { ::close(fd); });
    archive.load_from(
        [fd, size](uint64_t pos, void* buf, size_t n) -> size_t {
          if (pos >= size) return 0;
          n = static_cast<size_t>(std::min<uint64_t>(n, size - pos));
          size_t done = 0;
          while (done < n) {
            const ssize_t r = ::pread(fd, static_cast<char*>(buf) + done, n - done,
                                      static_cast<off_t>(kHeaderSize + pos + done));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            done += static_cast<size_t>(r);
          }
          return done;
        },
        [size] { return static_cast<size_t>(size); });
    read(archive);
  } catch (const CheckpointError&) {
    throw;
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    throw CheckpointError(fmt::format("cannot load checkpoint {}: {}", path, what));
  }
  return sum;
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
  readArchiveFile(path, [&](torch::serialize::InputArchive& archive) {
    if (isSliceFile(archive)) {
      throw CheckpointError(
          fmt::format("{} is one rank's slice of a sharded checkpoint; pass its manifest, "
                      "checkpoints/step-<8 digits>.ckpt of the same step",
                      path));
    }
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

std::vector<char> pickleForTorchLoad(const c10::IValue& value) {
  std::vector<char> pickled;
  torch::jit::Pickler pickler(
      [&](const char* bytes, size_t n) { pickled.insert(pickled.end(), bytes, bytes + n); },
      /*tensor_table=*/nullptr, /*type_renamer=*/nullptr, /*memoized_class_types=*/nullptr,
      /*get_tensor_id=*/nullptr, /*tag_aggregates=*/false);
  pickler.protocol();
  pickler.pushIValue(value);
  pickler.stop();
  std::vector<char> file;
  caffe2::serialize::PyTorchStreamWriter writer([&](const void* data, size_t n) {
    const char* bytes = static_cast<const char*>(data);
    file.insert(file.end(), bytes, bytes + n);
    return n;
  });
  torch::jit::writeArchiveAndTensors("data", pickled.data(), pickled.size(), pickler.tensorData(),
                                     writer);
  writer.writeEndOfFile();
  return file;
}

at::Tensor ownStorage(const at::Tensor& t) {
  const bool whole = t.storage_offset() == 0 && t.is_contiguous() &&
                     t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
  return whole ? t : t.clone(at::MemoryFormat::Contiguous);
}

void exportStateDict(const std::string& path, torch::nn::Module& model,
                     const std::function<std::vector<std::string>(const std::string&)>& rename) {
  c10::Dict<std::string, at::Tensor> dict;
  auto insert = [&](const std::string& n, const at::Tensor& t) {
    // A tied tensor under each of its names, one storage (as torch.save writes a tied model);
    // a view of a larger storage (a sharded unit's flat buffer) as its own elements only.
    const at::Tensor value = ownStorage(t.detach());
    for (const std::string& name : rename ? rename(n) : std::vector<std::string>{n}) {
      dict.insert(name, value);
    }
  };
  for (const auto& p : model.named_parameters()) insert(p.key(), p.value());
  for (const auto& b : model.named_buffers()) insert(b.key(), b.value());
  const std::vector<char> bytes = pickleForTorchLoad(c10::IValue(dict));
  writeFileAtomic(path, [&](int fd, const std::string& tmp) {
    writeAll(fd, bytes.data(), bytes.size(), tmp);
  });
}

}  // namespace caravan
