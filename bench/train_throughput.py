#!/usr/bin/env python3
"""Single-worker training throughput: Caravan (build/caravan_bench) against the same model,
batch, optimizer and thread count in Python PyTorch (bench/peer_train.py), measured in the
same invocation with the runs interleaved (A B C D E A B C D E ...); reports medians and
ratios, plus achieved GFLOP/s against the machine's measured float32 and bf16 matmul peaks.

The arms, per config and thread count:
  caravan       train.precision = float32
  caravan-bf16  train.precision = bf16 (per-block timed choice, train/precision.h)
  caravan-p     caravan with OMP_WAIT_POLICY=PASSIVE (what a float32 run of several threads
                got before issue 49; what it gets now when it shares its host)
  pytorch-t     PyTorch (the .venv's torch, 2.13) eager float32 with Caravan's allocator
                settings (GLIBC_TUNABLES, below), the OpenMP waits Caravan's runs get
                (GOMP_SPINCOUNT=3000: the wheel's MKL multiplies on OpenMP's pool,
                core/openmp_env.h) and, for convolutional models, the channels-last layout
                Caravan's convolutions use (peer_train.py --channels-last)
  pytorch-p     pytorch-t with OMP_WAIT_POLICY=PASSIVE (the settings before issue 49; the faster
                of the two at two threads when anything else shares the cores)
  compile-f32   pytorch-t with the model under torch.compile (inductor, CPU), float32
  autocast-t    PyTorch eager with torch.autocast("cpu", bfloat16), tuned as pytorch-t except
                for threads, which it runs as Caravan's bf16 runs do (core/openmp_env.h):
                GOMP_SPINCOUNT=3000 (with 1.13's OpenBLAS also held to one thread; libgomp's
                default spin was 1.3-1.4x faster at two threads than PASSIVE there)
  compile-t     autocast-t with the model under torch.compile (inductor, CPU): PyTorch 2.x's
                own advice for speed; its compilation runs in the warmup steps, not timed

    .venv/bin/python bench/train_throughput.py [--repeats 3] [--threads 1 2] [--json OUT]
                                               [--bench PATH] [--configs ...]
    .venv/bin/python bench/train_throughput.py --replot OUT

With --json OUT, every measurement goes to OUT and charts.json (for `caravan report`,
docs/report.md) to the same directory. --replot OUT runs nothing: it rebuilds that charts.json
from OUT.

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the environment of the measured
processes (they slow OpenBLAS on this CPU); the table says so.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import charts  # charts.json for caravan report

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BENCH = os.path.join(ROOT, "build", "caravan_bench")
PEER = os.path.join(ROOT, "bench", "peer_train.py")
CASES = [("configs/fmnist-cnn.toml", 300), ("configs/brown-gpt.toml", 60),
         ("bench/configs/gpt-small.toml", 400)]
DEFAULT_CONFIGS = ["configs/fmnist-cnn.toml", "configs/brown-gpt.toml"]
TUNED = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=268435456:"
                           "glibc.malloc.mmap_threshold=33554432",
         "OMP_WAIT_POLICY": "PASSIVE"}
OPENMP_SPIN_COUNT = 3000  # kOpenMpSpinCount, src/core/openmp_env.h
PEERS_NOTE = ("PyTorch arms: " + " ".join(k + "=" + v for k, v in TUNED.items()
                                         if k != "OMP_WAIT_POLICY")
              + f" and, for convolutional models, the channels-last layout; GOMP_SPINCOUNT="
              f"{OPENMP_SPIN_COUNT} as Caravan's runs (core/openmp_env.h), except pytorch-p: "
              "OMP_WAIT_POLICY=PASSIVE; compile-*: torch.compile (inductor).")
ARMS = ["caravan", "caravan-bf16", "caravan-p", "pytorch-t", "pytorch-p", "compile-f32", "autocast-t",
        "compile-t"]


def env():
    e = dict(os.environ)
    removed = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if e.pop(k, None) is not None]
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES",
              "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "CARAVAN_OMP_SET"):
        e.pop(k, None)
    return e, removed


def peer_command(arm, args, environ):
    """(command, environment) of the PyTorch arm `arm` (pytorch-t, pytorch-p, compile-f32,
    autocast-t or compile-t, see the top) with peer_train.py's arguments `args`, from environ
    (env()'s)."""
    cmd = [sys.executable, PEER] + args
    tuned = dict(environ, **TUNED)
    # Caravan's waits for a run alone on its host with products on OpenMP's pool (MKL, oneDNN):
    # core/openmp_env.h
    spin = dict({k: v for k, v in tuned.items() if k != "OMP_WAIT_POLICY"},
                GOMP_SPINCOUNT=str(OPENMP_SPIN_COUNT))
    if arm == "autocast-t":
        return cmd + ["--autocast", "--channels-last", "--blas-threads", "1"], spin
    if arm == "compile-t":
        return cmd + ["--autocast", "--compile", "--channels-last", "--blas-threads", "1"], spin
    if arm == "pytorch-t":
        return cmd + ["--channels-last"], spin
    if arm == "pytorch-p":
        return cmd + ["--channels-last"], tuned
    if arm == "compile-f32":
        return cmd + ["--compile", "--channels-last"], spin
    raise ValueError(f"no PyTorch arm {arm}")


def peer_version():
    """The peer's torch version (this Python's)."""
    import torch
    return torch.__version__


def run_json(cmd, environ):
    out = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"train_throughput: {' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_charts(data, path):
    """charts.json next to the --json file `path` for `caravan report` (docs/report.md): per
    config, samples/s of every arm at each thread count; the ratios; Caravan's GFLOP/s against
    the matmul peaks; the table as printed."""
    rows = data["rows"]
    short = lambda c: os.path.basename(c).removesuffix(".toml")  # noqa: E731
    out = []
    for c in dict.fromkeys(r["config"] for r in rows):
        mine = sorted((r for r in rows if r["config"] == c), key=lambda r: r["threads"])
        out.append(charts.bar(
            f"throughput-{short(c)}", f"{short(c)}: training samples per second (one worker)",
            [f"{r['threads']} thread{'s' if r['threads'] != 1 else ''}" for r in mine],
            [charts.series(a, y=[r["median"].get(a, float("nan")) for r in mine]) for a in ARMS], "samples / s",
            x_label="compute threads"))
    labels = [f"{short(r['config'])}, {r['threads']}t" for r in rows]
    out.append(charts.bar(
        "ratio", "Caravan against the tuned peers (>= 1: Caravan faster)", labels,
        [charts.series(k, y=[r["ratios"].get(k, float("nan")) for r in rows]) for k in RATIOS], "ratio",
        x_label="config, threads"))
    out.append(charts.bar(
        "gflops", "Caravan's training GFLOP/s against the matmul peaks", labels,
        [charts.series("caravan float32", y=[r["gflops"]["caravan"] for r in rows]),
         charts.series("caravan bf16", y=[r["gflops"]["caravan-bf16"] for r in rows]),
         charts.series("float32 mm peak", y=[r["peak"]["float32"] for r in rows]),
         charts.series("bf16 mm peak", y=[r["peak"]["bf16"] for r in rows])],
        "GFLOP/s", x_label="config, threads"))
    removed = data.get("removed_env") or []
    note = ("Single worker, interleaved runs (one of each arm per round), medians. GFLOP/s "
            "counts 3x the analytic forward FLOPs per example; mm peak is the best of 3 "
            f"1024x1024 matmuls at the same thread count. {PEERS_NOTE} Removed from the "
            "environment: "
            f"{', '.join(removed) or 'nothing (not set)'}.")
    return charts.write(
        charts.beside(path), "train-throughput",
        "Single-worker training throughput: Caravan against PyTorch", out, note=note,
        command=charts.command("bench/train_throughput.py", data.get("args"),
                               skip=("replot", "bench")),
        table=charts.table(HEADER, [table_row(r) for r in rows]))


# ratio name -> (numerator arm, denominator arm)
RATIOS = {"f32/pytorch-t": ("caravan", "pytorch-t"),
          "f32/caravan-p": ("caravan", "caravan-p"),
          "f32/pytorch-p": ("caravan", "pytorch-p"),
          "f32/compile-f32": ("caravan", "compile-f32"),
          "bf16/autocast-t": ("caravan-bf16", "autocast-t"),
          "bf16/compile-t": ("caravan-bf16", "compile-t")}
HEADER = (["config", "threads"] + [f"{a}/s" for a in ARMS] + list(RATIOS)
          + ["bf16 GFLOP/s", "of bf16 peak"])


def table_row(r):
    return ([os.path.basename(r["config"]), r["threads"]]
            + [f"{r['median'].get(a, float('nan')):.1f}" for a in ARMS]
            + [f"{r['ratios'].get(k, float('nan')):.3f}" for k in RATIOS]
            + [f"{r['gflops']['caravan-bf16']:.1f}",
               f"{100 * r['gflops']['caravan-bf16'] / r['peak']['bf16']:.1f}%"])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                   help="which configs to measure (of: " + ", ".join(c for c, _ in CASES)
                        + "; default: the first two)")
    p.add_argument("--arms", nargs="+", default=ARMS, choices=ARMS,
                   help="which arms to run (default: all; the bf16 arms need a CPU with bf16 "
                        "instructions to mean anything)")
    p.add_argument("--steps-scale", type=float, default=1.0,
                   help="multiply each config's timed steps (default 1: 300 CNN, 60 GPT)")
    p.add_argument("--json", help="write all measurements here (and charts.json beside it)")
    p.add_argument("--bench", default=BENCH,
                   help="the caravan_bench to measure (default build/caravan_bench; another "
                        "build's, to compare two commits)")
    p.add_argument("--replot", metavar="JSON",
                   help="run nothing: rebuild charts.json beside this --json file from it")
    a = p.parse_args()
    bench = a.bench
    if a.replot:
        with open(a.replot) as f:
            print("wrote", write_charts(json.load(f), a.replot))
        return
    if not os.path.exists(bench):
        sys.exit(f"train_throughput: {bench} missing; build it with bash scripts/test.sh first")
    environ, removed = env()

    peaks = {}
    for t in a.threads:
        for dtype in ("float32", "bf16"):
            runs = [run_json([bench, "matmul", "--size", "1024", "--threads", str(t),
                              "--dtype", dtype], environ) for _ in range(3)]
            peaks[(t, dtype)] = max(r["gflops"] for r in runs)

    def arm(name, config, steps, t):
        common = ["--config", config, "--steps", str(steps), "--warmup", "10", "--threads",
                  str(t)]
        if name.startswith("caravan"):
            precision = "bf16" if name == "caravan-bf16" else "float32"
            passive = dict(environ, OMP_WAIT_POLICY="PASSIVE") if name == "caravan-p" else environ
            return run_json([bench, "train"] + common + ["--set", f"train.precision={precision}"],
                            passive)
        return run_json(*peer_command(name, common, environ))

    rows, raw = [], []
    for config, steps in CASES:
        if config not in a.configs:
            continue
        steps = max(10, int(steps * a.steps_scale))
        for t in a.threads:
            got = {k: [] for k in a.arms}
            flops = 0.0
            for _ in range(a.repeats):  # interleaved: one run of every arm per round
                for name in a.arms:
                    r = arm(name, config, steps, t)
                    r["arm"] = name
                    got[name].append(r["samples_per_s"])
                    flops = r.get("train_flops_per_sample", flops)
                    raw.append(r)
            med = {k: statistics.median(got[k]) if k in got else float("nan") for k in ARMS}
            rows.append({"config": config, "threads": t, "median": med, "runs": got,
                         "ratios": {k: med[n] / med[d] for k, (n, d) in RATIOS.items()},
                         "gflops": {k: med[k] * flops / 1e9 for k in ("caravan", "caravan-bf16")},
                         "peak": {"float32": peaks[(t, "float32")], "bf16": peaks[(t, "bf16")]}})

    print(f"single-worker training throughput, samples/s, median of {a.repeats} interleaved "
          f"runs each; removed from the environment: {', '.join(removed) or 'nothing (not set)'}"
          f"; {PEERS_NOTE} torch {peer_version()}")
    widths = [22, 8] + [15] * len(ARMS) + [16] * len(RATIOS) + [13, 13]
    print("".join(f"{h:>{w}}" for h, w in zip(HEADER, widths)))
    for r in rows:
        print("".join(f"{str(c):>{w}}" for c, w in zip(table_row(r), widths)))
    for (t, dtype), v in sorted(peaks.items()):
        print(f"matmul peak, {t} thread(s), {dtype}: {v:.1f} GFLOP/s")
    if a.json:
        data = {"rows": rows, "raw": raw, "matmul_peak_gflops": {f"{t} {d}": v for (t, d), v
                                                                   in peaks.items()},
                "removed_env": removed, "args": vars(a)}
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
        print("wrote", write_charts(data, a.json))


if __name__ == "__main__":
    main()
