"""Stock models as their users build them, for `caravan export` (tools/caravan_export.py) and
the tests that train the result (tests/test_stock_models.cpp): small configs, random
initialisation, no downloads, for Fashion-MNIST-shaped images [B, 1, 28, 28] and 10 classes.

Factories (FILE.py:FACTORY for caravan export), each returning (module, example_input) from
torch.manual_seed(0):
  vit     transformers' ViTForImageClassification (6 layers, width 32, patches of 7)
  resnet  transformers' ResNetForImageClassification (basic layers, 4 stages); torchvision's
          resnet18 does not import beside the CPU torch 2.13 (torchvision 0.28 needs its own
          operators, 0.29 needs torch 2.14)

And for the oracle (oracle_train.py's "eager_class"), the same classes whose forward(x) returns
the logits, so the original module trains in eager PyTorch under its own parameter names:
  VitLogits, ResNetLogits
"""
import torch
import transformers

VIT = dict(image_size=28, patch_size=7, num_channels=1, hidden_size=32, num_hidden_layers=6,
           num_attention_heads=2, intermediate_size=64, num_labels=10,
           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
RESNET = dict(num_channels=1, embedding_size=8, hidden_sizes=[8, 8, 16, 16], depths=[1, 1, 1, 1],
              layer_type="basic", num_labels=10)


def example():
    return torch.randn(2, 1, 28, 28)


def vit():
    torch.manual_seed(0)
    return transformers.ViTForImageClassification(transformers.ViTConfig(**VIT)), example()


def resnet():
    torch.manual_seed(0)
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(**RESNET)), example()


class VitLogits(transformers.ViTForImageClassification):
    def __init__(self):
        super().__init__(transformers.ViTConfig(**VIT))

    def forward(self, x):
        return super().forward(pixel_values=x, return_dict=False)[0]


class ResNetLogits(transformers.ResNetForImageClassification):
    def __init__(self):
        super().__init__(transformers.ResNetConfig(**RESNET))

    def forward(self, x):
        return super().forward(pixel_values=x, return_dict=False)[0]
