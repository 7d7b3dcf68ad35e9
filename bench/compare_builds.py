#!/usr/bin/env python3
"""Two builds of Caravan against each other and against the same PyTorch peer: runs
bench/train_throughput.py and bench/ddp_step.py with the old build's caravan_bench and the new
one's, alternating (old, new, old, new, ...), and prints per row the Caravan/PyTorch ratio of
each invocation and the medians, so a refactor can show its ratios unchanged within noise.

    .venv/bin/python bench/compare_builds.py OLD_BUILD NEW_BUILD [--rounds 2] [--out DIR]
        [--throughput-args "..."] [--ddp-args "..."]

Each script's own arguments (defaults below keep one round to a few minutes on 2 cores) pass
through; each invocation interleaves Caravan with PyTorch itself. OPENBLAS_CORETYPE is removed
from the measured processes by the scripts (they say so).
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def run(script, bench, extra, out):
    cmd = [sys.executable, os.path.join(ROOT, "bench", script), "--bench", bench,
           "--json", out] + shlex.split(extra)
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"compare_builds: {' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    with open(out) as f:
        return json.load(f)


def ratios(script, data):
    """{row label: Caravan/PyTorch ratio} of one invocation."""
    if script == "train_throughput.py":  # rows: [config, threads, caravan/s, pytorch/s, ratio..]
        return {f"{os.path.basename(r[0])} t={r[1]} (samples/s)": r[4] for r in data["rows"]}
    return {f"{os.path.basename(r['config'])} W={r['workers']} (step time)": r["ratio"]
            for r in data["rows"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("old", help="the old build directory (with caravan_bench)")
    p.add_argument("new", help="the new build directory")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="/tmp/caravan-compare-builds")
    p.add_argument("--throughput-args", default="--threads 1 --repeats 3")
    p.add_argument("--ddp-args", default="--workers 2 --repeats 3 --configs configs/fmnist-cnn.toml")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    builds = {"old": os.path.join(os.path.abspath(a.old), "caravan_bench"),
              "new": os.path.join(os.path.abspath(a.new), "caravan_bench")}
    for b in builds.values():
        if not os.path.exists(b):
            sys.exit(f"compare_builds: {b} missing; build the caravan_bench target there")
    for script, extra in (("train_throughput.py", a.throughput_args),
                          ("ddp_step.py", a.ddp_args)):
        seen = {"old": [], "new": []}
        for i in range(a.rounds):
            for side in ("old", "new"):  # interleaved: old, new, old, new
                out = os.path.join(a.out, f"{script[:-3]}-{side}-{i + 1}.json")
                seen[side].append(ratios(script, run(script, builds[side], extra, out)))
                print(f"  {script} {side} round {i + 1}: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in seen[side][-1].items()), flush=True)
        print(f"{script} {extra}: Caravan/PyTorch per round and median, old vs new")
        for row in seen["old"][0]:
            o = [r[row] for r in seen["old"]]
            n = [r[row] for r in seen["new"]]
            mo, mn = statistics.median(o), statistics.median(n)
            print(f"  {row:<40} old {' '.join(f'{x:.3f}' for x in o)} (median {mo:.3f})"
                  f"   new {' '.join(f'{x:.3f}' for x in n)} (median {mn:.3f})"
                  f"   new/old {mn / mo:.3f}")
    print(f"results in {a.out}")


if __name__ == "__main__":
    main()
