#!/usr/bin/env python3
"""Training throughput of stock models as their users build them (tests/python/stock_models.py:
Hugging Face's ViT, ResNet, MobileNetV2, GPT-2 and Llama from small configs, and nanoGPT's
form), exported unchanged by `caravan export` and trained by Caravan cut into blocks, against
the same file as one block and against PyTorch 2.13 eager training the original class. Per model and thread count the arms are interleaved in one
invocation (A A1 C Cc Ab Cb A A1 ...):

  A   caravan        Caravan, the exported file cut into blocks (model.blocks = auto), float32
  A1  caravan-whole  the same file as one block (model.blocks = none): the cut must cost
                     nothing (target A/A1 >= 0.98)
  C   pytorch        eager PyTorch, the original class (stock_models.VitLogits, ResNetLogits,
                     MobileNetLogits, Gpt2Logits, LlamaLogits, NanoGptLogits)
  Cc  pytorch-compile  the same under torch.compile (inductor); warm-up steps include the
                     compilation; where it fails, the output says so and the arm is left out
  Ab  caravan-bf16   A with train.precision = bf16 (products in bfloat16 where timed faster)
  Cb  pytorch-bf16   C under torch.autocast("cpu", dtype=torch.bfloat16)

Targets: A/C >= 1.0 and Ab/Cb >= 1.0 (and against Cc where it runs). Where bf16 is slower than
float32 on this CPU, Caravan's bf16 keeps float32 in those blocks while autocast does not, so
Ab/Cb flatters Caravan: the table also gives Ab and A against the best PyTorch arm. Every arm:
batches of 64 (Fashion-MNIST images; for the language models sequences of 16 tokens of 64,
Caravan's synthetic tokens and the peer's uniformly drawn ones: the step's work does not depend
on the ids; nanoGPT's form trained on its own loss, as Caravan trains it), SGD (lr 0.05,
momentum 0.9), the same thread count (train.threads /
torch.set_num_threads and OpenBLAS's), warm-up steps excluded; the PyTorch arms with the
allocator setting Caravan's runs use (GLIBC_TUNABLES, bench/script_step.py). OPENBLAS_CORETYPE
and the other variables bench/script_step.py names are removed from every measured process's
environment; the output says which were set. Reports medians and ratios.

    .venv/bin/python bench/stock_step.py [--models vit resnet mobilenet gpt2 llama nanogpt]
        [--threads 1]
        [--repeats 3]
        [--steps 60] [--warmup 10] [--out DIR]

Writes DIR/results.json (default bench/results/stock). Internal subcommand (run by the
driver): `peer --model NAME --steps N --warmup W --threads T [--autocast] [--compile]`.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

import script_step
from script_step import CARAVAN, PYTHON, ROOT, TUNABLES

SELF = os.path.abspath(__file__)
FMNIST = "/usr/share/datasets/fashion-mnist"
BATCH = 64
TOKENS = ("gpt2", "llama", "nanogpt")  # stock_models.py's language models
VOCAB, SEQ = 64, 16
ARMS = ["caravan", "caravan-whole", "pytorch", "pytorch-compile", "caravan-bf16", "pytorch-bf16"]


def cmd_peer(argv):
    import torch
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import peer_train
    import stock_models
    p = argparse.ArgumentParser(prog="stock_step.py peer")
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--autocast", action="store_true")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args(argv)
    peer_train.set_threads(a.threads)
    torch.manual_seed(0)
    model = {"vit": stock_models.VitLogits, "resnet": stock_models.ResNetLogits,
             "mobilenet": stock_models.MobileNetLogits,
             "gpt2": stock_models.Gpt2Logits, "llama": stock_models.LlamaLogits,
             "nanogpt": stock_models.NanoGptLogits}[a.model]()
    model.train()
    if a.model in TOKENS:
        ids = torch.randint(0, VOCAB, (4096, SEQ + 1))
        xs, ys = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    else:
        xs, ys = peer_train.load_fmnist(FMNIST)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    run = torch.compile(model) if a.compile else model
    loss = getattr(model, "caravan_loss", None)  # nanoGPT's own
    step = peer_train.make_step(run, opt, xs, ys, BATCH, 0.0, autocast=a.autocast, loss=loss)
    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    print(json.dumps({"bench": "stock_step-peer", "model": a.model, "threads": a.threads,
                      "autocast": a.autocast, "compile": a.compile, "steps": a.steps,
                      "samples_per_s": a.steps * BATCH / sum(times),
                      "step_s_median": statistics.median(times), "torch": torch.__version__}))


def caravan_config(model, pt, blocks, precision, threads, warmup, steps):
    data = {"dataset": "fashion-mnist", "path": FMNIST, "batch_size": BATCH}
    if model in TOKENS:
        data = {"dataset": "synthetic", "synthetic_task": "tokens", "seq_len": SEQ,
                "vocab_size": VOCAB, "synthetic_size": 4096, "batch_size": BATCH}
    cfg = {"data": data,
           "model": {"name": "torchscript", "path": pt, "blocks": blocks},
           "optim": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
           "schedule": {"kind": "constant"}}
    cfg = script_step.timed_run_config(cfg, threads, warmup, steps)
    cfg["train"]["precision"] = precision
    return cfg


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        return cmd_peer(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+",
                   default=["vit", "resnet", "mobilenet", "gpt2", "llama", "nanogpt"])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "stock"))
    a = p.parse_args()
    environ, removed = script_step.environment()
    tuned = dict(environ, GLIBC_TUNABLES=TUNABLES)
    print(script_step.environment_note(removed, except_c=False), flush=True)
    out = os.path.abspath(a.out)
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    caravan = script_step.Caravan("train", None, CARAVAN, work)

    raw, skipped = [], {}
    for model in a.models:
        pt = os.path.join(work, model + ".pt")
        exported = subprocess.run([CARAVAN, "export",
                                   os.path.join(ROOT, "tests", "python", "stock_models.py") +
                                   ":" + model, "-o", pt], cwd=ROOT, env=environ,
                                  capture_output=True, text=True)
        if exported.returncode != 0:
            sys.exit(f"stock_step: caravan export of {model} failed: {exported.stderr.strip()}")
        print(exported.stdout.strip(), flush=True)
        for t in a.threads:
            configs = {}
            for arm, blocks, precision in (("caravan", "auto", "float32"),
                                           ("caravan-whole", "none", "float32"),
                                           ("caravan-bf16", "auto", "bf16")):
                configs[arm] = script_step.write_toml(
                    caravan_config(model, pt, blocks, precision, t, a.warmup, a.steps),
                    os.path.join(work, f"{model}-{arm}-t{t}.toml"))
            for rep in range(a.repeats):
                for arm in ARMS:
                    if (model, t, arm) in skipped:
                        continue
                    if arm.startswith("caravan"):
                        m = caravan.run(configs[arm], t, a.warmup, a.steps, BATCH, environ)
                    else:
                        cmd = [PYTHON, SELF, "peer", "--model", model, "--steps", str(a.steps),
                               "--warmup", str(a.warmup), "--threads", str(t)]
                        cmd += {"pytorch-compile": ["--compile"],
                                "pytorch-bf16": ["--autocast"]}.get(arm, [])
                        r = subprocess.run(cmd, cwd=ROOT, env=tuned, capture_output=True,
                                           text=True, timeout=script_step.RUN_TIMEOUT)
                        if r.returncode != 0:
                            why = script_step.first_error_line(r.stderr)
                            skipped[(model, t, arm)] = why
                            print(f"  {model} t={t} {arm}: failed, left out: {why}", flush=True)
                            continue
                        m = json.loads(r.stdout.strip().splitlines()[-1])
                    m = dict(m, model=model, threads=t, arm=arm, repeat=rep)
                    raw.append(m)
                    print(f"  {model} t={t} #{rep} {arm:<16}{m['samples_per_s']:9.1f} samples/s",
                          file=sys.stderr, flush=True)

    lines = ["| model | threads | " + " | ".join(ARMS) +
             " | A/A1 | A/C | A/Cc | Ab/Cb | A/best C | Ab/best C |",
             "|---" * (len(ARMS) + 8) + "|"]
    rows = []
    for model in a.models:
        for t in a.threads:
            med = {}
            for arm in ARMS:
                v = [m["samples_per_s"] for m in raw
                     if m["model"] == model and m["threads"] == t and m["arm"] == arm]
                med[arm] = statistics.median(v) if v else float("nan")
            r = {"model": model, "threads": t, "median_samples_per_s": med,
                 "A/A1": script_step.ratio(med["caravan"], med["caravan-whole"]),
                 "A/C": script_step.ratio(med["caravan"], med["pytorch"]),
                 "A/Cc": script_step.ratio(med["caravan"], med["pytorch-compile"]),
                 "Ab/Cb": script_step.ratio(med["caravan-bf16"], med["pytorch-bf16"])}
            best = max(v for k, v in med.items() if k.startswith("pytorch") and v == v)
            r["A/best C"] = script_step.ratio(med["caravan"], best)
            r["Ab/best C"] = script_step.ratio(med["caravan-bf16"], best)
            rows.append(r)
            lines.append(f"| {model} | {t} | " + " | ".join(f"{med[x]:.1f}" for x in ARMS) +
                         f" | {r['A/A1']:.3f} | {r['A/C']:.3f} | {r['A/Cc']:.3f} | "
                         f"{r['Ab/Cb']:.3f} | {r['A/best C']:.3f} | {r['Ab/best C']:.3f} |")
    print("\n".join(lines))
    for (model, t, arm), why in skipped.items():
        print(f"left out: {model} t={t} {arm}: {why}")
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"raw": raw, "rows": rows, "skipped": {f"{k[0]} t={k[1]} {k[2]}": v
                                                         for k, v in skipped.items()},
                   "removed_env": removed, "tunables": TUNABLES, "args": vars(a)}, f, indent=1)
    print("wrote", os.path.join(out, "results.json"))
    shutil.rmtree(work, ignore_errors=True)  # the exported files and configs


if __name__ == "__main__":
    sys.exit(main())
