#!/usr/bin/env python3
"""A GPT written in plain PyTorch, scripted for Caravan (model.name = "torchscript").

    .venv/bin/python examples/gpt_tokens.py OUT.pt [VOCAB] [CONTEXT]   (default 256, 128)

Its forward is its `layers` (an nn.Sequential) applied in order, so examples/gpt_tokens.toml
names them in model.blocks and each transformer block is a Caravan block (memory policies,
out-of-core weights). Needs the project's Python, .venv/bin/python (torch 2.13, made by
scripts/setup.sh).
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class Embed(nn.Module):
    def __init__(self, vocab: int, context: int, width: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, width]
        t = ids.size(1)
        return self.tokens(ids) + self.positions(torch.arange(t, device=ids.device))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.size(0), x.size(1), x.size(2)
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = F.softmax(att.masked_fill(future, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class Gpt(nn.Module):
    def __init__(self, vocab: int = 256, context: int = 128, width: int = 128, depth: int = 4,
                 heads: int = 4):
        super().__init__()
        blocks = [Embed(vocab, context, width)] + [Block(width, heads) for _ in range(depth)]
        self.layers = nn.Sequential(*blocks, nn.LayerNorm(width), nn.Linear(width, vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [B, T] -> [B, T, vocab]
        return self.layers(ids)


if __name__ == "__main__":
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    context = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    torch.manual_seed(0)
    torch.jit.script(Gpt(vocab, context)).save(sys.argv[1])
