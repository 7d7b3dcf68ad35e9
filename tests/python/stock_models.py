"""Stock models as their users build them, for `caravan export` (tools/caravan_export.py) and
the tests that train the result (tests/test_stock_models.cpp): small configs, random
initialisation, no downloads, for Fashion-MNIST-shaped images [B, 1, 28, 28] and 10 classes.

Factories (FILE.py:FACTORY for caravan export), each returning (module, example_input) from
torch.manual_seed(0):
  vit     transformers' ViTForImageClassification (6 layers, width 32, patches of 7)
  resnet  transformers' ResNetForImageClassification (basic layers, 4 stages); torchvision's
          resnet18 does not import beside the CPU torch 2.13 (torchvision 0.28 needs its own
          operators, 0.29 needs torch 2.14)
  mobilenet transformers' MobileNetV2ForImageClassification (16 inverted residual layers,
          depth multiplier 0.25; its classifier's dropout, 0.1, draws in training), for
          torchvision's mobilenet_v2

  gpt2    transformers' GPT2LMHeadModel (4 layers, width 32; its head tied to its token
          embedding), on tokens [2, 16] over a vocabulary of 64
  llama   transformers' LlamaForCausalLM (4 layers, width 32; rotary embeddings and an attention
          mask reach every layer besides the hidden state), on the same tokens
  nanogpt a GPT in the form of nanoGPT's model.py (below: tied embedding and head, SDPA,
          forward(idx, targets) -> (logits, loss)); the example is (idx, targets)

And for the oracle (oracle_train.py's "eager_class"), the same classes whose forward(x) returns
the logits, so the original module trains in eager PyTorch under its own parameter names:
  VitLogits, ResNetLogits, MobileNetLogits, Gpt2Logits, LlamaLogits, NanoGptLogits

The language models are exported with an input alone (their own loss with labels= shifts the
labels, which Caravan's next-token targets already are) and trained on the task's loss.
"""
import torch
import transformers

VIT = dict(image_size=28, patch_size=7, num_channels=1, hidden_size=32, num_hidden_layers=6,
           num_attention_heads=2, intermediate_size=64, num_labels=10,
           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
RESNET = dict(num_channels=1, embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1],
              layer_type="basic", num_labels=10)
MOBILENET = dict(num_channels=1, image_size=28, depth_multiplier=0.25, num_labels=10,
                 classifier_dropout_prob=0.1)
GPT2 = dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)


def example():
    return torch.randn(2, 1, 28, 28)


def tokens():
    return torch.randint(0, 64, (2, 16))


# Per Hugging Face model: its class, its config's class and values, its example input, and how
# its forward takes that input (the language models without a cache).
HF = {
    "vit": (transformers.ViTForImageClassification, transformers.ViTConfig, VIT, example,
            dict(pixel_values=None)),
    "resnet": (transformers.ResNetForImageClassification, transformers.ResNetConfig, RESNET,
               example, dict(pixel_values=None)),
    "mobilenet": (transformers.MobileNetV2ForImageClassification, transformers.MobileNetV2Config,
                  MOBILENET, example, dict(pixel_values=None)),
    "gpt2": (transformers.GPT2LMHeadModel, transformers.GPT2Config, GPT2, tokens,
             dict(input_ids=None, use_cache=False)),
    "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig, LLAMA, tokens,
              dict(input_ids=None, use_cache=False)),
}


def hf_factory(name):
    """FILE.py:FACTORY's callable: the model from torch.manual_seed(0), and its example."""
    cls, config, values, make_example, _ = HF[name]

    def factory():
        torch.manual_seed(0)
        return cls(config(**values)), make_example()
    return factory


def hf_logits(name):
    """The same class, built without arguments, whose forward(x) returns the logits."""
    cls, config, values, _, call = HF[name]
    input_name = next(k for k, v in call.items() if v is None)
    options = {k: v for k, v in call.items() if v is not None}

    class Logits(cls):
        def __init__(self):
            super().__init__(config(**values))

        def forward(self, x):
            return super().forward(**{input_name: x}, **options, return_dict=False)[0]
    Logits.__name__ = Logits.__qualname__ = cls.__name__ + "Logits"
    return Logits


vit, resnet, mobilenet, gpt2, llama = (hf_factory(n) for n in
                                       ("vit", "resnet", "mobilenet", "gpt2", "llama"))
VitLogits, ResNetLogits, MobileNetLogits, Gpt2Logits, LlamaLogits = (
    hf_logits(n) for n in ("vit", "resnet", "mobilenet", "gpt2", "llama"))


# ---- a GPT in the form of nanoGPT's model.py ----------------------------------------------------
# nanoGPT's model.py itself is not on PyPI (the only source of Python packages here), so this is
# a model written the way it is, with the traits that matter to Caravan: the token embedding tied
# to the output head (lm_head.weight is transformer.wte.weight), attention through
# F.scaled_dot_product_attention with a fallback branch (`self.flash`, which torch.jit.script
# compiles both sides of), blocks in a ModuleList `h` inside a ModuleDict, and
# forward(idx, targets=None) returning (logits, loss), the logits of the last position only
# when no targets are given.

import math  # noqa: E402

import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

GPT = dict(vocab=64, context=32, layers=4, heads=2, width=32)
# nanoGPT's loss is plain cross-entropy, which Caravan's task loss equals; with smoothing a test
# tells the model's own loss from the task's.
LABEL_SMOOTHING = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads, context):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width, bias=False)
        self.c_proj = nn.Linear(width, width, bias=False)
        self.heads, self.width = heads, width
        self.flash = hasattr(F, "scaled_dot_product_attention")
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(context, context))
                                 .view(1, 1, context, context))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.width, dim=2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Mlp(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width, bias=False)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, width, heads, context):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, bias=False)
        self.attn = CausalSelfAttention(width, heads, context)
        self.ln_2 = nn.LayerNorm(width, bias=False)
        self.mlp = Mlp(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGptStyle(nn.Module):
    def __init__(self, vocab=GPT["vocab"], context=GPT["context"], layers=GPT["layers"],
                 heads=GPT["heads"], width=GPT["width"]):
        super().__init__()
        self.context = context
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width),
            wpe=nn.Embedding(context, width),
            h=nn.ModuleList([Block(width, heads, context) for _ in range(layers)]),
            ln_f=nn.LayerNorm(width, bias=False),
        ))
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT ties them
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.context, f"sequence of {t} is longer than the context {self.context}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                                   ignore_index=-1, label_smoothing=LABEL_SMOOTHING)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss


def nanogpt():
    torch.manual_seed(0)
    idx = torch.randint(0, GPT["vocab"], (2, 16))
    return NanoGptStyle(), (idx, torch.randint(0, GPT["vocab"], (2, 16)))


class NanoGptLogits(NanoGptStyle):
    """For the oracle: the same model, forward(idx) -> the logits of every position (what
    forward(idx, targets) computes before its loss), trained on caravan_loss: its own."""

    def caravan_loss(self, logits, targets):
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1, label_smoothing=LABEL_SMOOTHING)

    def forward(self, idx):
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))
