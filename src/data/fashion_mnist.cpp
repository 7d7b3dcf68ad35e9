// IDX image/label pairs (Fashion-MNIST, MNIST, KMNIST, EMNIST): four IDX files decoded and
// normalized once at load, so that a batch is a single index_select on a contiguous float
// tensor.
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

struct Split {
  at::Tensor images;  // uint8 [N, H, W]
  at::Tensor labels;  // uint8 [N]
};

class FashionMnistDataset : public Dataset {
 public:
  // images: float32 [N, 1, 28, 28], contiguous, already normalized; labels: int64 [N]
  FashionMnistDataset(std::string name, at::Tensor images, at::Tensor labels, int64_t classes)
      : name_(std::move(name)),
        images_(std::move(images)),
        labels_(std::move(labels)),
        classes_(classes) {}

  std::string name() const override { return name_; }
  int64_t size() const override { return labels_.size(0); }
  DataShape shape() const override {
    DataShape s;
    s.task = TaskKind::kImageClassification;
    s.channels = 1;
    s.height = images_.size(2);
    s.width = images_.size(3);
    s.numClasses = classes_;
    return s;
  }

  Batch get(const std::vector<int64_t>& indices) const override {
    return selectRows(images_, labels_, indices);
  }

 private:
  std::string name_;
  at::Tensor images_;
  at::Tensor labels_;
  int64_t classes_;
};

// The file `prefix` + `name` + "-ubyte", gzipped or not (the gzipped one when both are there).
std::string idxFile(const std::string& prefix, const std::string& name) {
  const std::string plain = prefix + name + "-ubyte";
  std::error_code ec;
  return std::filesystem::exists(plain + ".gz", ec) || !std::filesystem::exists(plain, ec)
             ? plain + ".gz"
             : plain;
}

// `split`: "train", or the test split's names ("t10k" in MNIST's layout, "test" in EMNIST's).
Split loadSplit(const std::string& prefix, const std::vector<std::string>& names) {
  std::string split = names.front();
  for (const auto& n : names) {
    std::error_code ec;
    if (std::filesystem::exists(idxFile(prefix, n + "-images-idx3"), ec)) split = n;
  }
  const std::string imagesPath = idxFile(prefix, split + "-images-idx3");
  const std::string labelsPath = idxFile(prefix, split + "-labels-idx1");
  IdxArray images = readIdx(imagesPath);
  IdxArray labels = readIdx(labelsPath);
  if (images.dims.size() != 3 || images.dims[1] < 1 || images.dims[2] < 1) {
    throw DataError(fmt::format("unexpected image shape in {}: [{}] (expected [N, height, width])",
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

std::shared_ptr<const Dataset> makeDataset(const std::string& name, const Split& split, double mean,
                                           double stddev, int64_t classes) {
  // (x/255 - mean) / std as one affine map on the raw bytes.
  const at::Tensor images = split.images.to(at::kFloat)
                                .sub_(mean * 255.0)
                                .div_(stddev * 255.0)
                                .unsqueeze(1)
                                .contiguous();
  return std::make_shared<FashionMnistDataset>(name, images, split.labels.to(at::kLong), classes);
}

}  // namespace

DatasetSplits loadIdxPairs(const std::string& path, const std::string& name) {
  std::error_code ec;
  const bool dir = std::filesystem::is_directory(path, ec);
  const std::string prefix = dir ? (std::filesystem::path(path) / "").string() : path;
  if (!dir && !std::filesystem::exists(idxFile(prefix, "train-images-idx3"), ec)) {
    throw DataError(fmt::format(
        "{} directory not found: {} (data.path: a directory holding train-images-idx3-ubyte.gz, "
        "train-labels-idx1-ubyte.gz, t10k-... or test-...; or such a directory and a file name "
        "prefix, e.g. emnist/emnist-letters-){}",
        name, path,
        name == "fashion-mnist" ? "; install it: apt-get install dataset-fashion-mnist, or run "
                                  "scripts/setup.sh"
                                : ""));
  }
  const Split train = loadSplit(prefix, {"train"});
  const Split test = loadSplit(prefix, {"t10k", "test"});
  if (train.images.size(1) != test.images.size(1) || train.images.size(2) != test.images.size(2)) {
    throw DataError(fmt::format("{}: training images are {}x{} but test images {}x{}", path,
                                train.images.size(1), train.images.size(2), test.images.size(1),
                                test.images.size(2)));
  }
  // The classes: every label id below the largest + 1 (EMNIST letters: 1..26, so 27 outputs).
  const int64_t classes =
      std::max(train.labels.max().item<int64_t>(), test.labels.max().item<int64_t>()) + 1;
  const auto [mean, stddev] = pixelMoments(train.images);
  return DatasetSplits{makeDataset(name + "/train", train, mean, stddev, classes),
                       makeDataset(name + "/test", test, mean, stddev, classes)};
}

}  // namespace caravan
