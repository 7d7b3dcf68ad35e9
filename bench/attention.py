#!/usr/bin/env python3
"""gpt's two attention kernels (model.attention, src/models/attention.h) against each other:
`explicit` (q k^T as one baddbmm with the causal mask, softmax, times v) and `sdpa`
(at::scaled_dot_product_attention, the fused kernel PyTorch 2.x models call), both in Caravan
(build/caravan_bench train), float32 and bf16, at 1 and 2 threads, at brown-gpt's 128 tokens
(batch 32) and at 1024 tokens (batch 4). Runs interleaved (explicit, sdpa, explicit, ...);
prints medians of samples/s and the ratio sdpa/explicit (> 1: sdpa faster).

    .venv/bin/python bench/attention.py [--repeats 3] [--threads 1 2] [--json OUT]

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the measured processes' environment
(train_throughput.env); the output says whether they were set.
"""
import argparse
import json
import os
import statistics
import sys

from train_throughput import BENCH, env, run_json

CASES = [("128 tokens, batch 32", ["--set", "data.seq_len=128", "--set", "data.batch_size=32"], 30),
         ("1024 tokens, batch 4", ["--set", "data.seq_len=1024", "--set", "data.batch_size=4"], 8)]
KERNELS = ["explicit", "sdpa"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--json", help="write every measurement here")
    a = p.parse_args()
    if not os.path.exists(BENCH):
        sys.exit(f"attention: {BENCH} missing; build it with bash scripts/test.sh first")
    environ, removed = env()
    rows = []
    for label, sets, steps in CASES:
        for precision in ("float32", "bf16"):
            for t in a.threads:
                got = {k: [] for k in KERNELS}
                for _ in range(a.repeats):
                    for kernel in KERNELS:
                        r = run_json([BENCH, "train", "--config", "configs/brown-gpt.toml",
                                      "--steps", str(steps), "--warmup", "3", "--threads", str(t),
                                      "--set", f"train.precision={precision}",
                                      "--set", f"model.attention={kernel}"] + sets, environ)
                        got[kernel].append(r["samples_per_s"])
                med = {k: statistics.median(v) for k, v in got.items()}
                rows.append({"case": label, "precision": precision, "threads": t, "median": med,
                             "runs": got, "ratio": med["sdpa"] / med["explicit"]})
    print(f"brown-gpt attention kernels, samples/s, median of {a.repeats} interleaved runs; "
          f"removed from the environment: {', '.join(removed) or 'nothing (not set)'}")
    print(f"{'case':>22}{'precision':>10}{'threads':>8}{'explicit/s':>12}{'sdpa/s':>10}"
          f"{'sdpa/explicit':>15}")
    for r in rows:
        print(f"{r['case']:>22}{r['precision']:>10}{r['threads']:>8}"
              f"{r['median']['explicit']:>12.2f}{r['median']['sdpa']:>10.2f}{r['ratio']:>15.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "removed_env": removed, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
