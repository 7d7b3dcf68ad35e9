// Deterministic synthetic datasets with learnable structure, generated from std::mt19937_64 with
// our own uniform/normal transforms so the data is identical across standard libraries and
// LibTorch versions.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "data/sources.h"

namespace caravan {
namespace {

constexpr double kPrototypeScale = 0.5;  // class-mean amplitude relative to unit pixel noise
constexpr int64_t kSuccessorsPerToken = 3;
constexpr std::array<double, kSuccessorsPerToken> kSuccessorWeights = {0.6, 0.3, 0.1};
constexpr double kPi = 3.14159265358979323846;

class Rng {
 public:
  explicit Rng(uint64_t seed) : engine_(seed) {}
  double uniform() { return static_cast<double>(engine_() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {  // Box-Muller, one value per call
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * kPi * u2);
  }
  int64_t below(int64_t n) {  // uniform in [0, n), unbiased by rejection
    const uint64_t bound = static_cast<uint64_t>(n);
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t x;
    do {
      x = engine_();
    } while (x >= limit);
    return static_cast<int64_t>(x % bound);
  }

 private:
  std::mt19937_64 engine_;
};

// Holds ready-made inputs and targets; a batch is an index_select of each.
class SyntheticDataset : public Dataset {
 public:
  SyntheticDataset(std::string name, DataShape shape, at::Tensor input, at::Tensor target)
      : name_(std::move(name)),
        shape_(shape),
        input_(std::move(input)),
        target_(std::move(target)) {}

  std::string name() const override { return name_; }
  int64_t size() const override { return input_.size(0); }
  DataShape shape() const override { return shape_; }
  Batch get(const std::vector<int64_t>& indices) const override {
    return selectRows(input_, target_, indices);
  }

 private:
  std::string name_;
  DataShape shape_;
  at::Tensor input_;
  at::Tensor target_;
};

void requirePositive(int64_t value, int64_t minimum, const char* what) {
  if (value < minimum) {
    throw ConfigError(
        fmt::format("synthetic data: {} must be at least {}, got {}", what, minimum, value));
  }
}

// Image task: example = prototype[label] + N(0, 1) noise; prototypes are N(0, kPrototypeScale^2).
DatasetSplits makeImages(const SyntheticOptions& o, Rng& rng) {
  DataShape shape;
  shape.task = TaskKind::kImageClassification;
  shape.channels = o.channels;
  shape.height = o.height;
  shape.width = o.width;
  shape.numClasses = o.numClasses;
  const int64_t pixels = o.channels * o.height * o.width;
  std::vector<float> prototypes(static_cast<size_t>(o.numClasses * pixels));
  for (float& v : prototypes) v = static_cast<float>(kPrototypeScale * rng.normal());

  auto makeSplit = [&](const std::string& name, int64_t n) {
    at::Tensor images = at::empty({n, o.channels, o.height, o.width}, at::kFloat);  // [N,C,H,W]
    at::Tensor labels = at::empty({n}, at::kLong);                                  // [N]
    float* px = images.data_ptr<float>();
    int64_t* lb = labels.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      const int64_t label = rng.below(o.numClasses);
      lb[i] = label;
      const float* proto = prototypes.data() + label * pixels;
      for (int64_t p = 0; p < pixels; ++p) {
        px[i * pixels + p] = proto[p] + static_cast<float>(rng.normal());
      }
    }
    return std::make_shared<SyntheticDataset>(name, shape, images, labels);
  };
  auto train = makeSplit("synthetic-images/train", o.trainSize);
  auto test = makeSplit("synthetic-images/test", o.testSize);
  return DatasetSplits{train, test};
}

// Language-model task: each token has up to kSuccessorsPerToken fixed successors drawn once,
// taken with probabilities kSuccessorWeights; each example is an independent chain of
// seqLen+1 tokens starting at a uniform token.
DatasetSplits makeTokens(const SyntheticOptions& o, Rng& rng) {
  DataShape shape;
  shape.task = TaskKind::kLanguageModel;
  shape.vocabSize = o.vocabSize;
  shape.seqLen = o.seqLen;
  const int64_t k = std::min(kSuccessorsPerToken, o.vocabSize);
  std::vector<int64_t> successors(static_cast<size_t>(o.vocabSize * k));
  for (int64_t a = 0; a < o.vocabSize; ++a) {
    // k distinct successors: a partial Fisher-Yates over 0..vocabSize-1.
    std::vector<int64_t> pool(static_cast<size_t>(o.vocabSize));
    for (int64_t t = 0; t < o.vocabSize; ++t) pool[t] = t;
    for (int64_t j = 0; j < k; ++j) {
      std::swap(pool[j], pool[j + rng.below(o.vocabSize - j)]);
      successors[a * k + j] = pool[j];
    }
  }
  double totalWeight = 0.0;
  for (int64_t j = 0; j < k; ++j) totalWeight += kSuccessorWeights[j];

  auto makeSplit = [&](const std::string& name, int64_t n) {
    const int64_t t = o.seqLen;
    at::Tensor input = at::empty({n, t}, at::kLong);   // [N, T]
    at::Tensor target = at::empty({n, t}, at::kLong);  // [N, T]
    int64_t* in = input.data_ptr<int64_t>();
    int64_t* out = target.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) {
      int64_t token = rng.below(o.vocabSize);
      for (int64_t s = 0; s <= t; ++s) {
        if (s < t) in[i * t + s] = token;
        if (s > 0) out[i * t + s - 1] = token;
        double u = rng.uniform() * totalWeight;
        int64_t j = 0;
        while (j + 1 < k && u >= kSuccessorWeights[j]) u -= kSuccessorWeights[j++];
        token = successors[token * k + j];
      }
    }
    return std::make_shared<SyntheticDataset>(name, shape, input, target);
  };
  auto train = makeSplit("synthetic-tokens/train", o.trainSize);
  auto test = makeSplit("synthetic-tokens/test", o.testSize);
  return DatasetSplits{train, test};
}

}  // namespace

DatasetSplits makeSynthetic(const SyntheticOptions& options) {
  requirePositive(options.trainSize, 1, "train size");
  requirePositive(options.testSize, 1, "test size");
  Rng rng(options.seed);
  if (options.task == TaskKind::kImageClassification) {
    requirePositive(options.channels, 1, "channels");
    requirePositive(options.height, 1, "height");
    requirePositive(options.width, 1, "width");
    requirePositive(options.numClasses, 2, "number of classes");
    return makeImages(options, rng);
  }
  requirePositive(options.vocabSize, 2, "vocabulary size");
  requirePositive(options.seqLen, 1, "sequence length");
  return makeTokens(options, rng);
}

}  // namespace caravan
