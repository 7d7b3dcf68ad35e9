#!/usr/bin/env python3
"""A small vision transformer written in plain PyTorch, scripted for Caravan (model.name =
"torchscript"), for Fashion-MNIST.

    .venv/bin/python examples/vit_fashion_mnist.py OUT.pt

Input [B, 1, 28, 28] (Caravan's loader normalizes the pixels), output [B, 10] logits. A small
convolutional stem (two 3x3 stride-2 convolutions, "early convolutions" in place of ViT's
patchify layer) turns the image into a 7x7 grid of 49 tokens of WIDTH features, one per 4x4
patch, and adds a learned position embedding that starts as 2-D sine-cosine features; DEPTH
pre-norm transformer blocks with full (unmasked) self-attention follow, then a head that
averages the tokens and classifies.

Its forward is its `layers` (an nn.Sequential) applied in order, so
examples/vit_fashion_mnist.toml names them in model.blocks and each transformer block is a
Caravan block (memory policies, out-of-core weights). Needs the project's Python,
.venv/bin/python (torch 2.13, made by scripts/setup.sh).
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

WIDTH = 64  # features per token
DEPTH = 4  # transformer blocks
HEADS = 4  # attention heads
MLP = 2  # MLP hidden units per feature
STEM = 32  # channels of the stem's first convolution


def sincos_positions(width: int, side: int) -> torch.Tensor:
    """[1, side * side, width]: 2-D sine-cosine features of each token's row and column."""
    quarter = width // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter)
    rows, cols = torch.meshgrid(torch.arange(side, dtype=torch.float32),
                                torch.arange(side, dtype=torch.float32), indexing="ij")
    x = cols.flatten()[:, None] * omega[None]
    y = rows.flatten()[:, None] * omega[None]
    return torch.cat([x.sin(), x.cos(), y.sin(), y.cos()], dim=1)[None]


class PatchEmbed(nn.Module):
    def __init__(self, width: int, stem: int, side: int = 7):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(1, stem, 3, stride=2, padding=1), nn.GELU(),  # 28x28 -> 14x14
            nn.Conv2d(stem, width, 3, stride=2, padding=1))  # 14x14 -> 7x7
        # Learned, but starting from sine-cosine positions: 5 epochs are too few to learn them
        # from noise (about 1 point of test accuracy at epochs 2-3).
        self.positions = nn.Parameter(sincos_positions(width, side))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, 28, 28] -> [B, 49, width]
        return self.stem(x).flatten(2).transpose(1, 2) + self.positions


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, mlp * width), nn.GELU(),
                                 nn.Linear(mlp * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, width] -> [B, T, width]
        b, t, d = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, width: int, classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, width] -> [B, classes]
        return self.out(self.norm(x).mean(dim=1))


class Vit(nn.Module):
    def __init__(self, width: int = WIDTH, depth: int = DEPTH, heads: int = HEADS,
                 mlp: int = MLP, stem: int = STEM, classes: int = 10):
        super().__init__()
        blocks = [PatchEmbed(width, stem)] + [Block(width, heads, mlp) for _ in range(depth)]
        self.layers = nn.Sequential(*blocks, Head(width, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, 1, 28, 28] -> [B, 10]
        return self.layers(x)


if __name__ == "__main__":
    torch.manual_seed(0)
    torch.jit.script(Vit()).save(sys.argv[1])
