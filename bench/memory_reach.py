#!/usr/bin/env python3
"""Memory reach of the stock models (tests/python/stock_models.py), exported unchanged by
`caravan export` and cut into blocks: per model, keep's tracked peak and speed, then
`memory.policy = auto` at a third of keep's activations above what persists (the budget the
policy test uses), or, where the planner refuses that, at the smallest budget it names; the
tracked peak there, the policy it chose and its speed against keep's, interleaved (keep auto
keep auto ...), medians of the repeats.

    .venv/bin/python bench/memory_reach.py [--models vit resnet mobilenet gpt2 llama nanogpt]
        [--repeats 3] [--steps 40] [--warmup 5] [--out DIR]

Every run: batches of 64 (Fashion-MNIST images, or 16 tokens of 64), SGD, one thread, the
host tier (memory.tier = host: swapped activations in this process's memory, counted on the
tier, not in the tracked peak). OPENBLAS_CORETYPE and the other variables bench/script_step.py
names are removed from every measured process's environment; the output says which were set.
Writes DIR/results.json (default bench/results/memory-reach).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

import script_step
import stock_step
from script_step import CARAVAN, ROOT


def run(config, run_dir, warmup, environ):
    """(summary, samples/s after the warm-up) of one `caravan train`; or (None, the error line)
    when Caravan refuses it."""
    shutil.rmtree(run_dir, ignore_errors=True)
    out = subprocess.run([CARAVAN, "train", "-q", "--config", config, "--run-dir", run_dir],
                         cwd=ROOT, env=environ, capture_output=True, text=True,
                         timeout=script_step.RUN_TIMEOUT)
    if out.returncode != 0:
        return None, out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "failed"
    records, summary = script_step.read_train_run(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    samples, seconds, _, _, _ = script_step.timed_samples(records, warmup, stock_step.BATCH)
    return summary, samples / seconds


def config(model, pt, threads, warmup, steps, work, name, memory):
    cfg = stock_step.caravan_config(model, pt, "auto", "float32", threads, warmup, steps)
    cfg["memory"] = dict({"tier": "host"}, **memory)
    return script_step.write_toml(cfg, os.path.join(work, f"{model}-{name}.toml"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+",
                   default=["vit", "resnet", "mobilenet", "gpt2", "llama", "nanogpt"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "memory-reach"))
    a = p.parse_args()
    environ, removed = script_step.environment()
    print(script_step.environment_note(removed, except_c=False), flush=True)
    out = os.path.abspath(a.out)
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)
    rows = []
    for model in a.models:
        pt = os.path.join(work, model + ".pt")
        exported = subprocess.run([CARAVAN, "export", os.path.join(
            ROOT, "tests", "python", "stock_models.py") + ":" + model, "-o", pt], cwd=ROOT,
            env=environ, capture_output=True, text=True)
        if exported.returncode != 0:
            sys.exit(f"memory_reach: caravan export of {model} failed: {exported.stderr.strip()}")
        keep = config(model, pt, 1, a.warmup, a.steps, work, "keep", {"policy": "keep"})
        summary, _ = run(keep, os.path.join(work, "probe"), a.warmup, environ)
        if summary is None:
            sys.exit(f"memory_reach: {model} with keep failed: {_}")
        peak, activations = summary["tracked_peak_bytes"], summary["activation_peak_bytes"]
        budget = peak - 2 * activations // 3
        auto = config(model, pt, 1, a.warmup, a.steps, work, "auto",
                      {"policy": "auto", "budget": str(budget)})
        first, why = run(auto, os.path.join(work, "probe"), a.warmup, environ)
        named = None
        if first is None:
            m = re.search(r"smallest budget (?:the planner can fit|that works for [^;]*) "
                          r"is [^(]* \((\d+) bytes", why)
            if not m:
                sys.exit(f"memory_reach: {model} at {budget} bytes: {why}")
            named, budget = why, int(m.group(1))
            auto = config(model, pt, 1, a.warmup, a.steps, work, "auto",
                          {"policy": "auto", "budget": str(budget)})
        speeds = {"keep": [], "auto": []}
        peaks = []
        policy = ""
        for rep in range(a.repeats):
            for arm, cfg in (("keep", keep), ("auto", auto)):
                s, rate = run(cfg, os.path.join(work, f"run-{arm}"), a.warmup, environ)
                if s is None:
                    sys.exit(f"memory_reach: {model} {arm} at {budget} bytes: {rate}")
                speeds[arm].append(rate)
                if arm == "auto":
                    peaks.append(s["tracked_peak_bytes"])
                    policy = s["memory_policy"]
                print(f"  {model} #{rep} {arm:<5}{rate:9.1f} samples/s, tracked peak "
                      f"{s['tracked_peak_bytes']} bytes", file=sys.stderr, flush=True)
        med = {k: statistics.median(v) for k, v in speeds.items()}
        rows.append({"model": model, "keep_peak": peak, "keep_activations": activations,
                     "budget": budget, "third_refused": named, "auto_peak_max": max(peaks),
                     "policy": policy, "median_samples_per_s": med,
                     "auto/keep": med["auto"] / med["keep"], "raw": speeds})
    lines = ["| model | keep's peak | budget | auto's peak (max) | budget/keep | speed auto/keep "
             "| policy |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['keep_peak']} | {r['budget']}"
                     f"{' (named)' if r['third_refused'] else ''} | {r['auto_peak_max']} | "
                     f"{r['budget'] / r['keep_peak']:.2f} | {r['auto/keep']:.3f} | "
                     f"{r['policy']} |")
    print("\n".join(lines))
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump({"rows": rows, "removed_env": removed, "args": vars(a)}, f, indent=1)
    print("wrote", os.path.join(out, "results.json"))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
