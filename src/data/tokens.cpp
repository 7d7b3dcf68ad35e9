// Token files (see sources.h, loadTokenFiles): flat arrays of token ids, read by window.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "core/errors.h"
#include "core/files.h"
#include "core/scope_guard.h"
#include "data/sources.h"

namespace caravan {
namespace {

// The id at index k of little-endian ids `width` bytes wide (1: uint8, 2: uint16, 4: uint32).
int64_t idAt(const unsigned char* bytes, int width, int64_t k) {
  if (width == 1) return bytes[k];
  if (width == 2) {
    uint16_t v;
    std::memcpy(&v, bytes + 2 * k, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, bytes + 4 * k, 4);
  return v;
}

class TokenFileDataset : public Dataset {
 public:
  TokenFileDataset(std::string name, std::shared_ptr<const OwnedFd> file, int64_t tokens, int width,
                   int64_t seqLen, int64_t vocab)
      : name_(std::move(name)),
        file_(std::move(file)),
        tokens_(tokens),
        width_(width),
        seqLen_(seqLen),
        vocab_(vocab) {}

  std::string name() const override { return name_; }
  // Non-overlapping windows of seqLen + 1 tokens (input and target shifted by one), as Brown's.
  int64_t size() const override { return (tokens_ - 1) / seqLen_; }
  DataShape shape() const override {
    DataShape s;
    s.task = TaskKind::kLanguageModel;
    s.vocabSize = vocab_;
    s.seqLen = seqLen_;
    return s;
  }
  // Each window is one pread: the file stays in the page cache, shared and reclaimable, and
  // this process's resident memory does not grow with it (a memory mapping's pages count in
  // the process's RSS: 1.4 GB of a 2 GB file after 300 steps, measured).
  Batch get(const std::vector<int64_t>& indices) const override {
    const auto b = static_cast<int64_t>(indices.size());
    at::Tensor input = at::empty({b, seqLen_}, at::kLong);
    at::Tensor target = at::empty({b, seqLen_}, at::kLong);
    int64_t* in = input.data_ptr<int64_t>();
    int64_t* out = target.data_ptr<int64_t>();
    const size_t windowBytes = static_cast<size_t>(seqLen_ + 1) * width_;
    std::vector<unsigned char> window(windowBytes);
    for (int64_t r = 0; r < b; ++r) {
      const int64_t i = indices[r];
      CARAVAN_CHECK(i >= 0 && i < size(), "index {} of {}", i, size());
      if (!preadFully(file_->get(), window.data(), windowBytes, i * seqLen_ * width_)) {
        throw DataError(
            fmt::format("cannot read {} window {}: the file changed or failed "
                        "while training",
                        name_, i));
      }
      for (int64_t t = 0; t <= seqLen_; ++t) {
        const int64_t v = idAt(window.data(), width_, t);
        if (t < seqLen_) in[r * seqLen_ + t] = v;
        if (t > 0) out[r * seqLen_ + t - 1] = v;
      }
    }
    return Batch{input, target};
  }

 private:
  std::string name_;
  std::shared_ptr<const OwnedFd> file_;
  int64_t tokens_;
  int width_;
  int64_t seqLen_;
  int64_t vocab_;
};

std::shared_ptr<const Dataset> loadSplit(const TokenFileOptions& o, const std::string& file) {
  const std::string path = (std::filesystem::path(o.dir) / file).string();
  const int width = o.dtype == "uint8" ? 1 : o.dtype == "uint16" ? 2 : 4;
  struct stat st {};
  std::string why;
  const int fd = openRegularFile(path, &why);
  if (fd < 0) {
    throw DataError(fmt::format("token file {} {} (data.path is a directory holding {} and {})",
                                path, why, o.trainFile, o.valFile));
  }
  const auto closeFd = onScopeExit([fd] { ::close(fd); });
  if (::fstat(fd, &st) != 0) throw DataError(fmt::format("cannot stat {}", path));
  const auto bytes = static_cast<uint64_t>(st.st_size);
  if (bytes % width != 0) {
    throw DataError(
        fmt::format("token file {} holds {} bytes, not a whole number of {} ids; "
                    "check data.token_dtype",
                    path, bytes, o.dtype));
  }
  const auto tokens = static_cast<int64_t>(bytes / width);
  if (tokens < o.seqLen + 1) {
    throw DataError(fmt::format("token file {} holds {} tokens, fewer than data.seq_len + 1 = {}",
                                path, tokens, o.seqLen + 1));
  }
  // Every id below the vocabulary, found now rather than as an index error mid-run: one pass,
  // read in pieces (through the page cache, not this process's resident memory).
  std::vector<unsigned char> piece(size_t{1} << 20);
  for (uint64_t at = 0; at < bytes;) {
    const size_t want = static_cast<size_t>(std::min<uint64_t>(piece.size(), bytes - at));
    if (!preadFully(fd, piece.data(), want, static_cast<int64_t>(at))) {
      throw DataError(
          fmt::format("cannot read token file {}: it changed or failed while read", path));
    }
    for (size_t k = 0; k < want; k += width) {
      const auto v =
          static_cast<uint64_t>(idAt(piece.data(), width, static_cast<int64_t>(k / width)));
      if (v >= static_cast<uint64_t>(o.vocabSize)) {
        throw DataError(
            fmt::format("token file {}: token {} is id {}, not below "
                        "data.vocab_size = {}; raise data.vocab_size or check "
                        "data.token_dtype",
                        path, (at + k) / width, v, o.vocabSize));
      }
    }
    at += want;
  }
  auto held = std::make_shared<const OwnedFd>(::fcntl(fd, F_DUPFD_CLOEXEC, 0));
  if (held->get() < 0) throw DataError(fmt::format("cannot keep {} open", path));
  return std::make_shared<TokenFileDataset>((o.dtype == "uint8" ? "text/" : "tokens/") + file,
                                            std::move(held), tokens, width, o.seqLen, o.vocabSize);
}

}  // namespace

DatasetSplits loadTokenFiles(const TokenFileOptions& options) {
  if (options.dtype != "uint16" && options.dtype != "uint32" && options.dtype != "uint8") {
    throw ConfigError(fmt::format("data.token_dtype = '{}'; use uint16 or uint32", options.dtype));
  }
  if (options.vocabSize < 1) {
    throw ConfigError("data.dataset = 'tokens' needs data.vocab_size (ids are below it)");
  }
  if (options.dir.empty()) {
    throw ConfigError(
        "data.dataset = 'tokens' needs data.path: a directory holding train.bin "
        "and val.bin");
  }
  return DatasetSplits{loadSplit(options, options.trainFile), loadSplit(options, options.valFile)};
}

DatasetSplits loadTextBytes(const std::string& dir, int64_t seqLen) {
  if (dir.empty()) {
    throw ConfigError(
        "data.dataset = 'text' needs data.path: a directory holding train.txt and val.txt");
  }
  TokenFileOptions o;
  o.dir = dir;
  o.dtype = "uint8";
  o.vocabSize = 256;
  o.seqLen = seqLen;
  o.trainFile = "train.txt";
  o.valFile = "val.txt";
  return loadTokenFiles(o);
}

}  // namespace caravan
