#!/usr/bin/env python3
"""Trains a model in Python PyTorch from a dump written by tests/test_oracle.cpp and prints the
per-step losses and final parameters, so the C++ test can compare Caravan against PyTorch.

The dump (torch.load-able dict) holds: "state.<name>" initial parameters/buffers, "x<i>"/"y<i>"
the batches, "lr" the learning rate of each step and "rng<i>" the CPU generator's state Caravan
stepped from (set before each step's forward, so dropout draws what Caravan drew); CONFIG is a
JSON file with the model spec and the optimizer settings. Usage: oracle_train.py DUMP CONFIG
OUT. Output: a torch.save'd dict {"losses": tensor, "saved_bytes": the bytes autograd saved for
backward in step 1's forward (storages once, parameters excluded), "state.<name>": tensor}.

The model: CONFIG's "eager_class" ("module.Class" of this directory, e.g.
"todays_models.CausalSdpa", built without arguments) runs that Python class in eager PyTorch;
else model "torchscript" loads the scripted file "path"; else reference_models builds the
built-in model's twin. The loss is the task's cross-entropy, or the model's caravan_loss(out, y)
where it has one (a model trained on its own loss). With "check_rng_matters" the run is repeated from the same weights with
the generator's states not Caravan's (seeded 12345 once), its losses as "losses_other_rng": a
test can show that its losses depend on the draws (so matching them proves the draws match).
Needs the project's Python: run with .venv/bin/python (torch 2.13, made by scripts/setup.sh).
"""
import importlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference_models  # noqa: E402


def build_model(cfg, dump):
    """The model of CONFIG `cfg`, with the dump's initial state loaded strictly, in train mode."""
    if cfg.get("eager_class"):
        # The Python class itself, in eager PyTorch: not its TorchScript file.
        module_name, class_name = cfg["eager_class"].rsplit(".", 1)
        model = getattr(importlib.import_module(module_name), class_name)()
    elif cfg["model"] == "torchscript":
        # The user's scripted module itself, run as Caravan runs it: TorchScript's graph
        # optimizations off, so every op records ordinary autograd (models/script_model.h).
        model = torch.jit.load(cfg["path"])
        torch._C._set_graph_executor_optimize(False)
    else:
        model = reference_models.build(cfg["model"], cfg["width"], cfg["depth"], cfg["heads"], 0.0,
                                       channels=cfg.get("channels", 1), height=cfg.get("height", 28),
                                       image_width=cfg.get("image_width", 28),
                                       classes=cfg.get("classes", 10), vocab=cfg.get("vocab", 0),
                                       seq=cfg.get("seq", 0))
    state = {k[len("state."):]: v for k, v in dump.items() if k.startswith("state.")}
    model.load_state_dict(state, strict=True)
    model.train()
    return model


def train(cfg, dump, caravans_rng=True):
    """Trains a fresh model over the dump's steps: (model, losses, saved_bytes). With
    `caravans_rng` each step's forward starts from the generator state Caravan's did."""
    model = build_model(cfg, dump)
    if cfg["optim"] == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"],
                              nesterov=cfg["nesterov"], weight_decay=cfg["weight_decay"])
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]),
                                eps=cfg["eps"], weight_decay=cfg["weight_decay"])
    # The CNN's inputs in channels-last layout, as Caravan's ConvStage convolves them: the same
    # kernels sum in the same order (NCHW puts AdamW's parameters 1.3e-5 apart after 20 steps).
    # Not resnet-mini: PyTorch's strided 1x1 convolution corrupts the heap in that layout on
    # CPUs without AVX-512 (models/blocks.cpp), and no oracle here trains it.
    layout = reference_models.channels_last if cfg["model"] == "cnn" else (lambda t: t)
    losses = []
    lrs = dump["lr"].tolist()
    # Bytes autograd saves for backward in the first step's forward: storages counted once,
    # the parameters' own storages not (they are weights), as Caravan's MemoryTracker counts.
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in param_storages:
            held[key] = t.untyped_storage().nbytes()
        return t

    saved_bytes = None
    for i, lr in enumerate(lrs):
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = layout(dump[f"x{i}"]), dump[f"y{i}"]
        opt.zero_grad()
        if caravans_rng and f"rng{i}" in dump:
            torch.set_rng_state(dump[f"rng{i}"])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
            if hasattr(model, "caravan_loss"):  # the model's own loss (forward(x, targets)'s)
                loss = model.caravan_loss(out, y)
            elif out.dim() == 3:
                loss = torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)),
                                                         y.reshape(-1))
            else:
                loss = torch.nn.functional.cross_entropy(out, y)
        if saved_bytes is None:
            saved_bytes = sum(held.values())
        loss.backward()
        if cfg["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        opt.step()
        losses.append(loss.item())
    return model, losses, saved_bytes


def main(dump_path, config_path, out_path):
    torch.set_num_threads(1)
    dump = torch.load(dump_path)
    with open(config_path) as f:
        cfg = json.load(f)
    model, losses, saved_bytes = train(cfg, dump)
    result = {"losses": torch.tensor(losses, dtype=torch.float64),
              "saved_bytes": torch.tensor([saved_bytes], dtype=torch.int64)}
    for k, v in model.state_dict().items():
        result["state." + k] = v
    if cfg.get("check_rng_matters"):
        torch.manual_seed(12345)
        result["losses_other_rng"] = torch.tensor(train(cfg, dump, caravans_rng=False)[1],
                                                  dtype=torch.float64)
    torch.save(result, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3]))
