// Dataset interface: an indexable collection of examples that can assemble a batch.
//
// Threading: `get` is const and may be called from the loader's background thread while the
// trainer thread calls other const methods; implementations hold immutable tensors only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

namespace caravan {

// What the examples are, so models and losses can be built to match.
enum class TaskKind {
  kImageClassification,  // input [B, C, H, W] float32, target [B] int64 class ids
  kLanguageModel,        // input [B, T] int64 token ids, target [B, T] int64 next tokens
  kRegression,           // input [B, ...], target [B, ...] float32 (mean squared error)
};

struct Batch {
  at::Tensor input;
  at::Tensor target;
  int64_t size() const { return input.defined() ? input.size(0) : 0; }
};

// Shape facts a model registry needs to build a matching model.
struct DataShape {
  TaskKind task = TaskKind::kImageClassification;
  int64_t channels = 1;     // image tasks
  int64_t height = 28;      // image tasks
  int64_t width = 28;       // image tasks
  int64_t numClasses = 10;  // image tasks
  int64_t vocabSize = 0;    // language-model tasks
  int64_t seqLen = 0;       // language-model tasks: tokens per example
  // One example's dimensions and types when the data says them (arrays); empty: the task's
  // (image: [channels, height, width] float32; language model: [seqLen] int64 both).
  std::vector<int64_t> inputShape;
  std::vector<int64_t> targetShape;
  at::ScalarType inputType = at::kFloat;
  at::ScalarType targetType = at::kLong;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::string name() const = 0;
  virtual int64_t size() const = 0;
  virtual DataShape shape() const = 0;
  // Assembles the examples at `indices` (each in [0, size())) into one batch.
  virtual Batch get(const std::vector<int64_t>& indices) const = 0;
  // As get, for the training loader in epoch `epoch` (0, 1, ...): a mixture of sources maps an
  // index to another example of its source each epoch, so that every example of a source comes
  // round. The same as get for every other dataset.
  virtual Batch getForEpoch(const std::vector<int64_t>& indices, int64_t epoch) const {
    return get(indices);
  }
  // A mixture's sources (data.sources, in the config's order) and the one example `index`
  // comes from; one unnamed source otherwise.
  virtual std::vector<std::string> sourceLabels() const { return {}; }
  virtual int sourceOf(int64_t index) const { return 0; }
};

// The rows `indices` of `input` and `target` (dimension 0) as one batch; checks each index
// against the row count. The shared `get` of datasets that hold ready-made tensors.
Batch selectRows(const at::Tensor& input, const at::Tensor& target,
                 const std::vector<int64_t>& indices);

// The train and evaluation splits of one dataset.
struct DatasetSplits {
  std::shared_ptr<const Dataset> train;
  std::shared_ptr<const Dataset> test;
};

}  // namespace caravan
