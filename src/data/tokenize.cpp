// Text tokenization (see tokenize.h). Built into its own program, caravan-tokenize, not into
// caravan: Debian's libsentencepiece carries its own copy of protobuf-lite's symbols, which in
// one process with LibTorch's libprotobuf crash at load (measured: SIGSEGV in protobuf's static
// initialisers before main). `caravan data tokenize` runs that program.
#include "data/tokenize.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>
#include <nlohmann/json.hpp>

#include "core/errors.h"
#include "core/files.h"
#include "core/output_path.h"
#include "core/scope_guard.h"

namespace caravan {
namespace fs = std::filesystem;
namespace {

constexpr size_t kMaxTextFile = size_t{4} << 30;  // bytes of one input file read at once

// One input's training and validation text: the tail of valFraction, cut after a line end.
struct SplitText {
  std::string train, val;
};

SplitText splitInput(const std::string& path, double valFraction) {
  std::string why;
  auto text = readRegularFile(path, &why, false, kMaxTextFile);
  if (!text) throw DataError(fmt::format("text file {} {}", path, why));
  if (text->empty()) throw DataError(fmt::format("text file {} is empty", path));
  size_t cut = text->size() - static_cast<size_t>(valFraction * static_cast<double>(text->size()));
  if (valFraction > 0.0) {
    const size_t lineEnd = text->rfind('\n', cut == 0 ? 0 : cut - 1);
    cut = lineEnd == std::string::npos ? cut : lineEnd + 1;
  }
  return SplitText{text->substr(0, cut), text->substr(cut)};
}

// The lines of the training text, for SentencePiece's trainer (it reads sentences, not files).
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(const std::vector<SplitText>& texts) : texts_(texts) { advance(); }
  bool done() const override { return file_ >= texts_.size(); }
  void Next() override { advance(); }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override { return {}; }

 private:
  void advance() {
    for (;;) {
      if (file_ >= texts_.size()) return;
      const std::string& t = texts_[file_].train;
      if (at_ >= t.size()) {
        ++file_;
        at_ = 0;
        continue;
      }
      size_t end = t.find('\n', at_);
      if (end == std::string::npos) end = t.size();
      line_ = t.substr(at_, end - at_);
      at_ = end + 1;
      if (!line_.empty()) return;
    }
  }
  const std::vector<SplitText>& texts_;
  size_t file_ = 0, at_ = 0;
  std::string line_;
};

// Ids written to a file beside its final name as they come, renamed into place by commit().
class IdWriter {
 public:
  IdWriter(fs::path path, int width)
      : path_(std::move(path)), partial_(path_.string() + ".partial"), width_(width) {
    out_.open(partial_, std::ios::binary | std::ios::trunc);
    if (!out_) throw IoError(fmt::format("cannot write {}", partial_));
  }
  ~IdWriter() {
    if (!committed_) {
      std::error_code ec;
      fs::remove(partial_, ec);
    }
  }
  void add(uint32_t id) {
    char b[4];
    std::memcpy(b, &id, 4);  // little-endian host
    out_.write(b, width_);
    ++count_;
  }
  int64_t count() const { return count_; }
  void commit() {
    out_.close();
    if (!out_) throw IoError(fmt::format("cannot write {} (disk full?)", partial_));
    fs::rename(partial_, path_);
    committed_ = true;
  }

 private:
  fs::path path_;
  std::string partial_;
  int width_;
  std::ofstream out_;
  int64_t count_ = 0;
  bool committed_ = false;
};

// Runs `f` with this process's stderr going to `logPath` (SentencePiece logs every step there).
template <typename F>
auto withStderrTo(const std::string& logPath, F f) {
  std::fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  const int log = ::open(logPath.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (saved >= 0 && log >= 0) ::dup2(log, STDERR_FILENO);
  const auto restore = onScopeExit([saved, log] {
    std::fflush(stderr);
    if (saved >= 0) {
      ::dup2(saved, STDERR_FILENO);
      ::close(saved);
    }
    if (log >= 0) ::close(log);
  });
  return f();
}

}  // namespace

TokenizeSummary tokenizeText(const TokenizeOptions& o) {
  if (o.inputs.empty()) throw ConfigError("data tokenize needs --input FILE (one or more)");
  if (o.outDir.empty()) throw ConfigError("data tokenize needs --out DIR");
  if (!(o.valFraction > 0.0 && o.valFraction < 1.0)) {
    throw ConfigError(fmt::format("--val-fraction {} must be above 0 and below 1", o.valFraction));
  }
  const fs::path out(o.outDir);
  std::error_code ec;
  std::vector<std::string> inputs = o.inputs;
  if (!o.tokenizer.empty() && o.tokenizer != "bytes") inputs.push_back(o.tokenizer);
  checkOutputPath({"--out",
                   o.outDir,
                   /*directory=*/true,
                   {"train.bin", "val.bin", "tokens.json", "tokenizer.model", "tokenizer.log"}},
                  inputs);
  for (const char* name : {"train.bin", "val.bin", "tokens.json", "tokenizer.model"}) {
    if (fs::exists(out / name, ec)) {
      throw IoError(
          fmt::format("{} already exists; tokenize into another --out (nothing was "
                      "overwritten)",
                      (out / name).string()));
    }
  }
  std::vector<SplitText> texts;
  for (const auto& input : o.inputs) texts.push_back(splitInput(input, o.valFraction));
  // A failure leaves what was there before: the files this call made go, and the directory if
  // it made it (the partial files remove themselves).
  const bool made = !fs::exists(out, ec);
  fs::create_directories(out);
  bool done = false;
  const auto cleanUp = onScopeExit([&] {
    if (done) return;
    std::error_code ignored;
    for (const char* name :
         {"train.bin", "val.bin", "tokens.json", "tokenizer.model", "tokenizer.log"}) {
      fs::remove(out / name, ignored);  // none was there before (refused above)
    }
    if (made) fs::remove(out, ignored);  // only if empty
  });

  TokenizeSummary s;
  sentencepiece::SentencePieceProcessor sp;
  const bool bytes = o.tokenizer == "bytes";
  if (bytes) {
    s.tokenizer = "bytes";
    s.vocabSize = 256;
  } else {
    s.tokenizer = "sentencepiece";
    const std::string modelPath = (out / "tokenizer.model").string();
    if (o.tokenizer.empty()) {
      if (o.vocabSize < 8 || o.vocabSize > (int64_t{1} << 31) - 1) {
        throw ConfigError(fmt::format("--vocab-size {} must be 8 to 2147483647", o.vocabSize));
      }
      // A piece occurs in the text at least once, so no vocabulary outgrows its characters
      // (SentencePiece itself spun on 2000000000 pieces of a tiny file).
      int64_t characters = 0;
      for (const auto& t : texts) {
        for (unsigned char c : t.train) characters += (c & 0xC0) != 0x80;
      }
      if (o.vocabSize > characters) {
        throw DataError(fmt::format(  // as SentencePiece's own "too many pieces" (exit 3)
            "--vocab-size {} is more pieces than the training text has characters ({}); "
            "give a smaller --vocab-size or more text",
            o.vocabSize, characters));
      }
      LineIterator lines(texts);
      const std::string partial = modelPath + ".partial";
      const auto status = withStderrTo((out / "tokenizer.log").string(), [&] {
        return sentencepiece::SentencePieceTrainer::Train(
            fmt::format("--model_prefix={} --vocab_size={} --model_type=unigram "
                        "--character_coverage=1.0 --input_sentence_size=2000000 "
                        "--shuffle_input_sentence=true --num_threads=1",
                        partial, o.vocabSize),
            &lines);
      });
      fs::remove(partial + ".vocab", ec);
      if (!status.ok()) {
        fs::remove(partial + ".model", ec);
        throw DataError(
            fmt::format("SentencePiece could not train a {}-piece model on this "
                        "text: {} (a smaller --vocab-size, or more text)",
                        o.vocabSize, status.message()));
      }
      fs::rename(partial + ".model", modelPath);
    } else {
      std::string why;
      const int fd = openRegularFile(o.tokenizer, &why);
      if (fd < 0) throw DataError(fmt::format("--model {} {}", o.tokenizer, why));
      ::close(fd);
      fs::copy_file(o.tokenizer, modelPath);
    }
    const auto loaded = sp.Load(modelPath);
    if (!loaded.ok()) {
      fs::remove(modelPath, ec);
      throw DataError(fmt::format("{} is not a SentencePiece model ({})",
                                  o.tokenizer.empty() ? modelPath : o.tokenizer, loaded.message()));
    }
    s.vocabSize = sp.GetPieceSize();
  }
  s.dtype = s.vocabSize <= 65536 ? "uint16" : "uint32";
  const int width = s.dtype == "uint16" ? 2 : 4;

  auto encode = [&](const std::string& text, IdWriter& w) {
    if (bytes) {
      for (unsigned char c : text) w.add(c);
      return;
    }
    std::vector<int> ids;
    size_t at = 0;
    while (at < text.size()) {
      size_t end = text.find('\n', at);
      if (end == std::string::npos) end = text.size();
      const auto status = sp.Encode(std::string_view(text).substr(at, end - at), &ids);
      if (!status.ok()) throw DataError(fmt::format("SentencePiece: {}", status.message()));
      for (int id : ids) w.add(static_cast<uint32_t>(id));
      at = end + 1;
    }
  };
  IdWriter train(out / "train.bin", width), val(out / "val.bin", width);
  for (const auto& t : texts) {
    encode(t.train, train);
    encode(t.val, val);
  }
  s.trainTokens = train.count();
  s.valTokens = val.count();
  if (s.trainTokens < 2 || s.valTokens < 2) {
    throw DataError(fmt::format(
        "the text gives {} training and {} validation tokens; a language model needs more "
        "(more text, or another --val-fraction)",
        s.trainTokens, s.valTokens));
  }
  train.commit();
  val.commit();
  nlohmann::json j = {{"tokenizer", s.tokenizer},     {"vocab_size", s.vocabSize},
                      {"token_dtype", s.dtype},       {"train_tokens", s.trainTokens},
                      {"val_tokens", s.valTokens},    {"inputs", o.inputs},
                      {"val_fraction", o.valFraction}};
  std::ofstream(out / "tokens.json") << j.dump(2) << "\n";
  done = true;
  return s;
}

}  // namespace caravan
