#!/usr/bin/env python3
"""Two compute threads against one, per precision: build/caravan_bench train at each thread
count and train.precision, the arms interleaved (one run of each per round), medians of
samples/s and the ratio of the medians, plus each round's ratio.

    .venv/bin/python bench/thread_scaling.py [--config configs/brown-gpt.toml] [--rounds 4]
        [--steps 40] [--precisions bf16 float32] [--threads 1 2] [--json OUT]

The measured processes get bench/train_throughput.py's environment: OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE removed (they slow OpenBLAS on this CPU; the output says which were set), and
the thread and allocator variables (OMP_WAIT_POLICY, OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, ...)
removed so caravan chooses (core/openmp_env.h). Each run reports the OpenMP wait policy and
OpenBLAS thread count it had.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

from train_throughput import env as bench_env  # the measured processes' environment

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BENCH = os.path.join(ROOT, "build", "caravan_bench")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/brown-gpt.toml")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--precisions", nargs="+", default=["bf16", "float32"])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--bench", default=BENCH)
    p.add_argument("--json")
    a = p.parse_args()
    env, removed = bench_env()
    arms = [(prec, t) for prec in a.precisions for t in a.threads]
    got = {arm: [] for arm in arms}
    raw = []
    for r in range(a.rounds):
        for prec, t in arms:
            cmd = [a.bench, "train", "--config", a.config, "--steps", str(a.steps), "--warmup",
                   str(a.warmup), "--threads", str(t), "--set", f"train.precision={prec}"]
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                                 timeout=900)
            if out.returncode != 0:
                sys.exit(f"thread_scaling: {' '.join(cmd)} failed:\n{out.stderr}")
            run = json.loads(out.stdout.strip().splitlines()[-1])
            run.update(round=r, precision=prec)
            raw.append(run)
            got[(prec, t)].append(run["samples_per_s"])
            print(f"round {r + 1}: {prec} {t} thread(s): {run['samples_per_s']:.1f} samples/s "
                  f"(OpenMP wait policy {run.get('openmp_wait_policy')}, OpenBLAS threads "
                  f"{run.get('blas_threads')})", flush=True)
    print(f"\n{a.config}, {a.steps} steps after {a.warmup}, {a.rounds} interleaved rounds; "
          f"removed from the environment: {', '.join(removed) or 'nothing (not set)'}")
    base = min(a.threads)
    rows = []
    for prec in a.precisions:
        for t in a.threads:
            med = statistics.median(got[(prec, t)])
            ratio = med / statistics.median(got[(prec, base)])
            per_round = [x / y for x, y in zip(got[(prec, t)], got[(prec, base)])]
            rows.append({"precision": prec, "threads": t, "median": med, "runs": got[(prec, t)],
                         "ratio": ratio, "round_ratios": per_round})
            print(f"{prec:>8} {t} thread(s): median {med:7.1f} samples/s, {ratio:.2f}x "
                  f"{base} thread(s) (per round {', '.join(f'{x:.2f}' for x in per_round)})")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "raw": raw, "removed_env": removed, "args": vars(a)}, f,
                      indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
