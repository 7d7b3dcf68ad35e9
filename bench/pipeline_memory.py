#!/usr/bin/env python3
"""Memory balance of pipeline partitions: the time + memory partition (parallel.partition =
auto under a memory.budget) against a time-only and a parameter-count partition, for a GPT
whose embedding and head are heavy.

1. `caravan plan` prints each partition's predicted per-stage memory (weights, gradients,
   optimizer state and the micro-batches the schedule keeps in flight) for `time` and
   `parameters`, and the smallest budget any cut fits (every block keeping); the budget is that,
   rounded up to the next 0.1 MiB: the tightest a cut of this model can run in.
2. `caravan plan` with parallel.partition = auto under that budget: the joint partition (it
   fits by construction; the question is whether the time-only and parameter cuts do).
3. `caravan train --workers K` runs each of the three planned cuts (interleaved, --repeats
   times), given as split points (parallel.partition = "a,b,c": rank 0 would otherwise profile
   again at start-up, and cuts within the timing noise of each other differ from run to run),
   and reads every stage's tracked memory peak (metrics.jsonl rank_mem_tracked_peak:
   activations on top of the stage's weights, gradients and optimizer state) and the step time.
   Training runs without the budget (the point is to measure each cut's peaks; with the budget
   set the time and parameters cuts would stop at their first step).

Reports per partition: the blocks per stage, the largest and smallest stage peak measured (and
predicted), max/min, whether the largest fits the budget, and the median step time.

    .venv/bin/python bench/pipeline_memory.py [--stages 4] [--micro 8] [--repeats 2] [--steps 12]
        [--out DIR]

Model: GPT width 128, depth 6 (8 blocks), 4 heads, vocabulary 8192 (synthetic tokens), context
64, batch 32 per pipeline, AdamW, 1f1b, one thread per worker. OPENBLAS_CORETYPE is removed
from every run. With fewer cores than stages the stages share cores: step times then say little
about the partitions; memory is unaffected.
Writes DIR/results.json (default bench/results/pipeline-memory).
"""
import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
MODEL = ["data.dataset=synthetic", "data.synthetic_task=tokens", "data.synthetic_size=2048",
         "data.vocab_size=8192", "data.seq_len=64", "data.batch_size=32", "model.name=gpt",
         "model.width=128", "model.depth=6", "model.heads=4", "optim.name=adamw",
         "optim.lr=0.001", "train.threads=1", "train.eval_every=0", "checkpoint.every=0",
         "parallel.schedule=1f1b", "fault.timeout=120"]
MIB = 1 << 20


def env():
    return {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}


def parse_stages(text):
    stages = []
    for line in text.splitlines():
        m = re.match(r"\| (\d+) \| (\d+)-(\d+) .*\| ([\d.]+) \| (\d+) \| ([\d.]+)", line)
        if m:
            stages.append({"blocks": [int(m.group(2)), int(m.group(3))],
                           "ms": float(m.group(4)), "in_flight": int(m.group(5)),
                           "predicted_mib": float(m.group(6))})
    return stages


def plan(sets):
    p = subprocess.run([CARAVAN, "plan", "--config", "/dev/null", "--set"] + sets, env=env(),
                       capture_output=True, text=True)
    return p.returncode, parse_stages(p.stdout), p.stdout + p.stderr


def splits(stages):
    """The planned cut as parallel.partition's split points."""
    return ",".join(str(s["blocks"][0]) for s in stages[1:])


def train(sets, k, steps, work):
    run_dir = tempfile.mkdtemp(dir=work)
    cmd = [CARAVAN, "train", "-q", "--workers", str(k), "--config", "/dev/null", "--run-dir",
           run_dir, "--set"] + sets + [f"train.max_steps={steps}", "train.log_every=4"]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"caravan train failed ({p.returncode}): {p.stderr.strip()}")
    peaks = [0.0] * k
    step_s = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") != "train":
                continue
            peaks = [max(a, b) for a, b in zip(peaks, r["rank_mem_tracked_peak"])]
            if r["step"] > 4:
                step_s.append(32 / r["samples_per_s"])
    shutil.rmtree(run_dir)
    return {"peak_mib": [p / MIB for p in peaks], "step_s": statistics.mean(step_s)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pipeline-memory"))
    a = ap.parse_args()
    base = MODEL + [f"parallel.pipeline_stages={a.stages}", f"parallel.micro_batches={a.micro}"]
    print(f"cores: {os.cpu_count()}; OPENBLAS_CORETYPE removed from every run "
          f"({'set' if 'OPENBLAS_CORETYPE' in os.environ else 'not set'} in this shell)")
    plans = {}
    for objective in ["time", "parameters"]:
        rc, stages, out = plan(base + [f"parallel.partition={objective}"])
        if rc != 0 or len(stages) != a.stages:
            sys.exit(f"caravan plan ({objective}) failed: {out}")
        plans[objective] = stages
    least = re.search(r"the smallest per-worker budget any partition fits: ([\d.]+) MiB", out)
    if not least:
        sys.exit(f"caravan plan printed no smallest budget: {out}")
    budget_mib = math.ceil(float(least.group(1)) * 10 + 1e-9) / 10 + 0.1
    budget = f"memory.budget={int(budget_mib * MIB)}"
    rc, stages, out = plan(base + ["parallel.partition=auto", budget])
    if rc != 0 or len(stages) != a.stages:
        sys.exit(f"no joint partition fits {budget_mib:.1f} MiB per worker: {out}")
    plans["auto"] = stages
    print(f"budget: {budget_mib:.1f} MiB per worker (the smallest any cut fits, "
          f"{least.group(1)} MiB, rounded up)")
    for o, st in plans.items():
        print(f"  {o:10s} plan: " + ", ".join(
            f"blocks {s['blocks'][0]}-{s['blocks'][1]} {s['predicted_mib']:.1f} MiB" for s in st))
    work = tempfile.mkdtemp(prefix="pipeline-memory-")
    runs = {o: [] for o in plans}
    try:
        for rep in range(a.repeats):
            for o in plans:
                r = train(base + [f"parallel.partition={splits(plans[o])}"], a.stages, a.steps,
                          work)
                runs[o].append(r)
                print(f"  {o:10s} #{rep}: " + ", ".join(
                    f"blocks {s['blocks'][0]}-{s['blocks'][1]} {p:.1f} MiB (predicted "
                    f"{s['predicted_mib']:.1f})" for s, p in zip(plans[o], r["peak_mib"])) +
                      f", step {r['step_s'] * 1e3:.0f} ms", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    print(f"\n| partition | blocks per stage | largest stage MiB (predicted) | smallest | max/min | "
          f"fits {budget_mib:.1f} MiB | step ms |")
    print("|---|---|---|---|---|---|---|")
    for o in plans:
        # The row shows the run with the largest stage.
        worst = max(runs[o], key=lambda r: max(r["peak_mib"]))
        peaks = worst["peak_mib"]
        predicted = max(s["predicted_mib"] for s in plans[o])
        step = statistics.median(r["step_s"] for r in runs[o])
        blocks = " ".join(f"{s['blocks'][0]}-{s['blocks'][1]}" for s in plans[o])
        rows.append({"partition": o, "stages": plans[o], "peak_mib": peaks,
                     "max_over_min": max(peaks) / min(peaks), "step_s_median": step,
                     "fits": max(peaks) <= budget_mib, "runs": runs[o]})
        print(f"| {o} | {blocks} | {max(peaks):.1f} ({predicted:.1f}) | {min(peaks):.1f} | "
              f"{max(peaks) / min(peaks):.2f} | {'yes' if max(peaks) <= budget_mib else 'no'} | "
              f"{step * 1e3:.0f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"bench": "pipeline_memory", "budget_mib": budget_mib, "stages": a.stages,
                   "micro_batches": a.micro, "rows": rows}, f, indent=1)
    print(f"wrote {a.out}/results.json")


if __name__ == "__main__":
    main()
