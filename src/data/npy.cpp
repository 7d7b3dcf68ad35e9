// NumPy .npy arrays (see sources.h, loadNpyArrays): a header parser of our own and a dataset
// that reads one example at a time.
//
// The format (numpy/lib/format.py): "\x93NUMPY", major and minor version bytes, the header's
// length (2 bytes little-endian in version 1, 4 in versions 2 and 3), then the header: a Python
// dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (N, 28, 28), } padded with
// spaces and a newline; the payload follows.
#include <sys/stat.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/errors.h"
#include "core/files.h"
#include "core/scope_guard.h"
#include "data/sources.h"

namespace caravan {
namespace {

// The most classes (or ids of a vocabulary) integer targets may name: 2^24.
constexpr int64_t kMostClasses = int64_t{1} << 24;

constexpr std::string_view kMagic("\x93NUMPY", 6);
constexpr int64_t kMaxHeaderBytes = int64_t{1} << 20;

// A cursor over the header's dict literal; every failure names the file.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : text_(text), path_(path) {}

  NpyHeader parse() {
    NpyHeader h;
    bool sawDescr = false, sawOrder = false, sawShape = false;
    expect('{');
    for (;;) {
      skipSpace();
      if (peek() == '}') break;
      const std::string key = quoted();
      skipSpace();
      expect(':');
      skipSpace();
      if (key == "descr") {
        if (peek() == '[') {
          fail("has a structured dtype (fields); save each field as its own array");
        }
        h.dtype = dtypeOf(quoted(), &h.itemSize);
        sawDescr = true;
      } else if (key == "fortran_order") {
        if (word() != "False") {
          fail("is in Fortran order; save it in C order: np.save(path, np.ascontiguousarray(a))");
        }
        sawOrder = true;
      } else if (key == "shape") {
        h.shape = shape();
        sawShape = true;
      } else {
        fail(fmt::format("has an unknown header key '{}'", key));
      }
      skipSpace();
      if (peek() == ',') {
        ++at_;
        continue;
      }
      if (peek() != '}') fail("has a header that is not NumPy's dictionary");
    }
    if (!sawDescr || !sawOrder || !sawShape) {
      fail("has a header without descr, fortran_order or shape (not written by np.save?)");
    }
    return h;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw DataError(fmt::format("{} {}", path_, what));
  }
  char peek() const { return at_ < text_.size() ? text_[at_] : '\0'; }
  void skipSpace() {
    while (at_ < text_.size() && (text_[at_] == ' ' || text_[at_] == '\t')) ++at_;
  }
  void expect(char c) {
    skipSpace();
    if (peek() != c) fail("has a header that is not NumPy's dictionary");
    ++at_;
  }
  std::string quoted() {
    const char q = peek();
    if (q != '\'' && q != '"') fail("has a header that is not NumPy's dictionary");
    const size_t end = text_.find(q, at_ + 1);
    if (end == std::string_view::npos) fail("has a header that is not NumPy's dictionary");
    std::string s(text_.substr(at_ + 1, end - at_ - 1));
    at_ = end + 1;
    return s;
  }
  std::string word() {
    const size_t start = at_;
    while (at_ < text_.size() && std::isalpha(static_cast<unsigned char>(text_[at_]))) ++at_;
    return std::string(text_.substr(start, at_ - start));
  }
  std::vector<int64_t> shape() {
    expect('(');
    std::vector<int64_t> dims;
    for (;;) {
      skipSpace();
      if (peek() == ')') break;
      if (peek() == '-') fail("has a negative dimension");
      if (!std::isdigit(static_cast<unsigned char>(peek()))) fail("has a malformed shape");
      int64_t v = 0;
      while (std::isdigit(static_cast<unsigned char>(peek()))) {
        if (v > (std::numeric_limits<int64_t>::max() - 9) / 10) fail("has a dimension too large");
        v = v * 10 + (text_[at_++] - '0');
      }
      if (peek() == 'L') ++at_;  // Python 2's long suffix
      dims.push_back(v);
      skipSpace();
      if (peek() == ',') {
        ++at_;
      } else if (peek() != ')') {
        fail("has a malformed shape");
      }
    }
    ++at_;
    return dims;
  }
  std::string dtypeOf(const std::string& descr, int64_t* itemSize) const {
    if (descr.size() >= 2 && descr[0] == '>') {
      fail(
          fmt::format("holds big-endian data ('{}'); save it little-endian: "
                      "a.astype(a.dtype.newbyteorder('<'))",
                      descr));
    }
    const std::string code =
        (descr.size() >= 2 && (descr[0] == '<' || descr[0] == '|' || descr[0] == '='))
            ? descr.substr(1)
            : descr;
    if (code == "f4") {
      *itemSize = 4;
      return "float32";
    }
    if (code == "u1") {
      *itemSize = 1;
      return "uint8";
    }
    if (code == "i8") {
      *itemSize = 8;
      return "int64";
    }
    if (code == "O") {
      fail("holds Python objects (dtype object); Caravan reads float32, uint8 or int64 arrays");
    }
    fail(
        fmt::format("has dtype '{}'; Caravan reads float32, uint8 or int64: np.save(path, "
                    "a.astype(np.float32)) (or np.uint8, np.int64)",
                    descr));
  }

  std::string_view text_;
  const std::string& path_;
  size_t at_ = 0;
};

// One .npy file held open: its header and the bytes of one example (a row of dimension 0).
struct ArrayFile {
  std::string path;
  NpyHeader header;
  std::shared_ptr<const OwnedFd> fd;
  int64_t rows = 0;
  int64_t rowBytes = 0;
  std::vector<int64_t> rowShape;
  at::ScalarType type = at::kFloat;
};

at::ScalarType scalarTypeOf(const std::string& dtype) {
  if (dtype == "float32") return at::kFloat;
  if (dtype == "uint8") return at::kByte;
  return at::kLong;
}

ArrayFile openArray(const std::string& path) {
  std::string why;
  const int fd = openRegularFile(path, &why);
  if (fd < 0) {
    throw DataError(
        fmt::format("array file {} {} (data.path is a directory holding train_inputs.npy, "
                    "train_targets.npy, test_inputs.npy and test_targets.npy)",
                    path, why));
  }
  ArrayFile a;
  a.fd = std::make_shared<const OwnedFd>(fd);
  a.path = path;
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw DataError(fmt::format("cannot stat {}", path));
  // The fixed part (magic, version, the header's length), then as much as the header says.
  std::string head(static_cast<size_t>(std::min<int64_t>(st.st_size, 12)), '\0');
  if (!preadFully(fd, head.data(), head.size(), 0)) throw DataError("cannot read " + path);
  if (head.size() >= 10) {
    uint32_t length = 0;
    const bool v1 = head[6] == 1;
    std::memcpy(&length, head.data() + 8, v1 ? 2 : std::min<size_t>(4, head.size() - 8));
    const int64_t want = (v1 ? 10 : 12) + std::min<int64_t>(length, kMaxHeaderBytes + 1);
    head.resize(static_cast<size_t>(std::min<int64_t>(want, st.st_size)));
    if (!preadFully(fd, head.data(), head.size(), 0)) throw DataError("cannot read " + path);
  }
  a.header = parseNpyHeader(head, path, st.st_size);
  if (a.header.shape.empty()) {
    throw DataError(fmt::format("{} holds a scalar; dimension 0 must count the examples", path));
  }
  a.rows = a.header.shape[0];
  if (a.rows < 1) throw DataError(fmt::format("{} holds no examples (shape [0, ...])", path));
  a.rowShape.assign(a.header.shape.begin() + 1, a.header.shape.end());
  a.rowBytes = a.header.payloadBytes() / a.rows;
  if (a.rowBytes == 0) {
    throw DataError(fmt::format("{} has examples of no elements (shape [{}])", path,
                                fmt::join(a.header.shape, ", ")));
  }
  a.type = scalarTypeOf(a.header.dtype);
  return a;
}

// The rows `indices` of `a` as one tensor of its own type, [b, rowShape...].
at::Tensor readRows(const ArrayFile& a, const std::vector<int64_t>& indices) {
  std::vector<int64_t> dims{static_cast<int64_t>(indices.size())};
  dims.insert(dims.end(), a.rowShape.begin(), a.rowShape.end());
  at::Tensor out = at::empty(dims, a.type);
  auto* bytes = static_cast<char*>(out.data_ptr());
  for (size_t r = 0; r < indices.size(); ++r) {
    const int64_t i = indices[r];
    CARAVAN_CHECK(i >= 0 && i < a.rows, "index {} of {}", i, a.rows);
    if (!preadFully(a.fd->get(), bytes + r * a.rowBytes, static_cast<size_t>(a.rowBytes),
                    a.header.dataOffset + i * a.rowBytes)) {
      throw DataError(fmt::format(
          "cannot read {} example {}: the file changed or failed while training", a.path, i));
    }
  }
  return out;
}

// The smallest and largest value of an integer array, in one pass read in pieces.
std::pair<int64_t, int64_t> integerRange(const ArrayFile& a) {
  const int64_t item = a.header.itemSize;
  const int64_t total = a.header.payloadBytes();
  std::vector<char> piece(size_t{1} << 20);
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = std::numeric_limits<int64_t>::min();
  for (int64_t at = 0; at < total;) {
    const int64_t want = std::min<int64_t>(static_cast<int64_t>(piece.size()), total - at);
    if (!preadFully(a.fd->get(), piece.data(), static_cast<size_t>(want),
                    a.header.dataOffset + at)) {
      throw DataError(fmt::format("cannot read {}: it changed or failed while read", a.path));
    }
    for (int64_t k = 0; k < want; k += item) {
      int64_t v;
      if (item == 1) {
        v = static_cast<uint8_t>(piece[k]);
      } else {
        std::memcpy(&v, piece.data() + k, 8);
      }
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
    at += want;
  }
  return {lo, hi};
}

class NpyDataset : public Dataset {
 public:
  NpyDataset(std::string name, ArrayFile inputs, ArrayFile targets, DataShape shape)
      : name_(std::move(name)),
        inputs_(std::move(inputs)),
        targets_(std::move(targets)),
        shape_(std::move(shape)) {}

  std::string name() const override { return name_; }
  int64_t size() const override { return inputs_.rows; }
  DataShape shape() const override { return shape_; }
  Batch get(const std::vector<int64_t>& indices) const override {
    at::Tensor input = readRows(inputs_, indices);
    at::Tensor target = readRows(targets_, indices);
    if (input.scalar_type() == at::kByte) input = input.to(at::kFloat).div_(255.0);
    if (target.scalar_type() == at::kByte) target = target.to(at::kLong);
    return Batch{input, target};
  }

 private:
  std::string name_;
  ArrayFile inputs_;
  ArrayFile targets_;
  DataShape shape_;
};

}  // namespace

int64_t NpyHeader::payloadBytes() const {
  int64_t n = itemSize;
  for (int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
}

NpyHeader parseNpyHeader(std::string_view bytes, const std::string& path, int64_t fileBytes) {
  if (bytes.empty()) throw DataError(fmt::format("{} is empty (expected a .npy array)", path));
  if (bytes.size() < 10 || bytes.substr(0, 6) != kMagic) {
    throw DataError(
        fmt::format("{} is not a .npy file (no \\x93NUMPY magic); write it with np.save", path));
  }
  const int major = static_cast<uint8_t>(bytes[6]);
  if (major < 1 || major > 3) {
    throw DataError(fmt::format("{} is .npy format version {}.{}; Caravan reads versions 1 to 3",
                                path, major, static_cast<uint8_t>(bytes[7])));
  }
  int64_t length = 0;
  int64_t start = 10;
  if (major == 1) {
    length = static_cast<uint8_t>(bytes[8]) | static_cast<uint8_t>(bytes[9]) << 8;
  } else {
    if (bytes.size() < 12) throw DataError(fmt::format("{} ends inside its .npy header", path));
    uint32_t v;
    std::memcpy(&v, bytes.data() + 8, 4);
    length = v;
    start = 12;
  }
  if (length > kMaxHeaderBytes) {
    throw DataError(fmt::format("{} declares a .npy header of {} bytes (corrupt?)", path, length));
  }
  if (static_cast<int64_t>(bytes.size()) < start + length) {
    throw DataError(fmt::format("{} ends inside its .npy header", path));
  }
  NpyHeader h = HeaderParser(bytes.substr(start, length), path).parse();
  h.dataOffset = start + length;
  const int64_t payload = h.payloadBytes();
  if (payload < 0) {
    throw DataError(
        fmt::format("{} has a shape [{}] too large to address", path, fmt::join(h.shape, ", ")));
  }
  if (fileBytes >= 0 && fileBytes - h.dataOffset != payload) {
    throw DataError(fmt::format(
        "{} holds {} bytes of data but its header's shape [{}] of {} needs {} ({}); write it "
        "again with np.save",
        path, fileBytes - h.dataOffset, fmt::join(h.shape, ", "), h.dtype, payload,
        fileBytes - h.dataOffset < payload ? "truncated" : "trailing bytes"));
  }
  return h;
}

NpyHeader readNpyHeader(const std::string& path) { return openArray(path).header; }

std::pair<int64_t, int64_t> npyIntegerRange(const std::string& path) {
  const ArrayFile a = openArray(path);
  if (a.type == at::kFloat) throw DataError(fmt::format("{} holds float32, not integers", path));
  return integerRange(a);
}

DatasetSplits loadNpyArrays(const std::string& dir) {
  if (dir.empty()) {
    throw ConfigError(
        "data.dataset = 'npy' needs data.path: a directory holding train_inputs.npy, "
        "train_targets.npy, test_inputs.npy and test_targets.npy");
  }
  const std::filesystem::path d(dir);
  struct Pair {
    ArrayFile inputs, targets;
  };
  auto pair = [&](const std::string& split) {
    Pair p{openArray((d / (split + "_inputs.npy")).string()),
           openArray((d / (split + "_targets.npy")).string())};
    if (p.inputs.rows != p.targets.rows) {
      throw DataError(fmt::format(
          "{} holds {} examples but {} holds {}; inputs and targets must be the same length",
          p.inputs.path, p.inputs.rows, p.targets.path, p.targets.rows));
    }
    return p;
  };
  Pair train = pair("train");
  Pair test = pair("test");
  for (const auto& [a, b] :
       {std::pair<const ArrayFile*, const ArrayFile*>{&train.inputs, &test.inputs},
        {&train.targets, &test.targets}}) {
    if (a->rowShape != b->rowShape || a->type != b->type) {
      throw DataError(
          fmt::format("{} holds {} examples [{}] but {} holds {} [{}]; train and test must match",
                      a->path, a->header.dtype, fmt::join(a->rowShape, ", "), b->path,
                      b->header.dtype, fmt::join(b->rowShape, ", ")));
    }
  }

  DataShape shape;
  shape.inputShape = train.inputs.rowShape;
  shape.targetShape = train.targets.rowShape;
  shape.inputType = train.inputs.type == at::kByte ? at::kFloat : train.inputs.type;
  shape.targetType = train.targets.type == at::kByte ? at::kLong : train.targets.type;
  if (shape.targetType == at::kFloat) {
    shape.task = TaskKind::kRegression;
  } else {
    // The output layer (and an embedding) is sized from the largest id: one of 1e9 made a
    // model of gigabytes that ended as an out-of-memory with batch-size advice.
    int64_t classes = 0;
    const auto count = [&](const ArrayFile& t, int64_t hi) {
      if (hi >= kMostClasses) {
        throw DataError(fmt::format(
            "{} holds the id {}: a model sized for {} classes (or vocabulary entries) from the "
            "data; Caravan takes at most {}: ids are 0, 1, ... up to the number of classes, so "
            "renumber them (or use float32 targets for regression)",
            t.path, hi, fmt::format("{}", static_cast<uint64_t>(hi) + 1), kMostClasses));
      }
      classes = std::max(classes, hi + 1);
    };
    for (const ArrayFile* t : {&train.targets, &test.targets}) {
      const auto [lo, hi] = integerRange(*t);
      if (lo < 0) {
        throw DataError(fmt::format(
            "{} holds the class id {}; integer targets are class ids 0, 1, ... (use float32 "
            "targets for regression)",
            t->path, lo));
      }
      count(*t, hi);
    }
    shape.task =
        shape.targetShape.empty() ? TaskKind::kImageClassification : TaskKind::kLanguageModel;
    if (shape.task == TaskKind::kLanguageModel && shape.inputType == at::kLong) {
      // Ids in, classes out per position: one vocabulary for both (an embedding's size).
      for (const ArrayFile* t : {&train.inputs, &test.inputs}) {
        const auto [lo, hi] = integerRange(*t);
        if (lo < 0) {
          throw DataError(
              fmt::format("{} holds the id {}; integer inputs are ids 0, 1, ...", t->path, lo));
        }
        count(*t, hi);
      }
    }
    shape.numClasses = classes;
    shape.vocabSize = classes;
    if (!shape.targetShape.empty()) shape.seqLen = shape.targetShape[0];
  }
  if (shape.inputShape.size() == 3) {
    shape.channels = shape.inputShape[0];
    shape.height = shape.inputShape[1];
    shape.width = shape.inputShape[2];
  }
  return DatasetSplits{std::make_shared<NpyDataset>("npy/train", std::move(train.inputs),
                                                    std::move(train.targets), shape),
                       std::make_shared<NpyDataset>("npy/test", std::move(test.inputs),
                                                    std::move(test.targets), shape)};
}

}  // namespace caravan
