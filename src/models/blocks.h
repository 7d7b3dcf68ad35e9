// The blocks Caravan's models are made of (see models/model.h): each is one unit of the memory
// planner (keep / swap / recompute) and of pipeline partitioning, so each is a torch::nn module
// whose `forward` maps one tensor to one tensor and fits torch::nn::AnyModule.
//
// Parameter names are part of the checkpoint format (and of the torch.load export), so the
// names registered here must not change; tests/python/reference_models.py mirrors them.
// Initialization happens in the constructors and draws from the default generator.
// Threading: like any torch::nn module, a block is used by one thread at a time.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/pimpl.h>

#include "models/attention.h"

namespace caravan {

// ---- image models ------------------------------------------------------------------------

// mlp hidden layer: flatten + linear + relu (+ dropout).
// [B, ...] -> [B, outFeatures]; parameters "linear.{weight,bias}".
class MlpLayerImpl : public torch::nn::Module {
 public:
  MlpLayerImpl(int64_t inFeatures, int64_t outFeatures, double dropout);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Linear linear_{nullptr};
  double dropout_;
};
TORCH_MODULE(MlpLayer);

// Classifier head: flatten + linear. [B, ...] -> [B, outFeatures] logits;
// parameters "linear.{weight,bias}".
class LinearHeadImpl : public torch::nn::Module {
 public:
  LinearHeadImpl(int64_t inFeatures, int64_t outFeatures);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Linear linear_{nullptr};
};
TORCH_MODULE(LinearHead);

// cnn stage: conv k x k ("same" padding) + relu + 2x2 max pool.
// [B, inChannels, H, W] -> [B, outChannels, H/2, W/2]; parameters "conv.{weight,bias}".
class ConvStageImpl : public torch::nn::Module {
 public:
  ConvStageImpl(int64_t inChannels, int64_t outChannels, int64_t kernelSize);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Conv2d conv_{nullptr};
};
TORCH_MODULE(ConvStage);

// cnn head: flatten + linear + relu + linear. [B, ...] -> [B, numClasses] logits;
// parameters "fc1.{weight,bias}", "fc2.{weight,bias}".
class MlpHeadImpl : public torch::nn::Module {
 public:
  MlpHeadImpl(int64_t inFeatures, int64_t hidden, int64_t numClasses);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Linear fc1_{nullptr};
  torch::nn::Linear fc2_{nullptr};
};
TORCH_MODULE(MlpHead);

// resnet stem: conv 3x3 (no bias) + batch norm + relu.
// [B, inChannels, H, W] -> [B, outChannels, H, W]; parameters "conv.weight", "bn.*".
class ConvBnReluImpl : public torch::nn::Module {
 public:
  ConvBnReluImpl(int64_t inChannels, int64_t outChannels);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Conv2d conv_{nullptr};
  torch::nn::BatchNorm2d bn_{nullptr};
};
TORCH_MODULE(ConvBnRelu);

// ResNet basic block: relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x)), convs 3x3 without
// bias; the shortcut is identity, or 1x1 conv (stride `stride`) + batch norm when the shape
// changes. [B, inChannels, H, W] -> [B, outChannels, ceil(H/stride), ceil(W/stride)];
// parameters "conv1", "bn1", "conv2", "bn2" and, with a projection, "shortcut_conv",
// "shortcut_bn".
class BasicBlockImpl : public torch::nn::Module {
 public:
  BasicBlockImpl(int64_t inChannels, int64_t outChannels, int64_t stride);
  torch::Tensor forward(torch::Tensor x);
  bool hasProjection() const { return !shortcutConv_.is_empty(); }

 private:
  torch::nn::Conv2d conv1_{nullptr};
  torch::nn::BatchNorm2d bn1_{nullptr};
  torch::nn::Conv2d conv2_{nullptr};
  torch::nn::BatchNorm2d bn2_{nullptr};
  torch::nn::Conv2d shortcutConv_{nullptr};
  torch::nn::BatchNorm2d shortcutBn_{nullptr};
  int64_t stride_;
};
TORCH_MODULE(BasicBlock);

// resnet head: global average pool + linear. [B, C, H, W] -> [B, numClasses] logits;
// parameters "linear.{weight,bias}".
class PoolLinearHeadImpl : public torch::nn::Module {
 public:
  PoolLinearHeadImpl(int64_t channels, int64_t numClasses);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Linear linear_{nullptr};
};
TORCH_MODULE(PoolLinearHead);

// ---- gpt (decoder-only transformer, pre-LayerNorm, GPT-2 style) ----------------------------

struct GptOptions {
  int64_t vocabSize = 0;
  int64_t context = 0;  // maximum sequence length T (position embeddings, causal mask)
  int64_t width = 0;    // d_model
  int64_t heads = 1;    // must divide width
  int64_t layers = 1;   // transformer blocks in the model (scales residual-projection init)
  double dropout = 0.0;
  AttentionKernel attention = AttentionKernel::kExplicit;
};

// GPT-2 initialization std for Linear and Embedding weights.
constexpr double kGptInitStd = 0.02;

// Token embedding + learned position embedding + dropout.
// [B, T] int64 token ids (T <= context) -> [B, T, width]; parameters "wte.weight"
// [vocab, width], "wpe.weight" [context, width].
class TokenEmbeddingImpl : public torch::nn::Module {
 public:
  explicit TokenEmbeddingImpl(const GptOptions& options);
  torch::Tensor forward(torch::Tensor tokens);

 private:
  torch::nn::Embedding wte_{nullptr};
  torch::nn::Embedding wpe_{nullptr};
  double dropout_;
};
TORCH_MODULE(TokenEmbedding);

// Causal multi-head self-attention: fused qkv projection, softmax(q k^T / sqrt(hd)) with a
// causal mask, dropout on the attention weights, output projection, dropout.
// [B, T, width] -> [B, T, width]; parameters "c_attn" (width -> 3 width), "c_proj".
class CausalSelfAttentionImpl : public torch::nn::Module {
 public:
  explicit CausalSelfAttentionImpl(const GptOptions& options);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Linear cAttn_{nullptr};
  torch::nn::Linear cProj_{nullptr};
  int64_t context_;
  int64_t heads_;
  double dropout_;
  AttentionKernel attention_;
};
TORCH_MODULE(CausalSelfAttention);

// Transformer feed-forward: linear width -> 4 width, GELU (exact), linear back, dropout.
// [B, T, width] -> [B, T, width]; parameters "c_fc", "c_proj".
class GptMlpImpl : public torch::nn::Module {
 public:
  explicit GptMlpImpl(const GptOptions& options);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::Linear cFc_{nullptr};
  torch::nn::Linear cProj_{nullptr};
  double dropout_;
};
TORCH_MODULE(GptMlp);

// Pre-LN transformer block: x + attn(ln_1(x)), then + mlp(ln_2(x)).
// [B, T, width] -> [B, T, width]; parameters "ln_1", "attn.*", "ln_2", "mlp.*".
class TransformerBlockImpl : public torch::nn::Module {
 public:
  explicit TransformerBlockImpl(const GptOptions& options);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::LayerNorm ln1_{nullptr};
  CausalSelfAttention attn_{nullptr};
  torch::nn::LayerNorm ln2_{nullptr};
  GptMlp mlp_{nullptr};
};
TORCH_MODULE(TransformerBlock);

// Final LayerNorm + linear to the vocabulary (not tied to the token embedding, so the two can
// live in different pipeline stages). [B, T, width] -> [B, T, vocab] logits;
// parameters "ln_f", "lm_head".
class LmHeadImpl : public torch::nn::Module {
 public:
  explicit LmHeadImpl(const GptOptions& options);
  torch::Tensor forward(torch::Tensor x);

 private:
  torch::nn::LayerNorm lnF_{nullptr};
  torch::nn::Linear lmHead_{nullptr};
};
TORCH_MODULE(LmHead);

}  // namespace caravan
