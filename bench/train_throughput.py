#!/usr/bin/python3
"""Single-worker training throughput: Caravan (build/caravan_bench) against the same model,
batch, optimizer and thread count in Python PyTorch (bench/peer_train.py), measured in the
same invocation with the runs interleaved (A B A B ...); reports medians and the ratio, plus
achieved GFLOP/s against the machine's measured float32 matmul peak.

    /usr/bin/python3 bench/train_throughput.py [--repeats 3] [--threads 1 2] [--json OUT]

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the environment of the measured
processes (they slow OpenBLAS on this CPU); the table says so.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BENCH = os.path.join(ROOT, "build", "caravan_bench")
PEER = os.path.join(ROOT, "bench", "peer_train.py")
CASES = [("configs/fmnist-cnn.toml", 300), ("configs/brown-gpt.toml", 60)]


def env():
    e = dict(os.environ)
    removed = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if e.pop(k, None) is not None]
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        e.pop(k, None)
    return e, removed


def run_json(cmd, environ):
    out = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"train_throughput: {' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--configs", nargs="+", default=[c for c, _ in CASES],
                   help="which configs to measure (default: all)")
    p.add_argument("--json", help="write all measurements here")
    a = p.parse_args()
    if not os.path.exists(BENCH):
        sys.exit("train_throughput: build/caravan_bench missing; run bash scripts/setup.sh first")
    environ, removed = env()

    peaks = {}
    for t in a.threads:
        runs = [run_json([BENCH, "matmul", "--size", "1024", "--threads", str(t)], environ)
                for _ in range(3)]
        peaks[t] = max(r["gflops"] for r in runs)

    rows, raw = [], []
    for config, steps in CASES:
        if config not in a.configs:
            continue
        for t in a.threads:
            ours, theirs, flops = [], [], 0.0
            for _ in range(a.repeats):  # interleaved: caravan, pytorch, caravan, pytorch, ...
                r = run_json([BENCH, "train", "--config", config, "--steps", str(steps),
                              "--warmup", "10", "--threads", str(t)], environ)
                ours.append(r["samples_per_s"])
                flops = r["train_flops_per_sample"]
                raw.append(r)
                q = run_json(["/usr/bin/python3", PEER, "--config", config, "--steps", str(steps),
                              "--warmup", "10", "--threads", str(t)], environ)
                theirs.append(q["samples_per_s"])
                raw.append(q)
            mo, mt = statistics.median(ours), statistics.median(theirs)
            rows.append((config, t, mo, mt, mo / mt, mo * flops / 1e9, peaks[t]))

    print(f"single-worker training throughput, median of {a.repeats} interleaved runs each; "
          f"removed from the environment: {', '.join(removed) or 'nothing (not set)'}")
    print(f"{'config':<28}{'threads':>8}{'caravan/s':>12}{'pytorch/s':>12}{'ratio':>8}"
          f"{'GFLOP/s':>10}{'mm peak':>10}{'of peak':>9}")
    for config, t, mo, mt, ratio, gf, peak in rows:
        print(f"{config:<28}{t:>8}{mo:>12.1f}{mt:>12.1f}{ratio:>8.3f}{gf:>10.1f}{peak:>10.1f}"
              f"{100 * gf / peak:>8.1f}%")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "raw": raw, "matmul_peak_gflops": peaks,
                       "removed_env": removed}, f, indent=1)


if __name__ == "__main__":
    main()
