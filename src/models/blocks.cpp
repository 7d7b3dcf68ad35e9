// The block modules of models/blocks.h.
#include "models/blocks.h"

#include <cmath>
#include <limits>

#include <torch/nn/init.h>

#include "core/errors.h"

namespace caravan {
namespace {

namespace nn = torch::nn;

// Dropout that costs nothing when it is off (p = 0 or eval mode).
torch::Tensor maybeDropout(const torch::Tensor& x, double p, bool training) {
  return (p > 0.0 && training) ? torch::dropout(x, p, /*train=*/true) : x;
}

nn::Conv2d conv3x3(int64_t in, int64_t out, int64_t stride) {
  return nn::Conv2d(nn::Conv2dOptions(in, out, 3).stride(stride).padding(1).bias(false));
}

// x in channels-last layout ([B, C, H, W] sizes, channels the fastest dimension), the layout in
// which oneDNN convolves without reordering and max_pool2d runs vectorized. With one channel
// both layouts are the same memory and LibTorch reads the strides as the default layout, so
// the channels-last strides are set explicitly.
torch::Tensor channelsLast(const torch::Tensor& x) {
  if (x.dim() != 4) return x;
  if (x.size(1) != 1) return x.contiguous(torch::MemoryFormat::ChannelsLast);
  auto c = x.contiguous();
  return c.as_strided(c.sizes(), {c.size(2) * c.size(3), 1, c.size(3), 1});
}

// torchvision's ResNet initialization for convolutions followed by batch norm + relu.
void kaimingFanOut(nn::Conv2d& conv) {
  nn::init::kaiming_normal_(conv->weight, 0.0, torch::kFanOut, torch::kReLU);
}

// GPT-2: weights ~ N(0, std^2), zero bias.
void gptInit(nn::Linear& linear, double stdDev) {
  nn::init::normal_(linear->weight, 0.0, stdDev);
  nn::init::zeros_(linear->bias);
}

// x [..., in] through `layer` as PyTorch's nn.Linear does: ATen's linear, which folds a
// contiguous [B, T, in] into one addmm with the bias. The C++ frontend's Linear::forward
// (torch/nn/functional/linear.h) does that only for two dimensions; on [B, T, in] it multiplies
// and then adds the bias in a second pass over the output, and its backward sums the bias's
// gradient apart: 8 ms of brown-gpt's 260 ms bf16 step, and its products 7 ms slower
// (bench/README.md, "Against autocast, op by op").
torch::Tensor applyLinear(const nn::Linear& layer, const torch::Tensor& x) {
  return torch::linear(x, layer->weight, layer->bias);
}

}  // namespace

// ---- image models ------------------------------------------------------------------------

MlpLayerImpl::MlpLayerImpl(int64_t inFeatures, int64_t outFeatures, double dropout)
    : linear_(register_module("linear", nn::Linear(inFeatures, outFeatures))),
      dropout_(dropout) {}

torch::Tensor MlpLayerImpl::forward(torch::Tensor x) {
  auto h = linear_(x.flatten(1)).relu_();  // [B, out]; in place: addmm keeps no output
  return maybeDropout(h, dropout_, is_training());
}

LinearHeadImpl::LinearHeadImpl(int64_t inFeatures, int64_t outFeatures)
    : linear_(register_module("linear", nn::Linear(inFeatures, outFeatures))) {}

torch::Tensor LinearHeadImpl::forward(torch::Tensor x) {
  return linear_(x.flatten(1));  // [B, out]
}

ConvStageImpl::ConvStageImpl(int64_t inChannels, int64_t outChannels, int64_t kernelSize)
    : conv_(register_module(
          "conv", nn::Conv2d(nn::Conv2dOptions(inChannels, outChannels, kernelSize)
                                 .padding(kernelSize / 2)))) {
  CARAVAN_CHECK(kernelSize % 2 == 1, "kernel size {} must be odd for same padding", kernelSize);
}

torch::Tensor ConvStageImpl::forward(torch::Tensor x) {
  x = channelsLast(x);
  auto h = conv_(x).relu_();  // [B, out, H, W]; conv backward needs input, not output
  return torch::max_pool2d(h, 2);   // [B, out, H/2, W/2]
}

MlpHeadImpl::MlpHeadImpl(int64_t inFeatures, int64_t hidden, int64_t numClasses)
    : fc1_(register_module("fc1", nn::Linear(inFeatures, hidden))),
      fc2_(register_module("fc2", nn::Linear(hidden, numClasses))) {}

torch::Tensor MlpHeadImpl::forward(torch::Tensor x) {
  auto h = fc1_(x.flatten(1)).relu_();  // [B, hidden]
  return fc2_(h);                             // [B, classes]
}

ConvBnReluImpl::ConvBnReluImpl(int64_t inChannels, int64_t outChannels)
    : conv_(register_module("conv", conv3x3(inChannels, outChannels, 1))),
      bn_(register_module("bn", nn::BatchNorm2d(outChannels))) {
  kaimingFanOut(conv_);
}

torch::Tensor ConvBnReluImpl::forward(torch::Tensor x) {
  x = channelsLast(x);
  return bn_(conv_(x)).relu_();  // [B, out, H, W]; bn backward needs input, not output
}

BasicBlockImpl::BasicBlockImpl(int64_t inChannels, int64_t outChannels, int64_t stride)
    : conv1_(register_module("conv1", conv3x3(inChannels, outChannels, stride))),
      bn1_(register_module("bn1", nn::BatchNorm2d(outChannels))),
      conv2_(register_module("conv2", conv3x3(outChannels, outChannels, 1))),
      bn2_(register_module("bn2", nn::BatchNorm2d(outChannels))),
      stride_(stride) {
  kaimingFanOut(conv1_);
  kaimingFanOut(conv2_);
  if (stride != 1 || inChannels != outChannels) {
    // Stride 1: the stride is taken by subsampling the input in forward (see there).
    shortcutConv_ = register_module(
        "shortcut_conv", nn::Conv2d(nn::Conv2dOptions(inChannels, outChannels, 1).bias(false)));
    shortcutBn_ = register_module("shortcut_bn", nn::BatchNorm2d(outChannels));
    kaimingFanOut(shortcutConv_);
  }
}

torch::Tensor BasicBlockImpl::forward(torch::Tensor x) {
  x = channelsLast(x);
  auto h = bn1_(conv1_(x)).relu_();  // [B, out, Ho, Wo]
  h = bn2_(conv2_(h));                     // [B, out, Ho, Wo]
  // The 1x1 projection with stride s is the unit-stride 1x1 convolution of every s-th pixel
  // (the same products). Taken that way because oneDNN's channels-last backward of a strided
  // 1x1 convolution corrupts the heap on CPUs without AVX-512 when the input has fewer than 8
  // channels (LibTorch 2.13; eager PyTorch crashes the same way, tests/test_models.cpp
  // ResnetBlocks.StridedProjectionFromFewChannels...).
  auto shortcut = x;
  if (hasProjection()) {
    auto sub =
        stride_ == 1 ? x : x.slice(2, 0, c10::nullopt, stride_).slice(3, 0, c10::nullopt, stride_);
    shortcut = shortcutBn_(shortcutConv_(sub));  // [B, out, Ho, Wo]
  }
  return h.add_(shortcut).relu_();  // in place, as torchvision: bn keeps no output
}

PoolLinearHeadImpl::PoolLinearHeadImpl(int64_t channels, int64_t numClasses)
    : linear_(register_module("linear", nn::Linear(channels, numClasses))) {}

torch::Tensor PoolLinearHeadImpl::forward(torch::Tensor x) {
  return linear_(x.mean({2, 3}));  // [B, C, H, W] -> [B, C] -> [B, classes]
}

// ---- gpt ---------------------------------------------------------------------------------

TokenEmbeddingImpl::TokenEmbeddingImpl(const GptOptions& options)
    : wte_(register_module("wte", nn::Embedding(options.vocabSize, options.width))),
      wpe_(register_module("wpe", nn::Embedding(options.context, options.width))),
      dropout_(options.dropout) {
  nn::init::normal_(wte_->weight, 0.0, kGptInitStd);
  nn::init::normal_(wpe_->weight, 0.0, kGptInitStd);
}

torch::Tensor TokenEmbeddingImpl::forward(torch::Tensor tokens) {
  CARAVAN_CHECK(tokens.dim() == 2 && tokens.size(1) <= wpe_->weight.size(0),
                "expected [B, T<={}] token ids, got {}", wpe_->weight.size(0),
                static_cast<int64_t>(tokens.dim()));
  const int64_t steps = tokens.size(1);
  auto positions = wpe_->weight.narrow(0, 0, steps);  // [T, d]
  auto h = wte_(tokens) + positions;                  // [B, T, d]
  return maybeDropout(h, dropout_, is_training());
}

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GptOptions& options)
    : cAttn_(register_module("c_attn", nn::Linear(options.width, 3 * options.width))),
      cProj_(register_module("c_proj", nn::Linear(options.width, options.width))),
      context_(options.context),
      heads_(options.heads),
      dropout_(options.dropout),
      attention_(options.attention) {
  CARAVAN_CHECK(options.heads > 0 && options.width % options.heads == 0,
                "heads {} must divide width {}", options.heads, options.width);
  gptInit(cAttn_, kGptInitStd);
  gptInit(cProj_, kGptInitStd / std::sqrt(2.0 * static_cast<double>(options.layers)));
}

torch::Tensor CausalSelfAttentionImpl::forward(torch::Tensor x) {
  const int64_t batch = x.size(0), steps = x.size(1), width = x.size(2);
  const int64_t headDim = width / heads_;
  CARAVAN_CHECK_LE(steps, context_, "the sequence length exceeds the context");

  auto qkv = applyLinear(cAttn_, x)                         // [B, T, 3d]
                 .view({batch, steps, 3, heads_, headDim})  // [B, T, 3, H, hd]
                 .permute({2, 0, 3, 1, 4});                 // [3, B, H, T, hd]
  torch::Tensor y;                                          // [B, H, T, hd]
  if (attention_ == AttentionKernel::kSdpa) {
    // q, k and v as strided views (the kernel reads them in place); the fused kernel applies
    // the causal mask, the scale 1/sqrt(hd) and the dropout on the probabilities.
    y = at::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], /*attn_mask=*/{},
                                         is_training() ? dropout_ : 0.0, /*is_causal=*/true);
  } else {
    // One copy puts q, k and v each in contiguous [B*H, T, hd] layout for bmm.
    const auto packed = qkv.contiguous().view({3, batch * heads_, steps, headDim});
    const auto q = packed[0], k = packed[1], v = packed[2];  // [B*H, T, hd]
    const double scale = 1.0 / std::sqrt(static_cast<double>(headDim));
    // Made for this length, [T, T]: -inf above the diagonal (future positions), 0 elsewhere;
    // one head's scores, where a [context, context] mask kept per layer grew as context^2
    // before the first step (17 GB at a context of 65536). baddbmm adds it and scales q k^T in
    // one pass (the scores were scaled and masked in two more passes over [B*H, T, T], ~10% of
    // brown-gpt's step: bench/README.md, "Two threads").
    const auto future = torch::full({steps, steps}, -std::numeric_limits<double>::infinity(),
                                    torch::TensorOptions(q.scalar_type()).device(x.device()))
                            .triu_(1);
    auto att = torch::baddbmm(future, q, k.transpose(1, 2), /*beta=*/1.0, /*alpha=*/scale);
    att = maybeDropout(torch::softmax(att, -1), dropout_, is_training());  // [B*H, T, T]
    y = torch::bmm(att, v).view({batch, heads_, steps, headDim});
  }
  y = y.transpose(1, 2).reshape({batch, steps, width});  // [B, T, d]
  return maybeDropout(applyLinear(cProj_, y), dropout_, is_training());
}

GptMlpImpl::GptMlpImpl(const GptOptions& options)
    : cFc_(register_module("c_fc", nn::Linear(options.width, 4 * options.width))),
      cProj_(register_module("c_proj", nn::Linear(4 * options.width, options.width))),
      dropout_(options.dropout) {
  gptInit(cFc_, kGptInitStd);
  gptInit(cProj_, kGptInitStd / std::sqrt(2.0 * static_cast<double>(options.layers)));
}

torch::Tensor GptMlpImpl::forward(torch::Tensor x) {
  auto h = torch::gelu(applyLinear(cFc_, x));                            // [B, T, 4d]
  return maybeDropout(applyLinear(cProj_, h), dropout_, is_training());  // [B, T, d]
}

TransformerBlockImpl::TransformerBlockImpl(const GptOptions& options)
    : ln1_(register_module("ln_1", nn::LayerNorm(nn::LayerNormOptions({options.width})))),
      attn_(register_module("attn", CausalSelfAttention(options))),
      ln2_(register_module("ln_2", nn::LayerNorm(nn::LayerNormOptions({options.width})))),
      mlp_(register_module("mlp", GptMlp(options))) {}

torch::Tensor TransformerBlockImpl::forward(torch::Tensor x) {
  x = x + attn_(ln1_(x));    // [B, T, d]; not in place: ln_1 keeps x for its backward
  return x + mlp_(ln2_(x));  // [B, T, d]
}

LmHeadImpl::LmHeadImpl(const GptOptions& options)
    : lnF_(register_module("ln_f", nn::LayerNorm(nn::LayerNormOptions({options.width})))),
      lmHead_(register_module("lm_head", nn::Linear(options.width, options.vocabSize))) {
  gptInit(lmHead_, kGptInitStd);
}

torch::Tensor LmHeadImpl::forward(torch::Tensor x) {
  return applyLinear(lmHead_, lnF_(x));  // [B, T, d] -> [B, T, vocab]
}

}  // namespace caravan
