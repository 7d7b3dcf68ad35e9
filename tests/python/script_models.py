#!/usr/bin/env python3
"""Writes TorchScript modules for the scripted-model tests (tests/test_script_model.cpp):
torch.jit.script(module).save(OUT_DIR/<name>.pt). Usage: script_models.py OUT_DIR.

  cnn.pt        a small CNN written the way a user would (features / flat / head children)
  cnn-loss.pt   the same with a scripted loss(output, target) method (label-smoothed CE)
  gpt.pt        the built-in GPT's twin (reference_models.build("gpt", 16, 2, 2), vocab 16,
                context 24): the same blocks and parameter names as Caravan's own
  not-sequential.pt  a module whose forward is not its children in order (one block)
  double.pt     cnn.pt with float64 parameters; function.pt a scripted function (both refused)
  dropout-between.pt, detach-between.pt  children in order by value in eval mode, not in
                training (dropout between them) or for gradients (a detach): one block
  tied.pt       one module under two names (tied weights: one parameter); pair.pt returns a tuple
  linear.pt     nn.Linear(4, 2) with no bias, for regression on arrays
  flatten-first.pt  nn.Sequential(nn.Flatten(), Linear, ReLU, Linear): blocks without
                parameters first and in the middle; flatten-layers.pt the same as a module's
                `layers` (model.blocks = "layers"); traced-mlp.pt a torch.jit.trace'd MLP
  no-params.pt, int-output.pt, loss-vector.pt, loss-one-arg.pt, loss-string.pt,
  loss-constant.pt  user mistakes (no parameters; a forward returning class ids; a loss
                method returning a vector, taking one argument, returning a string, or a
                constant): refused in one line;
                loss-default.pt a loss of shape [1] with a defaulted third argument (trains)
  newer-op.pt   relu-head.pt (a Flatten, a Linear, torch.relu) calling an operator no torch
                has instead, as a file from a newer torch would: refused, naming the operator
Needs the project's Python: run with .venv/bin/python (torch 2.13, made by scripts/setup.sh).
"""
import os
import sys
import zipfile

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_models  # noqa: E402


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 8, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(8, 16, 5, padding=2), nn.BatchNorm2d(16),
                                      nn.ReLU(), nn.MaxPool2d(2))
        self.flat = nn.Flatten()
        self.head = nn.Sequential(nn.Linear(16 * 7 * 7, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.head(self.flat(self.features(x)))


class CnnWithLoss(Cnn):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, label_smoothing=0.1)


class DropoutBetween(Cnn):
    """Children in order in eval mode, but dropout between them in training."""

    def forward(self, x):
        return self.head(F.dropout(self.flat(self.features(x)), 0.5, self.training))


class DetachBetween(Cnn):
    """Children in order by value, but the features are frozen (no gradient flows into them)."""

    def forward(self, x):
        return self.head(self.flat(self.features(x).detach()))


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(784, 784)
        self.flat = nn.Flatten()
        self.b = nn.Linear(784, 10)
        self.b.weight = nn.Parameter(self.a.weight[:10].clone())
        self.c = self.b  # the same module under two names: tied

    def forward(self, x):
        return self.c(self.a(self.flat(x)))


class Pair(Cnn):
    def forward(self, x):
        y = self.head(self.flat(self.features(x)))
        return y, y


class NotSequential(Cnn):
    def forward(self, x):
        return self.head(self.flat(self.features(x))) * 0.5


def mlp_layers():
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))


class FlattenLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = mlp_layers()

    def forward(self, x):
        return self.layers(x)


class IntOutput(Cnn):
    def forward(self, x):
        return self.head(self.flat(self.features(x))).argmax(1)


class LossVector(Cnn):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, reduction="none")


class LossOneArgument(Cnn):
    @torch.jit.export
    def loss(self, output: torch.Tensor) -> torch.Tensor:
        return output.sum()


class LossWithDefault(Cnn):
    """A loss of shape [1] with a third argument that has a default: trains."""

    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor,
             smoothing: float = 0.1) -> torch.Tensor:
        return F.cross_entropy(output, target, label_smoothing=smoothing).reshape(1)


class LossConstant(Cnn):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.ones([])


class LossString(Cnn):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> str:
        return "low"


def with_an_operator_of_a_newer_torch(scripted_path, out_path):
    """The scripted file with torch.relu( renamed in its code to an operator no torch has, as a
    file saved by a newer torch calls one this torch lacks (aten::rms_norm on 1.13)."""
    with zipfile.ZipFile(scripted_path) as src, \
            zipfile.ZipFile(out_path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("code/__torch__.py"):
                assert b"torch.relu(" in data, data
                data = data.replace(b"torch.relu(", b"torch.an_op_of_a_newer_torch(")
            dst.writestr(info, data)


class ReluHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()
        self.head = nn.Linear(784, 10)

    def forward(self, x):
        return torch.relu(self.head(self.flat(x)))


def cnn_factory():
    """For caravan export (FILE.py:FACTORY): the Cnn and an example batch."""
    torch.manual_seed(0)
    return Cnn(), torch.randn(2, 1, 28, 28)


class LossOfInputSizes(Cnn):
    """forward(x, targets) -> (logits, loss) whose loss also reads the input (its batch size)."""

    def forward(self, x, targets):
        logits = self.head(self.flat(self.features(x)))
        return logits, F.cross_entropy(logits.view(x.size(0), -1), targets)


def loss_of_input_factory():
    """For caravan export: LossOfInputSizes with (input, targets)."""
    torch.manual_seed(0)
    return LossOfInputSizes(), (torch.randn(2, 1, 28, 28), torch.randint(0, 10, (2,)))


class SkipLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)

    def forward(self, h):
        return h + torch.tanh(self.fc(h))


class WrittenSkip(nn.Module):
    """A tensor made from no parameter, then written through a view with the embedding's
    output (skip[:] = h): it carries h's gradient, so it is no context value (graph_cut.h)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(28, 32)
        self.layers = nn.ModuleList([SkipLayer() for _ in range(4)])
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = self.embed(x.view(x.size(0), 28, 28))
        skip = torch.zeros(x.size(0), 28, 32)
        skip[:, :, :] = h
        for layer in self.layers:
            h = layer(h) + 0.5 * skip
        return self.head(h.mean(1))


def written_skip_factory():
    torch.manual_seed(0)
    return WrittenSkip(), torch.randn(2, 1, 28, 28)


def failing_factory():
    """For caravan export: a factory that raises."""
    raise RuntimeError("no weights here")


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    torch.manual_seed(0)
    torch.jit.script(Cnn()).save(os.path.join(out_dir, "cnn.pt"))
    torch.jit.script(CnnWithLoss()).save(os.path.join(out_dir, "cnn-loss.pt"))
    torch.jit.script(NotSequential()).save(os.path.join(out_dir, "not-sequential.pt"))
    gpt = reference_models.build("gpt", 16, 2, 2, 0.0, vocab=16, seq=24)
    torch.jit.script(gpt).save(os.path.join(out_dir, "gpt.pt"))
    torch.jit.script(Cnn().double()).save(os.path.join(out_dir, "double.pt"))
    torch.jit.script(DropoutBetween()).save(os.path.join(out_dir, "dropout-between.pt"))
    torch.jit.script(DetachBetween()).save(os.path.join(out_dir, "detach-between.pt"))
    torch.jit.script(Tied()).save(os.path.join(out_dir, "tied.pt"))
    torch.jit.script(Pair()).save(os.path.join(out_dir, "pair.pt"))
    torch.jit.script(nn.Sequential(nn.Linear(4, 2, bias=False))).save(
        os.path.join(out_dir, "linear.pt"))

    torch.jit.script(mlp_layers()).save(os.path.join(out_dir, "flatten-first.pt"))
    torch.jit.script(FlattenLayers()).save(os.path.join(out_dir, "flatten-layers.pt"))
    torch.jit.trace(mlp_layers(), torch.randn(2, 1, 28, 28)).save(
        os.path.join(out_dir, "traced-mlp.pt"))
    torch.jit.script(nn.Sequential(nn.Flatten(), nn.ReLU())).save(
        os.path.join(out_dir, "no-params.pt"))
    torch.jit.script(IntOutput()).save(os.path.join(out_dir, "int-output.pt"))
    torch.jit.script(LossVector()).save(os.path.join(out_dir, "loss-vector.pt"))
    torch.jit.script(LossOneArgument()).save(os.path.join(out_dir, "loss-one-arg.pt"))
    torch.jit.script(LossString()).save(os.path.join(out_dir, "loss-string.pt"))
    torch.jit.script(LossWithDefault()).save(os.path.join(out_dir, "loss-default.pt"))
    torch.jit.script(LossConstant()).save(os.path.join(out_dir, "loss-constant.pt"))

    torch.jit.script(ReluHead()).save(os.path.join(out_dir, "relu-head.pt"))
    with_an_operator_of_a_newer_torch(os.path.join(out_dir, "relu-head.pt"),
                                      os.path.join(out_dir, "newer-op.pt"))

    def function(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    torch.jit.script(function).save(os.path.join(out_dir, "function.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
