#!/usr/bin/env python3
"""PyTorch peer for bench/train_throughput.py: times training steps of the same model, batch,
optimizer and thread count as a Caravan config, in Python PyTorch (the project's .venv torch).
Prints one JSON object. Data: Fashion-MNIST images preloaded as one tensor (fmnist configs) or
random token ids of the Brown vocabulary size (brown configs); batches are drawn by indexing
preloaded tensors, the cheapest input path Python has.

The helpers (read_config, build, make_optimizer, draw_batch, task_loss) are shared with the
data-parallel peer, bench/peer_ddp.py.
"""
import argparse
import contextlib
import ctypes
import gzip
import json
import os
import sys
import time
import tomllib

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
import reference_models  # noqa: E402

BROWN_VOCAB = 86  # what Caravan's Brown loader reports (85 characters + unknown)


def set_threads(n, blas=None):
    """Run on n cores, as Caravan's train.threads does (src/train/setup.cpp): torch's intra-op
    pool and OpenBLAS's own pool. torch.set_num_threads does not reach OpenBLAS (Debian's
    libtorch calls it through libblas.so.3, openblas-pthread), which otherwise multiplies
    matrices on every core: measured on brown-gpt at --threads 1, the peer took 8.4 s of CPU in
    6.2 s and ran 96 samples/s; with OpenBLAS held to one thread, 73-79 (Caravan 73)."""
    torch.set_num_threads(n)
    try:
        ctypes.CDLL("libopenblas.so.0").openblas_set_num_threads(n if blas is None else blas)
    except (OSError, AttributeError):
        pass  # no OpenBLAS loaded: torch's own pool is all there is
    return torch.get_num_threads()


def cpu_seconds():
    """CPU time of the whole process (every thread), to show how many cores a run used."""
    return time.process_time()


def load_fmnist(path):
    with gzip.open(os.path.join(path, "train-images-idx3-ubyte.gz")) as f:
        raw = f.read()[16:]
    with gzip.open(os.path.join(path, "train-labels-idx1-ubyte.gz")) as f:
        labels = torch.frombuffer(bytearray(f.read()[8:]), dtype=torch.uint8).long()
    x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, 1, 28, 28).float() / 255
    x = (x - x.mean()) / x.std()
    return x, labels


def read_config(path):
    with open(path, "rb") as f:
        return tomllib.load(f)


def build(cfg):
    """(model, xs, ys, batch, clip) for a config: the twin of Caravan's model (initialized from
    the current torch seed) and the preloaded training inputs and targets."""
    data, model_cfg = cfg.get("data", {}), cfg.get("model", {})
    batch = data.get("batch_size", 64)
    if data.get("dataset", "fashion-mnist") == "brown":
        seq = data.get("seq_len", 128)
        tokens = torch.randint(0, BROWN_VOCAB, (4096, seq + 1))
        xs, ys = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        model = reference_models.build("gpt", model_cfg.get("width", 0), model_cfg.get("depth", 0),
                                       model_cfg.get("heads", 0), model_cfg.get("dropout", 0.0),
                                       vocab=BROWN_VOCAB, seq=seq)
    else:
        xs, ys = load_fmnist(data.get("path") or "/usr/share/datasets/fashion-mnist")
        model = reference_models.build(model_cfg.get("name", "cnn"), model_cfg.get("width", 0),
                                       model_cfg.get("depth", 0), model_cfg.get("heads", 0),
                                       model_cfg.get("dropout", 0.0))
    clip = cfg.get("optim", {}).get("grad_clip", 0.0)
    return model, xs, ys, batch, clip


# The peers' optimizers run PyTorch's fused CPU kernels (`fused=True`: one pass per parameter,
# 11x the default for-loop AdamW on 14M parameters here, 12.6 against 138 ms): the strongest
# step PyTorch has on CPU, as Caravan's own optimizers are fused. PEER_OPTIMIZER_FUSED=0 gives
# PyTorch's default (the for-loop implementation on CPU), as every peer ran before 2026-12-07.
FUSED = os.environ.get("PEER_OPTIMIZER_FUSED", "1") != "0"


def optimizer_spec(cfg):
    """(optimizer class, its keyword arguments) for a config's [optim]: what make_optimizer
    builds, for wrappers that take the class (bench/peer_zero.py's ZeroRedundancyOptimizer)."""
    optim = cfg.get("optim", {})
    lr = optim.get("lr", 0.01)
    fused = {"fused": True} if FUSED else {}
    if optim.get("name", "sgd") == "adamw":
        return torch.optim.AdamW, dict(lr=lr, weight_decay=optim.get("weight_decay", 0.0),
                                       **fused)
    return torch.optim.SGD, dict(lr=lr, momentum=optim.get("momentum", 0.9),
                                 nesterov=optim.get("nesterov", False),
                                 weight_decay=optim.get("weight_decay", 0.0), **fused)


def make_optimizer(cfg, params):
    cls, kwargs = optimizer_spec(cfg)
    return cls(params, **kwargs)


def state_bytes(opt):
    """Bytes of the tensors in an optimizer's state held by this process (a DTensor's local
    shard; a ZeroRedundancyOptimizer's own shard, through its .optim)."""
    total = 0
    for state in getattr(opt, "optim", opt).state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                v = getattr(v, "_local_tensor", v)  # DTensor (FSDP2): the local shard
                total += v.numel() * v.element_size()
    return total


def draw_batch(xs, ys, batch, generator=None):
    idx = torch.randint(0, xs.size(0), (batch,), generator=generator)
    return xs.index_select(0, idx), ys.index_select(0, idx)


def task_loss(out, y):
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.size(-1)), y.reshape(-1))


# x ([B, C, H, W]) in the channels-last layout of Caravan's convolution blocks.
channels_last = reference_models.channels_last


def make_step(model, opt, xs, ys, batch, clip, autocast=False, layout=None, loss=None):
    """One training step (draw, forward, loss, backward, clip, update) as a function of nothing;
    returns the loss. Shared with bench/script_step.py's peer. `autocast`: forward and loss
    under PyTorch's CPU autocast to bf16 (torch.autocast("cpu", dtype=torch.bfloat16)), the
    way PyTorch's documentation trains in mixed precision on a CPU. `layout`: applied to each
    batch's inputs (channels_last for a convolutional model in channels-last layout). `loss`:
    the model's own loss(output, y) in place of the task's."""
    objective = loss if loss is not None else task_loss

    def step():
        x, y = draw_batch(xs, ys, batch)
        if layout is not None:
            x = layout(x)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            value = objective(model(x), y)
        value.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        return value.item()
    return step


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--autocast", action="store_true", help="bf16 CPU autocast (mixed precision)")
    p.add_argument("--blas-threads", type=int,
                   help="OpenBLAS's threads (default --threads); 1 for bf16 autocast, whose "
                        "products run on oneDNN, as Caravan's bf16 runs (core/openmp_env.h)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (inductor, CPU), as PyTorch 2.x advises for "
                        "speed; the warmup steps include the compilation")
    p.add_argument("--channels-last", action="store_true",
                   help="convolutions in channels-last layout (PyTorch's CPU advice for CNNs): "
                        "the model's weights and each batch; nothing changes for other models")
    p.add_argument("--trace", help="profile the timed steps (torch.profiler) and write a Chrome "
                                   "trace here, as caravan_bench train --trace does; "
                                   "bench/op_profile.py --peer reads it")
    a = p.parse_args()
    set_threads(a.threads, a.blas_threads)
    cfg = read_config(a.config)
    torch.manual_seed(0)
    model, xs, ys, batch, clip = build(cfg)
    model.train()
    opt = make_optimizer(cfg, model.parameters())

    layout = None
    if a.channels_last and xs.dim() == 4:
        model = model.to(memory_format=torch.channels_last)
        layout = channels_last
    compiled = torch.compile(model) if a.compile else model
    step = make_step(compiled, opt, xs, ys, batch, clip, autocast=a.autocast, layout=layout)

    for _ in range(a.warmup):
        step()
    profiler = torch.profiler.profile() if a.trace else contextlib.nullcontext()
    with profiler:
        t0, c0 = time.perf_counter(), cpu_seconds()
        for _ in range(a.steps):
            step()
        s = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    if a.trace:
        profiler.export_chrome_trace(a.trace)
    print(json.dumps({"bench": "peer", "config": a.config, "threads": a.threads,
                      "autocast": a.autocast, "compile": a.compile,
                      "channels_last": layout is not None,
                      "blas_threads": a.blas_threads or a.threads,
                      "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                      "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
                      "batch_size": batch,
                      "steps": a.steps, "seconds": s, "samples_per_s": a.steps * batch / s,
                      "cpu_s_per_s": cpu / s,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
