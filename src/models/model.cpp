// BlockModel and the model registry: mlp, cnn, resnet-mini, gpt built from models/blocks.h,
// their defaults, the checks of a ModelSpec against the data, and analytic forward FLOPs.
#include "models/model.h"

#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/errors.h"
#include "models/blocks.h"
#include "models/loss.h"
#include "models/precision.h"
#include "models/script_model.h"

namespace caravan {

BlockModelImpl::BlockModelImpl(std::string name, TaskKind task)
    : name_(std::move(name)), task_(task) {}

torch::Tensor BlockModelImpl::forward(torch::Tensor x) {
  Context context;
  return forwardBlocks(std::move(x), 0, blocks_.size(), context);
}

torch::Tensor BlockModelImpl::forwardBlocks(torch::Tensor x, size_t begin, size_t end,
                                            Context& context) {
  CARAVAN_CHECK(begin <= end && end <= blocks_.size(), "blocks [{}, {}) of {}", begin, end,
                blocks_.size());
  if (context.size() < contextSlots_) context.resize(contextSlots_);
  ContextScope scope(*this, context);
  for (size_t i = begin; i < end; ++i) {
    x = runner_ != nullptr ? runner_->run(i, blocks_[i], std::move(x))
                           : blocks_[i].forward(std::move(x));
  }
  return x;
}

namespace {

// A block under bf16 autocast (precision.h): the block is its registered child, so its
// parameters() and buffers() are the block's own.
class Bf16BlockImpl : public torch::nn::Module {
 public:
  explicit Bf16BlockImpl(torch::nn::AnyModule inner) : inner_(std::move(inner)) {
    register_module("block", inner_.ptr());
  }
  torch::Tensor forward(torch::Tensor x) {
    torch::Tensor y;
    {
      Bf16Autocast autocast;
      y = inner_.forward(std::move(x));
    }
    const bool lowered = y.scalar_type() == at::kBFloat16 || y.scalar_type() == at::kHalf;
    return lowered ? y.to(at::kFloat) : y;  // float64 blocks keep their outputs
  }

 private:
  torch::nn::AnyModule inner_;
};
TORCH_MODULE(Bf16Block);

}  // namespace

void BlockModelImpl::setBf16(size_t i, bool bf16) {
  if (bf16 == this->bf16(i)) return;
  blocks_.at(i) = bf16 ? torch::nn::AnyModule(Bf16Block(plain_.at(i))) : plain_.at(i);
}

void BlockModelImpl::setBf16(const std::vector<bool>& bf16) {
  CARAVAN_CHECK_EQ(bf16.size(), blocks_.size(), "one precision per block");
  for (size_t i = 0; i < bf16.size(); ++i) setBf16(i, bf16[i]);
}

at::Tensor BlockModelImpl::loss(const at::Tensor& output, const at::Tensor& target) const {
  return loss_ ? loss_(output, target) : taskLoss(task_, output, target);
}

std::string BlockModelImpl::exportName(const std::string& name) const {
  const auto it = exportNames_.find(name);
  return it == exportNames_.end() || it->second.empty() ? name : it->second.front();
}

std::vector<at::Tensor> BlockModelImpl::blockBuffers(size_t i) {
  std::vector<at::Tensor> out = blocks_.at(i).ptr()->buffers();
  if (sharedUses_.empty()) return out;
  const auto all = named_buffers();
  for (const SharedUse& use : sharedUses_) {
    if (use.user != i) continue;
    if (const at::Tensor* b = all.find(use.name)) out.push_back(*b);
  }
  return out;
}

std::vector<std::string> BlockModelImpl::exportNames(const std::string& name) const {
  const auto it = exportNames_.find(name);
  return it == exportNames_.end() ? std::vector<std::string>{name} : it->second;
}

namespace {

// Defaults (a ModelSpec field of 0 selects them).
constexpr int64_t kMlpWidth = 256;
constexpr int64_t kMlpDepth = 2;
constexpr int64_t kCnnWidth = 32;
constexpr int64_t kCnnKernel = 5;
constexpr int64_t kCnnHidden = 128;
constexpr int64_t kResnetWidth = 16;
constexpr int64_t kResnetDepth = 1;
constexpr int64_t kResnetStages = 3;
constexpr int64_t kGptWidth = 128;
constexpr int64_t kGptDepth = 4;
constexpr int64_t kGptHeads = 4;

int64_t orDefault(int64_t value, int64_t fallback) { return value == 0 ? fallback : value; }

// 2 * multiply-adds of a k x k convolution producing [out, h, w] from `in` channels.
double convFlops(int64_t in, int64_t out, int64_t kernel, int64_t h, int64_t w) {
  return 2.0 * static_cast<double>(in * kernel * kernel) * static_cast<double>(out * h * w);
}

double linearFlops(int64_t in, int64_t out) {
  return 2.0 * static_cast<double>(in) * static_cast<double>(out);
}

std::string taskName(TaskKind task) {
  switch (task) {
    case TaskKind::kLanguageModel: return "language-model";
    case TaskKind::kRegression: return "regression";
    case TaskKind::kImageClassification: break;
  }
  return "image-classification";
}

// Fields that only some models use: a value for another model is a mistake worth naming.
void rejectUnused(const ModelSpec& spec, bool usesDepth, bool usesHeads, bool usesDropout) {
  if (!usesDepth && spec.depth != 0) {
    throw ConfigError(fmt::format(
        "model.depth = {} has no meaning for model.name = '{}'; remove it", spec.depth,
        spec.name));
  }
  if (!usesHeads && spec.heads != 0) {
    throw ConfigError(fmt::format(
        "model.heads = {} has no meaning for model.name = '{}' (only gpt has attention heads); "
        "remove it",
        spec.heads, spec.name));
  }
  if (!usesHeads && spec.attention != AttentionKernel::kExplicit) {
    throw ConfigError(fmt::format(
        "model.attention = 'sdpa' has no meaning for model.name = '{}' (only gpt has attention); "
        "remove it",
        spec.name));
  }
  if (!usesDropout && spec.dropout != 0.0) {
    throw ConfigError(fmt::format(
        "model.dropout = {} is not supported by model.name = '{}' (only mlp and gpt use "
        "dropout); remove it",
        spec.dropout, spec.name));
  }
}

BlockModel buildMlp(const ModelSpec& spec, const DataShape& shape) {
  rejectUnused(spec, /*usesDepth=*/true, /*usesHeads=*/false, /*usesDropout=*/true);
  const int64_t width = orDefault(spec.width, kMlpWidth);
  const int64_t depth = orDefault(spec.depth, kMlpDepth);
  const int64_t inputs = shape.channels * shape.height * shape.width;

  BlockModel model(spec.name, shape.task);
  double flops = 0.0;
  int64_t in = inputs;
  for (int64_t i = 0; i < depth; ++i) {
    model->addBlock("hidden" + std::to_string(i), MlpLayer(in, width, spec.dropout));
    flops += linearFlops(in, width);
    in = width;
  }
  model->addBlock("head", LinearHead(in, shape.numClasses));
  flops += linearFlops(in, shape.numClasses);
  model->setForwardFlopsPerExample(flops);
  return model;
}

BlockModel buildCnn(const ModelSpec& spec, const DataShape& shape) {
  rejectUnused(spec, /*usesDepth=*/false, /*usesHeads=*/false, /*usesDropout=*/false);
  if (shape.height < 4 || shape.width < 4) {
    throw ConfigError(fmt::format(
        "model.name = 'cnn' pools twice and needs images of at least 4x4 pixels, but the "
        "dataset's are {}x{}; choose model.name = 'mlp'",
        shape.height, shape.width));
  }
  const int64_t width = orDefault(spec.width, kCnnWidth);
  int64_t h = shape.height, w = shape.width;

  BlockModel model(spec.name, shape.task);
  double flops = 0.0;
  model->addBlock("conv1", ConvStage(shape.channels, width, kCnnKernel));
  flops += convFlops(shape.channels, width, kCnnKernel, h, w);
  h /= 2, w /= 2;
  model->addBlock("conv2", ConvStage(width, 2 * width, kCnnKernel));
  flops += convFlops(width, 2 * width, kCnnKernel, h, w);
  h /= 2, w /= 2;
  const int64_t features = 2 * width * h * w;
  model->addBlock("head", MlpHead(features, kCnnHidden, shape.numClasses));
  flops += linearFlops(features, kCnnHidden) + linearFlops(kCnnHidden, shape.numClasses);
  model->setForwardFlopsPerExample(flops);
  return model;
}

BlockModel buildResnetMini(const ModelSpec& spec, const DataShape& shape) {
  rejectUnused(spec, /*usesDepth=*/true, /*usesHeads=*/false, /*usesDropout=*/false);
  const int64_t width = orDefault(spec.width, kResnetWidth);
  const int64_t depth = orDefault(spec.depth, kResnetDepth);
  int64_t h = shape.height, w = shape.width;

  BlockModel model(spec.name, shape.task);
  double flops = 0.0;
  model->addBlock("stem", ConvBnRelu(shape.channels, width));
  flops += convFlops(shape.channels, width, 3, h, w);
  int64_t in = width;
  for (int64_t stage = 0; stage < kResnetStages; ++stage) {
    const int64_t out = width << stage;
    for (int64_t i = 0; i < depth; ++i) {
      const int64_t stride = (stage > 0 && i == 0) ? 2 : 1;
      BasicBlock block(in, out, stride);
      h = (h - 1) / stride + 1, w = (w - 1) / stride + 1;  // 3x3 pad 1 (and 1x1 pad 0)
      flops += convFlops(in, out, 3, h, w) + convFlops(out, out, 3, h, w);
      if (block->hasProjection()) flops += convFlops(in, out, 1, h, w);
      model->addBlock(fmt::format("stage{}_{}", stage + 1, i), std::move(block));
      in = out;
    }
  }
  model->addBlock("head", PoolLinearHead(in, shape.numClasses));
  flops += linearFlops(in, shape.numClasses);
  model->setForwardFlopsPerExample(flops);
  return model;
}

BlockModel buildGpt(const ModelSpec& spec, const DataShape& shape) {
  rejectUnused(spec, /*usesDepth=*/true, /*usesHeads=*/true, /*usesDropout=*/true);
  GptOptions options;
  options.vocabSize = shape.vocabSize;
  options.context = shape.seqLen;
  options.width = orDefault(spec.width, kGptWidth);
  options.layers = orDefault(spec.depth, kGptDepth);
  options.heads = orDefault(spec.heads, kGptHeads);
  options.dropout = spec.dropout;
  options.attention = spec.attention;
  if (options.width % options.heads != 0) {
    throw ConfigError(fmt::format(
        "model.heads = {}{} does not divide model.width = {}{}; choose heads that divide width",
        options.heads, spec.heads == 0 ? " (the default)" : "", options.width,
        spec.width == 0 ? " (the default)" : ""));
  }

  BlockModel model(spec.name, shape.task);
  model->addBlock("embed", TokenEmbedding(options));
  for (int64_t i = 0; i < options.layers; ++i) {
    model->addBlock("layer" + std::to_string(i), TransformerBlock(options));
  }
  model->addBlock("head", LmHead(options));

  // Per sequence of T tokens: qkv, attention scores and weighted values (full T x T, as
  // computed), output projection and the 4x MLP per layer, then the vocabulary projection.
  const double t = static_cast<double>(options.context);
  const double d = static_cast<double>(options.width);
  const double perLayer = t * (linearFlops(options.width, 3 * options.width) +
                               linearFlops(options.width, options.width) +
                               2.0 * linearFlops(options.width, 4 * options.width)) +
                          2.0 * (2.0 * t * t * d);
  const double head = t * linearFlops(options.width, options.vocabSize);
  model->setForwardFlopsPerExample(static_cast<double>(options.layers) * perLayer + head);
  return model;
}

struct Entry {
  const char* name;
  TaskKind task;
  BlockModel (*build)(const ModelSpec&, const DataShape&);
};

constexpr Entry kRegistry[] = {
    {"mlp", TaskKind::kImageClassification, buildMlp},
    {"cnn", TaskKind::kImageClassification, buildCnn},
    {"resnet-mini", TaskKind::kImageClassification, buildResnetMini},
    {"gpt", TaskKind::kLanguageModel, buildGpt},
};

std::string modelsFor(TaskKind task) {
  std::string names;
  for (const auto& entry : kRegistry) {
    if (entry.task != task) continue;
    names += (names.empty() ? "" : ", ") + std::string(entry.name);
  }
  return names;
}

void checkSpec(const ModelSpec& spec) {
  auto positive = [](const char* key, int64_t value) {
    if (value < 0) {
      throw ConfigError(fmt::format(
          "model.{} = {} must be positive (or 0 for the model's default)", key, value));
    }
  };
  positive("width", spec.width);
  positive("depth", spec.depth);
  positive("heads", spec.heads);
  if (!(spec.dropout >= 0.0 && spec.dropout < 1.0)) {
    throw ConfigError(
        fmt::format("model.dropout = {} must be in [0, 1); use 0 for none", spec.dropout));
  }
}

void checkShape(const DataShape& shape) {
  if (shape.task == TaskKind::kImageClassification) {
    CARAVAN_CHECK(shape.channels > 0 && shape.height > 0 && shape.width > 0 &&
                      shape.numClasses > 0,
                  "bad image data shape {}x{}x{}, {} classes", shape.channels, shape.height,
                  shape.width, shape.numClasses);
  } else if (shape.task == TaskKind::kLanguageModel) {
    CARAVAN_CHECK(shape.vocabSize > 0 && shape.seqLen > 0,
                  "bad language-model data shape: vocab {}, seqLen {}", shape.vocabSize,
                  shape.seqLen);
  }
}

// Arrays say their examples' shape; the built-in models take images [C, H, W] float32 or
// token windows [T] int64 in and out.
void checkBuiltInInput(const ModelSpec& spec, const DataShape& shape) {
  if (shape.inputShape.empty()) return;
  const bool fits = shape.task == TaskKind::kImageClassification
                        ? shape.inputShape.size() == 3 && shape.inputType == at::kFloat
                        : shape.inputShape.size() == 1 && shape.inputShape == shape.targetShape &&
                              shape.inputType == at::kLong;
  if (!fits) {
    throw ConfigError(fmt::format(
        "model.name = '{}' takes {} examples, but these are [{}] {}; reshape the arrays or train "
        "your own model (model.name = '{}')",
        spec.name,
        shape.task == TaskKind::kImageClassification ? "[channels, height, width] float32"
                                                     : "[seq] int64 ids with [seq] targets",
        fmt::join(shape.inputShape, ", "), at::toString(shape.inputType), kScriptModelName));
  }
}

}  // namespace

BlockModel buildModel(const ModelSpec& spec, const DataShape& shape) {
  if (spec.name == kScriptModelName) {
    for (const auto& [key, set] : {std::pair<const char*, bool>{"width", spec.width != 0},
                                   {"depth", spec.depth != 0},
                                   {"heads", spec.heads != 0},
                                   {"dropout", spec.dropout != 0.0}}) {
      if (set) {
        throw ConfigError(
            fmt::format("model.{} has no meaning for model.name = '{}' (the "
                        "scripted module is what it is); remove it",
                        key, kScriptModelName));
      }
    }
    checkShape(shape);
    return loadScriptModel(spec, shape);
  }
  for (const auto& [key, set] : {std::pair<const char*, bool>{"path", !spec.path.empty()},
                                 {"blocks", !spec.blocks.empty()},
                                 {"loss", !spec.loss.empty()}}) {
    if (set) {
      throw ConfigError(
          fmt::format("model.{} is for model.name = '{}' only; remove it (model.name "
                      "= '{}' is built in)",
                      key, kScriptModelName, spec.name));
    }
  }
  for (const auto& entry : kRegistry) {
    if (spec.name != entry.name) continue;
    if (entry.task != shape.task && modelsFor(shape.task).empty()) {
      throw ConfigError(fmt::format(
          "no built-in model trains {} data; write the model in PyTorch and train it with "
          "model.name = '{}' (README: Your own model)",
          taskName(shape.task), kScriptModelName));
    }
    if (entry.task != shape.task) {
      throw ConfigError(fmt::format(
          "model.name = '{}' is a{} {} model but the dataset is for {}; choose one of: {}",
          spec.name, entry.task == TaskKind::kImageClassification ? "n" : "",
          taskName(entry.task), taskName(shape.task), modelsFor(shape.task)));
    }
    checkSpec(spec);
    checkShape(shape);
    checkBuiltInInput(spec, shape);
    return entry.build(spec, shape);
  }
  std::string known;
  for (const auto& name : modelNames()) known += (known.empty() ? "" : ", ") + name;
  throw ConfigError(fmt::format("model.name = '{}' is not a known model; choose one of: {}",
                                spec.name, known));
}

std::vector<std::string> modelNames() {
  std::vector<std::string> names;
  for (const auto& entry : kRegistry) names.emplace_back(entry.name);
  names.emplace_back(kScriptModelName);
  return names;
}

}  // namespace caravan
