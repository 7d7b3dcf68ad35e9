#!/usr/bin/env python3
"""Small models written with today's PyTorch (2.x) idioms, for the TodaysPyTorch oracle tests
(tests/test_oracle.cpp): Caravan trains the scripted file, the oracle (oracle_train.py with
"eager_class") trains the same class here in eager PyTorch, and the losses must agree.

Each treats a Fashion-MNIST image [B, 1, 28, 28] as a sequence of 28 rows of 28 features:
Linear(28, 32), one pre-norm residual block built around the construct, the mean over the
sequence, Linear(32, 10). Classes (constructible without arguments, as the oracle builds them):

  CausalSdpa         F.scaled_dot_product_attention(q, k, v, is_causal=True), no dropout
  CausalSdpaDropout  the same with dropout_p=0.1 while training (the RNG draws matter)
  RmsNormMlp         nn.RMSNorm as the block's norm (a ReLU MLP after it)
  SwiGluMlp          w2(silu(w1 x) * w3 x), bias=False (Llama's feed-forward)
  RotaryAttention    Llama's rotary position embeddings (real rotate_half form, cos/sin
                     computed in forward) on q and k, then causal SDPA
  TorchMha           nn.MultiheadAttention(batch_first=True) with a boolean causal attn_mask
  GeluTanhMlp        an MLP with nn.GELU(approximate="tanh")
  TiedLayers         not one block but three residual MLP layers in an nn.ModuleList, the
                     third using the first's Linear (cross-layer tying, as ALBERT does: one
                     module under two names, both in its state_dict)

A key bias (nn.MultiheadAttention's default in_proj_bias; qkv Linear with bias) adds the same
q.b to every score of a query, which softmax ignores: its gradient is rounding noise (~1e-10),
which AdamW (eps 1e-8) turns into steps of up to ~lr/50, so two correct runs one ulp apart end
with key biases ~1e-4 apart (eager PyTorch against itself shows it) and no final-parameter
comparison could pass. So SdpaSelfAttention has no biases in qkv (as Llama, and nanoGPT with
bias=False), and TorchMha keeps nn.MultiheadAttention's default bias=True but its test trains
with SGD (steps proportional to the gradient). nn.MultiheadAttention(bias=False) does not
script in torch 2.13 ("'NoneType' object has no attribute or method 'dtype'" at
`self.in_proj_bias.dtype` in its forward's fast-path check).

Usage: todays_models.py OUT_DIR writes torch.jit.script(Class()).save(OUT_DIR/<name>.pt) for
each (every one scripts: no torch.jit.trace needed), from torch.manual_seed(0) per model.
Needs the project's Python: run with .venv/bin/python (torch 2.13, scripts/setup.sh).
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

ROWS = 28      # an image's rows: the sequence; also its columns: the features of a row
WIDTH = 32     # d
HEADS = 2
CLASSES = 10


class PreNormClassifier(nn.Module):
    """x.view(B, 28, 28) -> embed -> h + mixer(norm(h)) -> mean over rows -> head."""

    def __init__(self, mixer: nn.Module, norm: nn.Module):
        super().__init__()
        self.rows = ROWS
        self.embed = nn.Linear(ROWS, WIDTH)
        self.norm = norm
        self.mixer = mixer
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(x.size(0), self.rows, self.rows))
        h = h + self.mixer(self.norm(h))
        return self.head(h.mean(1))


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, T, C] -> [B, heads, T, C / heads]."""
    return t.view(t.size(0), t.size(1), heads, t.size(2) // heads).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """[B, heads, T, hd] -> [B, T, heads * hd]."""
    return t.transpose(1, 2).reshape(t.size(0), t.size(2), t.size(1) * t.size(3))


class SdpaSelfAttention(nn.Module):
    """nanoGPT-style causal self-attention through F.scaled_dot_product_attention (q, k and v
    without bias: see the module's docstring)."""

    def __init__(self, dropout: float):
        super().__init__()
        self.width = WIDTH
        self.heads = HEADS
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH, bias=False)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.dropout = dropout

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(h).split(self.width, dim=2)
        y = F.scaled_dot_product_attention(
            split_heads(q, self.heads), split_heads(k, self.heads), split_heads(v, self.heads),
            dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(merge_heads(y))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Llama's rotate_half: (x1, x2) -> (-x2, x1) over the last dimension's halves."""
    x1 = x[..., : x.size(-1) // 2]
    x2 = x[..., x.size(-1) // 2:]
    return torch.cat((-x2, x1), dim=-1)


class RotarySelfAttention(nn.Module):
    """Llama's attention: q, k, v, o without bias; rotary embeddings on q and k (cos and sin
    computed in forward, as LlamaRotaryEmbedding does from inv_freq); causal SDPA."""

    def __init__(self, base: float = 10000.0):
        super().__init__()
        self.q_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.o_proj = nn.Linear(WIDTH, WIDTH, bias=False)
        self.heads = HEADS
        self.base = base

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q = split_heads(self.q_proj(h), self.heads)
        k = split_heads(self.k_proj(h), self.heads)
        v = split_heads(self.v_proj(h), self.heads)
        head_dim = q.size(-1)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=torch.float32,
                                                     device=h.device) / head_dim))
        positions = torch.arange(h.size(1), dtype=torch.float32, device=h.device)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
        cos = emb.cos()[None, None, :, :]
        sin = emb.sin()[None, None, :, :]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(merge_heads(y))


class CausalMha(nn.Module):
    """nn.MultiheadAttention(batch_first=True) over the rows with a boolean causal mask
    (True: not allowed to attend), need_weights=False (its SDPA path); its default bias=True
    (see the module's docstring on the key bias)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        t = h.size(1)
        mask = torch.ones(t, t, dtype=torch.bool, device=h.device).triu(1)
        return self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]


class SwiGlu(nn.Module):
    """Llama's feed-forward: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.w1 = nn.Linear(WIDTH, hidden, bias=False)
        self.w2 = nn.Linear(hidden, WIDTH, bias=False)
        self.w3 = nn.Linear(WIDTH, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def mlp(activation: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), activation, nn.Linear(4 * WIDTH, WIDTH))


class CausalSdpa(PreNormClassifier):
    def __init__(self):
        super().__init__(SdpaSelfAttention(0.0), nn.LayerNorm(WIDTH))


class CausalSdpaDropout(PreNormClassifier):
    def __init__(self):
        super().__init__(SdpaSelfAttention(0.1), nn.LayerNorm(WIDTH))


class RmsNormMlp(PreNormClassifier):
    def __init__(self):
        super().__init__(mlp(nn.ReLU()), nn.RMSNorm(WIDTH))


class SwiGluMlp(PreNormClassifier):
    def __init__(self):
        super().__init__(SwiGlu(), nn.LayerNorm(WIDTH))


class RotaryAttention(PreNormClassifier):
    def __init__(self):
        super().__init__(RotarySelfAttention(), nn.LayerNorm(WIDTH))


class TorchMha(PreNormClassifier):
    def __init__(self):
        super().__init__(CausalMha(), nn.LayerNorm(WIDTH))


class GeluTanhMlp(PreNormClassifier):
    def __init__(self):
        super().__init__(mlp(nn.GELU(approximate="tanh")), nn.LayerNorm(WIDTH))


# The file each class is written to (OUT_DIR/<name>.pt).


class ResidualMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.relu(self.fc(self.norm(h)))


class TiedLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.rows = ROWS
        self.embed = nn.Linear(ROWS, WIDTH)
        self.layers = nn.ModuleList([ResidualMlp() for _ in range(3)])
        self.layers[2].fc = self.layers[0].fc  # tied
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x.view(x.size(0), self.rows, self.rows))
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


MODELS = {
    "causal-sdpa": CausalSdpa,
    "causal-sdpa-dropout": CausalSdpaDropout,
    "rmsnorm": RmsNormMlp,
    "swiglu": SwiGluMlp,
    "rotary": RotaryAttention,
    "mha": TorchMha,
    "gelu-tanh": GeluTanhMlp,
    "tied-layers": TiedLayers,
}


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    for name, cls in MODELS.items():
        torch.manual_seed(0)
        torch.jit.script(cls()).save(os.path.join(out_dir, name + ".pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
