#!/usr/bin/env python3
"""PyTorch twins of Caravan's models (src/models/): same blocks, same parameter names.

Two uses:
  * tests/test_models.cpp (ModelPyTorchReference) dumps a C++ model's state, an input and the
    C++ output and gradients; `reference_models.py check DUMP --model ...` rebuilds the model
    here, loads the state strictly (so parameter names must match), and compares.
  * a benchmark can `build(...)` the same model in Python PyTorch.

Needs the project's Python: run with .venv/bin/python (torch 2.13, made by scripts/setup.sh).
Written independently of the C++ code from the model descriptions, so a mismatch points at a
bug on one side.
"""
import argparse
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


def channels_last(x):
    """x ([B, C, H, W]) with channels the fastest dimension, as Caravan's convolution blocks run
    (src/models/blocks.cpp): the layout in which oneDNN convolves without reordering and
    max_pool2d is vectorized. With one channel both layouts are the same memory and
    `contiguous(memory_format=torch.channels_last)` leaves the default strides, so they are set
    explicitly, as Caravan does."""
    if x.dim() != 4:
        return x
    if x.size(1) != 1:
        return x.contiguous(memory_format=torch.channels_last)
    x = x.contiguous()
    return x.as_strided(x.shape, (x.size(2) * x.size(3), 1, x.size(3), 1))


# ---- blocks (names of attributes = C++ registered names) -------------------------------------

class MlpLayer(nn.Module):
    def __init__(self, inputs, outputs, dropout):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)
        self.dropout = dropout

    def forward(self, x):
        return F.dropout(F.relu(self.linear(x.flatten(1))), self.dropout, self.training)


class LinearHead(nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.linear = nn.Linear(inputs, outputs)

    def forward(self, x):
        return self.linear(x.flatten(1))


class ConvStage(nn.Module):
    def __init__(self, inputs, outputs, kernel):
        super().__init__()
        self.conv = nn.Conv2d(inputs, outputs, kernel, padding=kernel // 2)

    def forward(self, x):
        # In place, as Caravan's ConvStage (relu_): the same ops, so timing compares engines.
        return F.max_pool2d(F.relu(self.conv(x), inplace=True), 2)


class MlpHead(nn.Module):
    def __init__(self, inputs, hidden, classes):
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1)), inplace=True))  # as MlpHead's relu_


class ConvBnRelu(nn.Module):
    def __init__(self, inputs, outputs):
        super().__init__()
        self.conv = nn.Conv2d(inputs, outputs, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(outputs)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class BasicBlock(nn.Module):
    def __init__(self, inputs, outputs, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.projection = stride != 1 or inputs != outputs
        if self.projection:
            self.shortcut_conv = nn.Conv2d(inputs, outputs, 1, stride=stride, bias=False)
            self.shortcut_bn = nn.BatchNorm2d(outputs)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        shortcut = self.shortcut_bn(self.shortcut_conv(x)) if self.projection else x
        return F.relu(h + shortcut)


class PoolLinearHead(nn.Module):
    def __init__(self, channels, classes):
        super().__init__()
        self.linear = nn.Linear(channels, classes)

    def forward(self, x):
        return self.linear(F.adaptive_avg_pool2d(x, 1).flatten(1))


class TokenEmbedding(nn.Module):
    def __init__(self, vocab, context, width, dropout):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.dropout = dropout

    def forward(self, tokens):
        positions = torch.arange(tokens.size(1), device=tokens.device)
        return F.dropout(self.wte(tokens) + self.wpe(positions), self.dropout, self.training)


class CausalSelfAttention(nn.Module):
    def __init__(self, context, width, heads, dropout):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)
        self.c_proj = nn.Linear(width, width)
        self.heads = heads
        self.dropout = dropout
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q = q.view(b, t, self.heads, d // self.heads).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, d // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # [B, H, T, T]
        att = att.masked_fill(~self.mask[:t, :t], float("-inf"))
        att = F.dropout(F.softmax(att, dim=-1), self.dropout, self.training)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class GptMlp(nn.Module):
    def __init__(self, width, dropout):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = dropout

    def forward(self, x):
        return F.dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)


class TransformerBlock(nn.Module):
    def __init__(self, context, width, heads, dropout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(context, width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = GptMlp(width, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LmHead(nn.Module):
    def __init__(self, width, vocab):
        super().__init__()
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, x):
        return self.lm_head(self.ln_f(x))


class BlockModel(nn.Module):
    def __init__(self, blocks):
        super().__init__()
        for i, (label, block) in enumerate(blocks):
            self.add_module(f"b{i}_{label}", block)

    def forward(self, x):
        for block in self.children():
            x = block(x)
        return x


# ---- registry ----------------------------------------------------------------------------------

def build(name, width=0, depth=0, heads=0, dropout=0.0, channels=1, height=28, image_width=28,
          classes=10, vocab=0, seq=0):
    """The model Caravan's buildModel makes for the same spec and data shape (0 = default)."""
    if name == "mlp":
        width, depth = width or 256, depth or 2
        blocks, inputs = [], channels * height * image_width
        for i in range(depth):
            blocks.append((f"hidden{i}", MlpLayer(inputs, width, dropout)))
            inputs = width
        blocks.append(("head", LinearHead(inputs, classes)))
    elif name == "cnn":
        width = width or 32
        features = 2 * width * (height // 4) * (image_width // 4)
        blocks = [("conv1", ConvStage(channels, width, 5)), ("conv2", ConvStage(width, 2 * width, 5)),
                  ("head", MlpHead(features, 128, classes))]
    elif name == "resnet-mini":
        width, depth = width or 16, depth or 1
        blocks, inputs = [("stem", ConvBnRelu(channels, width))], width
        for stage in range(3):
            outputs = width * 2 ** stage
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append((f"stage{stage + 1}_{i}", BasicBlock(inputs, outputs, stride)))
                inputs = outputs
        blocks.append(("head", PoolLinearHead(inputs, classes)))
    elif name == "gpt":
        width, depth, heads = width or 128, depth or 4, heads or 4
        blocks = [("embed", TokenEmbedding(vocab, seq, width, dropout))]
        blocks += [(f"layer{i}", TransformerBlock(seq, width, heads, dropout)) for i in range(depth)]
        blocks.append(("head", LmHead(width, vocab)))
    else:
        raise ValueError(f"unknown model {name}")
    return BlockModel(blocks)


# ---- check against a C++ dump ------------------------------------------------------------------

def check(args):
    dump = torch.load(args.dump)
    model = build(args.model, args.width, args.depth, args.heads, 0.0, args.channels, args.height,
                  args.image_width, args.classes, args.vocab, args.seq).double()
    state = {k[len("state."):]: v for k, v in dump.items() if k.startswith("state.")}
    model.load_state_dict(state, strict=True)  # raises on any missing or unexpected name
    model.eval()
    out = model(dump["input"])
    (out * dump["weights"]).sum().backward()

    failures = []
    def compare(what, ours, theirs):
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-9, atol=1e-11):
            diff = (ours - theirs).abs().max().item() if ours.shape == theirs.shape else "shape"
            failures.append(f"{what}: max difference {diff}")

    compare("output", out.detach(), dump["output"])
    for name, p in model.named_parameters():
        compare(f"grad of {name}", p.grad, dump["grad." + name])
    if failures:
        print(f"reference_models.py: {args.model} differs from PyTorch:", *failures, sep="\n  ")
        return 1
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("check", help="compare a C++ dump (see tests/test_models.cpp)")
    c.add_argument("dump")
    c.add_argument("--model", required=True)
    for key in ("width", "depth", "heads", "channels", "height", "image-width", "classes", "vocab",
                "seq"):
        c.add_argument("--" + key, type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
