// Fashion-MNIST: four gzipped IDX files decoded and normalized once at load, so that a batch
// is a single index_select on a contiguous float tensor.
#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include <fmt/ranges.h>

#include "core/errors.h"
#include "data/sources.h"

namespace caravan {
namespace {

constexpr int64_t kImageSide = 28;
constexpr int64_t kNumClasses = 10;

struct Split {
  at::Tensor images;  // uint8 [N, 28, 28]
  at::Tensor labels;  // uint8 [N]
};

class FashionMnistDataset : public Dataset {
 public:
  // images: float32 [N, 1, 28, 28], contiguous, already normalized; labels: int64 [N]
  FashionMnistDataset(std::string name, at::Tensor images, at::Tensor labels)
      : name_(std::move(name)), images_(std::move(images)), labels_(std::move(labels)) {}

  std::string name() const override { return name_; }
  int64_t size() const override { return labels_.size(0); }
  DataShape shape() const override {
    DataShape s;
    s.task = TaskKind::kImageClassification;
    s.channels = 1;
    s.height = kImageSide;
    s.width = kImageSide;
    s.numClasses = kNumClasses;
    return s;
  }

  Batch get(const std::vector<int64_t>& indices) const override {
    return selectRows(images_, labels_, indices);
  }

 private:
  std::string name_;
  at::Tensor images_;
  at::Tensor labels_;
};

Split loadSplit(const std::filesystem::path& dir, const std::string& prefix) {
  const std::string imagesPath = (dir / (prefix + "-images-idx3-ubyte.gz")).string();
  const std::string labelsPath = (dir / (prefix + "-labels-idx1-ubyte.gz")).string();
  IdxArray images = readIdx(imagesPath);
  IdxArray labels = readIdx(labelsPath);
  if (images.dims.size() != 3 || images.dims[1] != kImageSide || images.dims[2] != kImageSide) {
    throw DataError(fmt::format(
        "unexpected image shape in {}: [{}] (expected [N, 28, 28]; is this Fashion-MNIST?)",
        imagesPath, fmt::join(images.dims, ", ")));
  }
  if (labels.dims.size() != 1) {
    throw DataError(fmt::format("unexpected label shape in {}: [{}] (expected [N])", labelsPath,
                                fmt::join(labels.dims, ", ")));
  }
  if (images.dims[0] != labels.dims[0]) {
    throw DataError(fmt::format("{} holds {} images but {} holds {} labels (reinstall the dataset)",
                                imagesPath, images.dims[0], labelsPath, labels.dims[0]));
  }
  const int64_t maxLabel = labels.data.max().item<int64_t>();
  if (maxLabel >= kNumClasses) {
    throw DataError(fmt::format("corrupt label file {}: label {} is not a class id 0..9",
                                labelsPath, maxLabel));
  }
  return Split{images.data, labels.data};
}

// Mean and (population) standard deviation of the pixel values scaled to [0, 1], computed
// exactly from a histogram of the bytes.
std::pair<double, double> pixelMoments(const at::Tensor& images) {
  std::array<int64_t, 256> histogram{};
  const uint8_t* p = images.data_ptr<uint8_t>();
  const int64_t n = images.numel();
  for (int64_t i = 0; i < n; ++i) ++histogram[p[i]];
  double sum = 0.0, sumSquares = 0.0;
  for (int v = 0; v < 256; ++v) {
    const double x = v / 255.0;
    sum += x * static_cast<double>(histogram[v]);
    sumSquares += x * x * static_cast<double>(histogram[v]);
  }
  const double mean = sum / static_cast<double>(n);
  const double variance = sumSquares / static_cast<double>(n) - mean * mean;
  return {mean, std::sqrt(std::max(variance, 1e-12))};
}

std::shared_ptr<const Dataset> makeDataset(const std::string& name, const Split& split,
                                           double mean, double stddev) {
  // (x/255 - mean) / std as one affine map on the raw bytes.
  const at::Tensor images = split.images.to(at::kFloat)
                                .sub_(mean * 255.0)
                                .div_(stddev * 255.0)
                                .unsqueeze(1)
                                .contiguous();
  return std::make_shared<FashionMnistDataset>(name, images, split.labels.to(at::kLong));
}

}  // namespace

DatasetSplits loadFashionMnist(const std::string& dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    throw DataError(fmt::format(
        "Fashion-MNIST directory not found: {} (install it: apt-get install "
        "dataset-fashion-mnist, or run scripts/setup.sh, or set data.path)",
        dir));
  }
  const Split train = loadSplit(dir, "train");
  const Split test = loadSplit(dir, "t10k");
  const auto [mean, stddev] = pixelMoments(train.images);
  return DatasetSplits{makeDataset("fashion-mnist/train", train, mean, stddev),
                       makeDataset("fashion-mnist/test", test, mean, stddev)};
}

}  // namespace caravan
