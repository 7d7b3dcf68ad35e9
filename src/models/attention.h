// Which kernel gpt's attention runs (model.attention); models/blocks.cpp implements both.
#pragma once

namespace caravan {

// gpt's attention kernel (model.attention). kExplicit: scores = q k^T (one baddbmm with the
// causal mask), softmax, times v; it keeps the [T, T] probabilities for backward. kSdpa:
// at::scaled_dot_product_attention, the fused kernel PyTorch 2.x models call; it keeps only a
// row statistic (without dropout: with model.dropout > 0 LibTorch 2.13 takes its unfused path on
// the CPU, which keeps the probabilities and the dropout mask). Measured (bench/attention.py,
// bench/README.md "Attention"): at brown-gpt's 128 tokens the explicit kernel is faster in float32
// and much faster in bf16; sdpa is faster in float32 at 1024 tokens and holds far less for
// backward.
enum class AttentionKernel { kExplicit, kSdpa };

}  // namespace caravan
