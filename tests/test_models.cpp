// Tests of the model registry and blocks: shapes, gradients (autograd vs central differences in
// float64), parameter counts and FLOPs against independent formulas, causality of gpt,
// determinism, config errors, and a comparison (the project's .venv torch) of forward outputs
// and gradients with the PyTorch models in tests/python/reference_models.py.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "core/errors.h"
#include "models/blocks.h"
#include "models/model.h"
#include "models/precision.h"
#include "test_util.h"
#include "train/checkpoint.h"

namespace caravan {
namespace {

DataShape imageShape(int64_t channels = 1, int64_t side = 28, int64_t classes = 10) {
  DataShape shape;
  shape.task = TaskKind::kImageClassification;
  shape.channels = channels;
  shape.height = side;
  shape.width = side;
  shape.numClasses = classes;
  return shape;
}

DataShape lmShape(int64_t vocab = 80, int64_t seqLen = 128) {
  DataShape shape;
  shape.task = TaskKind::kLanguageModel;
  shape.vocabSize = vocab;
  shape.seqLen = seqLen;
  return shape;
}

ModelSpec spec(const std::string& name, int64_t width = 0, int64_t depth = 0, int64_t heads = 0,
               double dropout = 0.0) {
  ModelSpec s;
  s.name = name;
  s.width = width;
  s.depth = depth;
  s.heads = heads;
  s.dropout = dropout;
  return s;
}

int64_t countParameters(torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : module.parameters()) n += p.numel();
  return n;
}

// ---- independent formulas -----------------------------------------------------------------

int64_t linearParams(int64_t in, int64_t out) { return in * out + out; }

int64_t mlpParams(int64_t inputs, int64_t width, int64_t depth, int64_t classes) {
  return linearParams(inputs, width) + (depth - 1) * linearParams(width, width) +
         linearParams(width, classes);
}

int64_t cnnParams(int64_t channels, int64_t side, int64_t width, int64_t classes) {
  const int64_t conv1 = channels * 25 * width + width;
  const int64_t conv2 = width * 25 * 2 * width + 2 * width;
  const int64_t pooled = side / 2 / 2;
  return conv1 + conv2 + linearParams(2 * width * pooled * pooled, 128) +
         linearParams(128, classes);
}

int64_t resnetParams(int64_t channels, int64_t width, int64_t depth, int64_t classes) {
  const auto bn = [](int64_t c) { return 2 * c; };
  int64_t n = channels * 9 * width + bn(width);  // stem
  int64_t in = width;
  for (int64_t out : {width, 2 * width, 4 * width}) {
    for (int64_t i = 0; i < depth; ++i) {
      n += in * 9 * out + bn(out) + out * 9 * out + bn(out);
      if (in != out) n += in * out + bn(out);  // 1x1 projection (stages 2, 3 change width)
      in = out;
    }
  }
  return n + linearParams(4 * width, classes);
}

int64_t gptParams(int64_t vocab, int64_t context, int64_t d, int64_t layers) {
  const int64_t layerNorm = 2 * d;
  const int64_t layer = layerNorm + linearParams(d, 3 * d) + linearParams(d, d) + layerNorm +
                        linearParams(d, 4 * d) + linearParams(4 * d, d);
  return vocab * d + context * d + layers * layer + layerNorm + linearParams(d, vocab);
}

// ---- registry, shapes ----------------------------------------------------------------------

TEST(ModelRegistry, ListsAllModels) {
  EXPECT_EQ(modelNames(),
            (std::vector<std::string>{"mlp", "cnn", "resnet-mini", "gpt", "torchscript"}));
}

TEST(ModelShape, ImageModelsGiveLogits) {
  torch::manual_seed(0);
  for (const auto& name : {"mlp", "cnn", "resnet-mini"}) {
    SCOPED_TRACE(name);
    auto model = buildModel(spec(name), imageShape());
    EXPECT_EQ(model->task(), TaskKind::kImageClassification);
    EXPECT_EQ(model->modelName(), name);
    auto out = model->forward(torch::randn({3, 1, 28, 28}));  // [3, 10]
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3, 10}));
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>());

    auto rgb = buildModel(spec(name, 8, 0), imageShape(3, 32, 7));
    EXPECT_EQ(rgb->forward(torch::randn({2, 3, 32, 32})).sizes(),
              (std::vector<int64_t>{2, 7}));
  }
}

TEST(ModelShape, GptGivesLogitsPerPosition) {
  torch::manual_seed(0);
  auto model = buildModel(spec("gpt"), lmShape());
  EXPECT_EQ(model->task(), TaskKind::kLanguageModel);
  auto tokens = torch::randint(80, {2, 128}, torch::kLong);  // [2, 128]
  EXPECT_EQ(model->forward(tokens).sizes(), (std::vector<int64_t>{2, 128, 80}));
  // Shorter sequences than the context work too (generation, evaluation tails).
  EXPECT_EQ(model->forward(tokens.narrow(1, 0, 5)).sizes(), (std::vector<int64_t>{2, 5, 80}));
}

TEST(ModelShape, BlocksAndParameterNamesAreStable) {
  torch::manual_seed(0);
  auto cnn = buildModel(spec("cnn"), imageShape());
  ASSERT_EQ(cnn->numBlocks(), 3u);
  EXPECT_EQ(cnn->blockLabel(0), "conv1");
  EXPECT_EQ(cnn->blockLabel(2), "head");
  auto names = [](torch::nn::Module& m) {
    std::vector<std::string> out;
    for (const auto& item : m.named_parameters()) out.push_back(item.key());
    return out;
  };
  EXPECT_EQ(names(*cnn), (std::vector<std::string>{
                             "b0_conv1.conv.weight", "b0_conv1.conv.bias", "b1_conv2.conv.weight",
                             "b1_conv2.conv.bias", "b2_head.fc1.weight", "b2_head.fc1.bias",
                             "b2_head.fc2.weight", "b2_head.fc2.bias"}));

  auto gpt = buildModel(spec("gpt", 16, 2, 2), lmShape(11, 6));
  ASSERT_EQ(gpt->numBlocks(), 4u);
  auto gptNames = names(*gpt);
  for (const char* expected :
       {"b0_embed.wte.weight", "b0_embed.wpe.weight", "b1_layer0.ln_1.weight",
        "b1_layer0.attn.c_attn.weight", "b1_layer0.attn.c_proj.bias", "b2_layer1.mlp.c_fc.weight",
        "b2_layer1.mlp.c_proj.weight", "b3_head.ln_f.bias", "b3_head.lm_head.weight"}) {
    EXPECT_NE(std::find(gptNames.begin(), gptNames.end(), expected), gptNames.end()) << expected;
  }
  // The causal mask is not state: it stays out of buffers (and so out of checkpoints).
  EXPECT_TRUE(gpt->named_buffers().is_empty());

  auto resnet = buildModel(spec("resnet-mini", 8, 2), imageShape());
  std::vector<std::string> labels;
  for (size_t i = 0; i < resnet->numBlocks(); ++i) labels.push_back(resnet->blockLabel(i));
  EXPECT_EQ(labels, (std::vector<std::string>{"stem", "stage1_0", "stage1_1", "stage2_0",
                                              "stage2_1", "stage3_0", "stage3_1", "head"}));
  auto resnetNames = names(*resnet);
  for (const char* expected : {"b0_stem.conv.weight", "b0_stem.bn.weight",
                               "b3_stage2_0.shortcut_conv.weight", "b3_stage2_0.bn2.bias",
                               "b7_head.linear.weight"}) {
    EXPECT_NE(std::find(resnetNames.begin(), resnetNames.end(), expected), resnetNames.end())
        << expected;
  }
  EXPECT_TRUE(resnet->named_buffers().contains("b1_stage1_0.bn1.running_mean"));
}

// ---- parameter counts and FLOPs --------------------------------------------------------------

TEST(ModelSize, ParameterCountsMatchFormulas) {
  torch::manual_seed(0);
  auto count = [](const ModelSpec& s, const DataShape& d) {
    auto model = buildModel(s, d);
    return countParameters(*model);
  };
  EXPECT_EQ(count(spec("mlp"), imageShape()), mlpParams(784, 256, 2, 10));
  EXPECT_EQ(count(spec("mlp"), imageShape()), 269322);
  EXPECT_EQ(count(spec("mlp", 64, 3), imageShape(3, 32, 7)), mlpParams(3072, 64, 3, 7));
  EXPECT_EQ(count(spec("cnn"), imageShape()), cnnParams(1, 28, 32, 10));
  EXPECT_EQ(count(spec("cnn"), imageShape()), 454922);
  EXPECT_EQ(count(spec("cnn", 8), imageShape(3, 30, 5)), cnnParams(3, 30, 8, 5));
  EXPECT_EQ(count(spec("resnet-mini"), imageShape()), resnetParams(1, 16, 1, 10));
  EXPECT_EQ(count(spec("resnet-mini"), imageShape()), 77754);
  EXPECT_EQ(count(spec("resnet-mini", 8, 3), imageShape(3, 20, 4)), resnetParams(3, 8, 3, 4));
  EXPECT_EQ(count(spec("gpt"), lmShape()), gptParams(80, 128, 128, 4));
  EXPECT_EQ(count(spec("gpt"), lmShape()), 830288);
  EXPECT_EQ(count(spec("gpt", 48, 3, 6), lmShape(50, 20)), gptParams(50, 20, 48, 3));
}

TEST(ModelSize, ForwardFlopsOfDefaults) {
  torch::manual_seed(0);
  // 2 * multiply-adds, worked out by hand for 28x28x1 images, 10 classes.
  EXPECT_DOUBLE_EQ(buildModel(spec("mlp"), imageShape())->forwardFlopsPerExample(),
                   2.0 * (784 * 256 + 256 * 256 + 256 * 10));
  EXPECT_DOUBLE_EQ(
      buildModel(spec("cnn"), imageShape())->forwardFlopsPerExample(),
      2.0 * (25 * 32 * 28 * 28 + 32 * 25 * 64 * 14 * 14 + 64 * 7 * 7 * 128 + 128 * 10));
  const double stem = 9 * 16 * 28 * 28;
  const double stage1 = 2.0 * 16 * 9 * 16 * 28 * 28;
  const double stage2 = (16 * 9 * 32 + 32 * 9 * 32 + 16 * 32) * 14 * 14;
  const double stage3 = (32 * 9 * 64 + 64 * 9 * 64 + 32 * 64) * 7 * 7;
  EXPECT_DOUBLE_EQ(buildModel(spec("resnet-mini"), imageShape())->forwardFlopsPerExample(),
                   2.0 * (stem + stage1 + stage2 + stage3 + 64 * 10));
  // gpt per sequence of T = 128: per layer qkv + proj + mlp (12 d^2 MACs per token) and
  // QK^T + AV (2 T^2 d MACs); head d * vocab per token.
  const double t = 128, d = 128;
  EXPECT_DOUBLE_EQ(buildModel(spec("gpt"), lmShape())->forwardFlopsPerExample(),
                   2.0 * (4 * (12 * t * d * d + 2 * t * t * d) + t * d * 80));
}

// ---- gradients -------------------------------------------------------------------------------

TEST(ModelBackward, EveryParameterGetsAGradient) {
  struct Case {
    ModelSpec spec;
    DataShape shape;
  };
  const std::vector<Case> cases = {
      {spec("mlp", 16, 2, 0, 0.1), imageShape(1, 8, 5)},
      {spec("cnn", 4), imageShape(1, 8, 5)},
      {spec("resnet-mini", 4, 2), imageShape(2, 8, 5)},
      {spec("gpt", 16, 2, 2, 0.1), lmShape(11, 6)},
  };
  torch::manual_seed(0);
  for (const auto& c : cases) {
    SCOPED_TRACE(c.spec.name);
    auto model = buildModel(c.spec, c.shape);
    model->train();
    torch::Tensor loss;
    if (c.shape.task == TaskKind::kLanguageModel) {
      auto tokens = torch::randint(11, {3, 6}, torch::kLong);  // [3, 6]
      auto logits = model->forward(tokens);                    // [3, 6, 11]
      loss = torch::nn::functional::cross_entropy(logits.reshape({-1, 11}), tokens.reshape(-1));
    } else {
      auto images = torch::randn({4, c.shape.channels, 8, 8});  // [4, C, 8, 8]
      auto logits = model->forward(images);                     // [4, 5]
      loss = torch::nn::functional::cross_entropy(logits, torch::tensor({0, 1, 2, 3}));
    }
    loss.backward();
    for (const auto& item : model->named_parameters()) {
      const auto& grad = item.value().grad();
      ASSERT_TRUE(grad.defined()) << item.key();
      EXPECT_TRUE(torch::isfinite(grad).all().item<bool>()) << item.key();
      EXPECT_GT(grad.abs().max().item<double>(), 0.0) << item.key();
    }
  }
}

// Compares autograd's gradient of sum(forward(x) * w), for a fixed random w, with central
// differences (five-point stencil): for every parameter element and, for a floating input, every input element.
// The module is cast to float64 and its parameters re-drawn at a larger scale than the
// initializers use, so no term is negligible.
void expectGradientsMatch(torch::nn::Module& module,
                          const std::function<torch::Tensor(torch::Tensor)>& forward,
                          torch::Tensor input) {
  constexpr double kStep = 1e-4;
  constexpr double kRelTol = 1e-6;
  constexpr double kAbsTol = 1e-8;
  module.to(torch::kFloat64);
  {
    torch::NoGradGuard noGrad;
    for (auto& p : module.parameters()) p.normal_(0.0, 0.5);
  }
  if (input.is_floating_point()) input = input.to(torch::kFloat64).requires_grad_(true);
  std::vector<std::pair<std::string, torch::Tensor>> targets;
  for (const auto& item : module.named_parameters()) targets.emplace_back(item.key(), item.value());
  if (input.is_floating_point()) targets.emplace_back("input", input);

  auto out = forward(input);
  const auto weights = torch::randn_like(out);
  (out * weights).sum().backward();
  auto loss = [&] {
    torch::NoGradGuard noGrad;
    return (forward(input) * weights).sum().item<double>();
  };

  double worst = 0.0;
  for (auto& [name, tensor] : targets) {
    ASSERT_TRUE(tensor.grad().defined()) << name;
    ASSERT_TRUE(tensor.is_contiguous()) << name;
    const auto grad = tensor.grad().contiguous();
    const double* analytic = grad.data_ptr<double>();
    double* value = tensor.data_ptr<double>();
    for (int64_t i = 0; i < tensor.numel(); ++i) {
      const double saved = value[i];
      auto at = [&](double offset) {
        value[i] = saved + offset;
        return loss();
      };
      // Five-point central difference: truncation error O(h^4), so h can be large enough to
      // keep rounding error (~1e-16 |loss| / h) small.
      const double numeric =
          (8.0 * (at(kStep) - at(-kStep)) - (at(2.0 * kStep) - at(-2.0 * kStep))) /
          (12.0 * kStep);
      value[i] = saved;
      const double error = std::abs(numeric - analytic[i]);
      worst = std::max(worst, error / (std::abs(analytic[i]) + kAbsTol / kRelTol));
      EXPECT_LE(error, kAbsTol + kRelTol * std::abs(analytic[i]))
          << name << "[" << i << "]: autograd " << analytic[i] << " vs numeric " << numeric;
    }
  }
  ::testing::Test::RecordProperty("worst_relative_error", std::to_string(worst));
  if (std::getenv("CARAVAN_GRADCHECK_VERBOSE")) std::printf("worst relative error %.3g\n", worst);
}

template <typename Holder>
void expectBlockGradientsMatch(Holder block, torch::Tensor input) {
  expectGradientsMatch(*block.ptr(), [&](torch::Tensor x) { return block->forward(x); },
                       std::move(input));
}

TEST(ModelGradcheck, MlpLayerAndHeads) {
  torch::manual_seed(1);
  expectBlockGradientsMatch(MlpLayer(12, 5, 0.0), torch::randn({3, 3, 2, 2}));
  expectBlockGradientsMatch(LinearHead(6, 4), torch::randn({3, 6}));
  expectBlockGradientsMatch(MlpHead(12, 5, 4), torch::randn({2, 3, 2, 2}));
  expectBlockGradientsMatch(PoolLinearHead(3, 4), torch::randn({2, 3, 3, 3}));
}

TEST(ModelGradcheck, ConvStage) {
  torch::manual_seed(2);
  expectBlockGradientsMatch(ConvStage(2, 3, 5), torch::randn({2, 2, 6, 6}));
}

TEST(ModelGradcheck, ResnetBlocksInTrainMode) {
  torch::manual_seed(3);
  // Train mode: batch norm uses batch statistics, the case a training step differentiates.
  expectBlockGradientsMatch(ConvBnRelu(2, 3), torch::randn({4, 2, 5, 5}));
  expectBlockGradientsMatch(BasicBlock(3, 3, 1), torch::randn({4, 3, 5, 5}));
  BasicBlock projection(2, 4, 2);
  ASSERT_TRUE(projection->hasProjection());
  expectBlockGradientsMatch(projection, torch::randn({4, 2, 6, 6}));
}

TEST(ModelGradcheck, ResnetBlockInEvalMode) {
  torch::manual_seed(4);
  BasicBlock block(2, 4, 2);
  block->to(torch::kFloat64);
  {
    torch::NoGradGuard noGrad;
    for (auto& b : block->buffers()) {
      if (b.is_floating_point()) b.uniform_(0.5, 1.5);  // non-trivial running statistics
    }
  }
  block->eval();
  expectBlockGradientsMatch(block, torch::randn({2, 2, 5, 5}));
}

// A strided projection from fewer than 8 channels in float32, the case whose channels-last
// backward corrupts the heap inside oneDNN on CPUs without AVX-512 when taken as one strided
// 1x1 convolution (models/blocks.cpp): the block's output and every gradient are its float64
// twin's (LibTorch's own convolutions, no oneDNN), within float32's rounding. Eval mode: the
// convolutions' backward is the same as in train mode.
TEST(ResnetBlocks, StridedProjectionFromFewChannelsTrainsAsItsFloat64Twin) {
  torch::manual_seed(5);
  for (int64_t channels : {1, 3, 4}) {
    BasicBlock block(channels, 8, 2);
    ASSERT_TRUE(block->hasProjection());
    BasicBlock twin(channels, 8, 2);
    twin->to(torch::kFloat64);
    {
      torch::NoGradGuard noGrad;
      const auto from = block->named_parameters();
      for (auto& item : twin->named_parameters()) item.value().copy_(from[item.key()]);
      // Eval mode, with running statistics away from the identity: in train mode a 1x1
      // convolution of one channel followed by batch norm has no gradient to compare (its
      // normalized output does not depend on the weight).
      const auto stats = block->named_buffers();
      for (auto& item : twin->named_buffers()) {
        auto stat = stats[item.key()];  // Module::to made the twin's step counts float64 too
        if (stat.is_floating_point()) stat.uniform_(0.5, 1.5);
        item.value().copy_(stat);
      }
    }
    block->eval();
    twin->eval();
    const auto x = torch::randn({8, channels, 28, 28});
    const auto x32 = x.clone().requires_grad_();
    const auto x64 = x.to(torch::kFloat64).requires_grad_();
    const auto out32 = block->forward(x32);
    const auto out64 = twin->forward(x64);
    const auto weights = torch::randn_like(out64);
    (out32 * weights.to(torch::kFloat32)).sum().backward();
    (out64 * weights).sum().backward();
    auto expectClose = [&](const torch::Tensor& got, const torch::Tensor& want,
                           const std::string& what) {
      const double scale = want.abs().max().item<double>();
      const double error = (got.to(torch::kFloat64) - want).abs().max().item<double>();
      EXPECT_LE(error, 1e-5 * scale) << what << " from " << channels << " channels";
    };
    expectClose(out32.detach(), out64.detach(), "output");
    expectClose(x32.grad(), x64.grad(), "input gradient");
    const auto params64 = twin->named_parameters();
    for (const auto& item : block->named_parameters()) {
      expectClose(item.value().grad(), params64[item.key()].grad(), item.key());
    }
  }
}

GptOptions tinyGpt() {
  GptOptions o;
  o.vocabSize = 7;
  o.context = 5;
  o.width = 8;
  o.heads = 2;
  o.layers = 2;
  return o;
}

TEST(ModelGradcheck, TokenEmbedding) {
  torch::manual_seed(5);
  expectBlockGradientsMatch(TokenEmbedding(tinyGpt()), torch::randint(7, {2, 4}, torch::kLong));
}

TEST(ModelGradcheck, TransformerBlock) {
  torch::manual_seed(6);
  expectBlockGradientsMatch(TransformerBlock(tinyGpt()), torch::randn({2, 5, 8}));
  expectBlockGradientsMatch(TransformerBlock(tinyGpt()), torch::randn({1, 3, 8}));  // T < ctx
}

TEST(ModelGradcheck, LmHead) {
  torch::manual_seed(7);
  expectBlockGradientsMatch(LmHead(tinyGpt()), torch::randn({2, 4, 8}));
}

// ---- gpt causality, determinism ------------------------------------------------------------

TEST(ModelGpt, LogitsDoNotDependOnLaterTokens) {
  torch::manual_seed(8);
  auto model = buildModel(spec("gpt", 32, 2, 4), lmShape(13, 10));
  model->eval();
  torch::NoGradGuard noGrad;
  auto tokens = torch::randint(13, {2, 10}, torch::kLong);  // [2, 10]
  auto before = model->forward(tokens);                     // [2, 10, 13]
  for (int64_t t : {0, 4, 9}) {
    auto changed = tokens.clone();
    changed.select(1, t).add_(1).remainder_(13);
    auto after = model->forward(changed);
    EXPECT_TRUE(torch::equal(before.narrow(1, 0, t), after.narrow(1, 0, t))) << "t = " << t;
    EXPECT_FALSE(torch::allclose(before.select(1, t), after.select(1, t))) << "t = " << t;
  }
}

// model.attention = "sdpa" is the same function as the explicit kernel: from the same weights
// and tokens, the same logits and gradients up to float32 rounding (the two sum the scores in
// other orders), and just as causal; the parameters are the same, so checkpoints and exports
// do not depend on the kernel.
TEST(ModelGpt, SdpaAttentionComputesWhatTheExplicitKernelDoes) {
  ModelSpec sdpaSpec = spec("gpt", 32, 2, 4);
  sdpaSpec.attention = AttentionKernel::kSdpa;
  torch::manual_seed(9);
  auto explicitModel = buildModel(spec("gpt", 32, 2, 4), lmShape(13, 24));
  torch::manual_seed(9);
  auto sdpaModel = buildModel(sdpaSpec, lmShape(13, 24));
  auto tokens = torch::randint(13, {3, 24}, torch::kLong);
  auto a = explicitModel->forward(tokens), b = sdpaModel->forward(tokens);
  EXPECT_TRUE(torch::allclose(a, b, /*rtol=*/1e-5, /*atol=*/1e-6))
      << (a - b).abs().max().item<double>();
  a.square().sum().backward();
  b.square().sum().backward();
  auto pa = explicitModel->named_parameters(), pb = sdpaModel->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& p : pa) {
    const at::Tensor ga = p.value().grad(), gb = pb[p.key()].grad();
    EXPECT_TRUE(torch::allclose(ga, gb, /*rtol=*/1e-4, /*atol=*/1e-6))
        << p.key() << " " << (ga - gb).abs().max().item<double>();
  }
  torch::NoGradGuard noGrad;
  auto changed = tokens.clone();
  changed.select(1, 10).add_(1).remainder_(13);
  EXPECT_TRUE(torch::equal(b.narrow(1, 0, 10), sdpaModel->forward(changed).narrow(1, 0, 10)));
}

TEST(ModelGpt, InitializationFollowsGpt2) {
  torch::manual_seed(9);
  const int64_t layers = 8;
  auto model = buildModel(spec("gpt", 256, layers), lmShape(500, 64));
  auto params = model->named_parameters();
  const double kStd = 0.02;
  EXPECT_NEAR(params["b0_embed.wte.weight"].std().item<double>(), kStd, 0.002);
  EXPECT_NEAR(params["b1_layer0.attn.c_attn.weight"].std().item<double>(), kStd, 0.002);
  EXPECT_NEAR(params["b1_layer0.mlp.c_proj.weight"].std().item<double>(),
              kStd / std::sqrt(2.0 * layers), 0.0005);
  EXPECT_NEAR(params["b1_layer0.attn.c_proj.weight"].std().item<double>(),
              kStd / std::sqrt(2.0 * layers), 0.0005);
  EXPECT_EQ(params["b1_layer0.attn.c_attn.bias"].abs().max().item<double>(), 0.0);
  EXPECT_EQ(params["b1_layer0.ln_1.weight"].min().item<double>(), 1.0);
}

TEST(ModelDeterminism, SameSeedSameParameters) {
  const std::vector<std::pair<ModelSpec, DataShape>> cases = {
      {spec("mlp"), imageShape()},
      {spec("cnn"), imageShape()},
      {spec("resnet-mini"), imageShape()},
      {spec("gpt", 32, 2), lmShape(20, 16)}};
  for (const auto& [s, shape] : cases) {
    SCOPED_TRACE(s.name);
    torch::manual_seed(42);
    auto a = buildModel(s, shape);
    torch::manual_seed(42);
    auto b = buildModel(s, shape);
    torch::manual_seed(43);
    auto c = buildModel(s, shape);
    auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
    ASSERT_EQ(pa.size(), pb.size());
    bool anyDiffers = false;
    for (const auto& item : pa) {
      EXPECT_TRUE(torch::equal(item.value(), pb[item.key()])) << item.key();
      anyDiffers = anyDiffers || !torch::equal(item.value(), pc[item.key()]);
    }
    EXPECT_TRUE(anyDiffers);
  }
}

// ---- config errors ---------------------------------------------------------------------------

void expectConfigError(const ModelSpec& s, const DataShape& shape,
                       const std::vector<std::string>& mentions) {
  try {
    buildModel(s, shape);
    ADD_FAILURE() << "no ConfigError for model.name = " << s.name;
  } catch (const ConfigError& e) {
    const std::string message = e.what();
    EXPECT_EQ(e.exitCode(), 2);
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const auto& m : mentions) {
      EXPECT_NE(message.find(m), std::string::npos) << "'" << m << "' not in: " << message;
    }
  }
}

TEST(ModelConfig, BadSpecsThrowConfigErrorNamingTheKey) {
  expectConfigError(spec("transformer"), imageShape(),
                    {"model.name", "transformer", "mlp, cnn, resnet-mini, gpt"});
  expectConfigError(spec("gpt", 128, 0, 3), lmShape(),
                    {"model.heads = 3", "model.width = 128", "divide"});
  expectConfigError(spec("gpt", 6), lmShape(), {"model.heads = 4 (the default)", "model.width"});
  expectConfigError(spec("gpt"), imageShape(), {"model.name = 'gpt'", "mlp, cnn, resnet-mini"});
  expectConfigError(spec("cnn"), lmShape(), {"model.name = 'cnn'", "gpt"});
  expectConfigError(spec("mlp", -5), imageShape(), {"model.width = -5"});
  expectConfigError(spec("resnet-mini", 0, -1), imageShape(), {"model.depth = -1"});
  expectConfigError(spec("gpt", 0, 0, -2), lmShape(), {"model.heads = -2"});
  expectConfigError(spec("mlp", 0, 0, 0, 1.0), imageShape(), {"model.dropout = 1"});
  expectConfigError(spec("gpt", 0, 0, 0, -0.1), lmShape(), {"model.dropout"});
  expectConfigError(spec("cnn", 0, 0, 4), imageShape(), {"model.heads"});
  expectConfigError(spec("cnn", 0, 3), imageShape(), {"model.depth"});
  expectConfigError(spec("resnet-mini", 0, 0, 0, 0.2), imageShape(), {"model.dropout"});
  expectConfigError(spec("cnn"), imageShape(1, 3), {"model.name = 'cnn'", "3x3"});
}

TEST(ModelGpt, AttentionKernelIsRefusedWhereThereIsNoAttention) {
  ModelSpec s = spec("cnn");
  s.attention = AttentionKernel::kSdpa;
  expectConfigError(s, imageShape(), {"model.attention = 'sdpa'", "model.name = 'cnn'"});
}

// ---- PyTorch reference -----------------------------------------------------------------------

using caravan::test::kPython;

// Builds the model in float64 with non-trivial batch-norm statistics, runs it in eval mode and
// backpropagates sum(out * w); dumps state, input, w, output and gradients for
// reference_models.py, which rebuilds the model in PyTorch, loads the state (strictly, so the
// parameter names must match) and compares.
void expectMatchesPyTorch(const ModelSpec& s, const DataShape& shape, torch::Tensor input) {
  torch::manual_seed(11);
  auto model = buildModel(s, shape);
  model->to(torch::kFloat64);
  {
    torch::NoGradGuard noGrad;
    for (const auto& item : model->named_buffers()) {
      if (item.value().is_floating_point()) item.value().uniform_(0.5, 1.5);
    }
  }
  model->eval();
  if (input.is_floating_point()) input = input.to(torch::kFloat64);
  auto out = model->forward(input);
  auto weights = torch::randn_like(out);
  (out * weights).sum().backward();

  c10::Dict<std::string, torch::Tensor> dump;
  for (const auto& item : model->named_parameters()) {
    dump.insert("state." + item.key(), item.value().detach());
    dump.insert("grad." + item.key(), item.value().grad());
  }
  for (const auto& item : model->named_buffers()) dump.insert("state." + item.key(), item.value());
  dump.insert("input", input);
  dump.insert("weights", weights);
  dump.insert("output", out.detach());
  const auto bytes = pickleForTorchLoad(dump);

  const auto path = std::filesystem::temp_directory_path() /
                    ("caravan_model_ref_" + s.name + "_" + std::to_string(::getpid()) + ".pt");
  {
    std::ofstream file(path, std::ios::binary);
    file.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const std::string command = fmt::format(
      "{} {}/tests/python/reference_models.py check {} --model {} --width {} --depth {} "
      "--heads {} --channels {} --height {} --image-width {} --classes {} --vocab {} --seq {}",
      kPython, CARAVAN_SOURCE_DIR, path.string(), s.name, s.width, s.depth, s.heads,
      shape.channels, shape.height, shape.width, shape.numClasses, shape.vocabSize,
      shape.seqLen);
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
  std::filesystem::remove(path);
}

TEST(ModelPyTorchReference, ForwardAndGradientsMatchPyTorch) {
  torch::manual_seed(12);
  expectMatchesPyTorch(spec("mlp", 32, 2), imageShape(1, 12, 5), torch::randn({3, 1, 12, 12}));
  expectMatchesPyTorch(spec("cnn", 6), imageShape(2, 12, 5), torch::randn({3, 2, 12, 12}));
  expectMatchesPyTorch(spec("resnet-mini", 4, 2), imageShape(3, 10, 5),
                       torch::randn({3, 3, 10, 10}));
  expectMatchesPyTorch(spec("gpt", 16, 2, 2), lmShape(11, 7),
                       torch::randint(11, {3, 7}, torch::kLong));
}

}  // namespace
}  // namespace caravan

namespace caravan {

// bf16 blocks (models/precision.h) against the same model in float32: outputs, parameters and
// gradients stay float32, the masters are untouched by forward, and the loss and gradients
// are float32's within bf16's rounding (8 bits of mantissa: about 0.4% per product).
TEST(Precision, Bf16BlocksKeepFloat32MastersGradientsAndOutputs) {
  test::EmulateBf16 emulated;  // where the CPU has no bf16 instructions
  for (const char* name : {"gpt", "cnn"}) {
    SCOPED_TRACE(name);
    const bool lm = std::string(name) == "gpt";
    const DataShape shape = lm ? lmShape(20, 32) : imageShape();
    const ModelSpec s = lm ? spec(name, 32, 2, 2) : spec(name, 8);
    torch::manual_seed(5);
    BlockModel f32 = buildModel(s, shape);
    torch::manual_seed(5);
    BlockModel b16 = buildModel(s, shape);
    for (size_t i = 0; i < b16->numBlocks(); ++i) b16->setBf16(i, true);
    for (size_t i = 0; i < b16->numBlocks(); ++i) EXPECT_TRUE(b16->bf16(i));
    const at::Tensor input = lm ? torch::randint(0, 20, {8, 32}) : torch::randn({8, 1, 28, 28});
    const at::Tensor target = lm ? torch::randint(0, 20, {8, 32}) : torch::randint(0, 10, {8});
    std::vector<at::Tensor> before;
    for (const auto& p : b16->parameters()) before.push_back(p.detach().clone());
    at::Tensor out32 = f32->forward(input), out16 = b16->forward(input);
    EXPECT_EQ(out16.scalar_type(), at::kFloat);
    at::Tensor l32 = f32->loss(out32, target), l16 = b16->loss(out16, target);
    l32.backward();
    l16.backward();
    EXPECT_NEAR(l16.item<double>(), l32.item<double>(), 0.01 * l32.item<double>());
    const auto p32 = f32->parameters(), p16 = b16->parameters();
    ASSERT_EQ(p32.size(), p16.size());
    for (size_t i = 0; i < p16.size(); ++i) {
      EXPECT_EQ(p16[i].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(p16[i], before[i])) << "forward changed parameter " << i;
      ASSERT_TRUE(p16[i].grad().defined()) << i;
      EXPECT_EQ(p16[i].grad().scalar_type(), at::kFloat);
      const double cosine =
          torch::cosine_similarity(p16[i].grad().flatten(), p32[i].grad().flatten(), 0)
              .item<double>();
      if (p32[i].grad().norm().item<double>() > 1e-6) EXPECT_GT(cosine, 0.98) << "parameter " << i;
    }
    // Back to float32: the same numbers as the float32 model.
    for (size_t i = 0; i < b16->numBlocks(); ++i) b16->setBf16(i, false);
    EXPECT_TRUE(at::equal(b16->forward(input), f32->forward(input)));
  }
}

}  // namespace caravan
