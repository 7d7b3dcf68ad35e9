#!/usr/bin/env python3
"""Memory reach of a pipeline: a model that needs 4x one worker's budget trains on K = 4 stages;
its throughput against data parallelism with out-of-core weights on 4 workers at the same
per-worker budget and the same global batch.

1. `caravan plan` on one worker (keep) prints what a step needs: weights, gradients and AdamW
   state, and the activations of the whole batch. The reach budget per worker is a quarter of
   that sum (--fraction).
2. Reach: at that budget, A (below) trains once; B is tried (the planner refuses a budget it
   cannot fit before anything runs, naming the smallest it can: that is recorded).
3. Throughput, interleaved --repeats times (A B A B), at the larger of the reach budget and the
   smallest budget B fits, so both run under the same one:
   A. pipeline: `--workers 4`, parallel.pipeline_stages = 4, parallel.partition = auto under
      the budget (the planner cuts the model so every stage fits it, counting the micro-batches
      1f1b keeps in flight), batch 32 per pipeline in 8 micro-batches;
   B. data parallelism: `--workers 4`, batch 8 per worker (global 32), all-reduce,
      memory.weights = offload (weights, gradients and optimizer state in the tier, a window of
      blocks in memory) and memory.policy = auto under the same budget.
   Each run's samples/s (median over logged windows after the first), every rank's tracked
   memory peak (metrics.jsonl rank_mem_tracked_peak) and rank 0's resident set.

    .venv/bin/python bench/pipeline_reach.py [--repeats 2] [--steps 12] [--fraction 0.25]
        [--out DIR]

Model: GPT width 512, depth 8 (10 blocks), 8 heads, vocabulary 8192 (synthetic tokens), context
64, AdamW, one thread per worker. OPENBLAS_CORETYPE is removed from every run. Both sides run 4
processes on this machine's cores.
Writes DIR/results.json (default bench/results/pipeline-reach).
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from pipeline_memory import CARAVAN, MIB, ROOT, env

MODEL = ["data.dataset=synthetic", "data.synthetic_task=tokens", "data.synthetic_size=4096",
         "data.vocab_size=8192", "data.seq_len=64", "model.name=gpt", "model.width=512",
         "model.depth=8", "model.heads=8", "optim.name=adamw", "optim.lr=0.0003",
         "train.threads=1", "train.eval_every=0", "checkpoint.every=0", "fault.timeout=300"]
BATCH = 32
WORKERS = 4


def whole_need():
    """What one worker keeping everything needs for a step of the whole batch (bytes)."""
    p = subprocess.run([CARAVAN, "plan", "--config", "/dev/null", "--set"] + MODEL +
                       [f"data.batch_size={BATCH}"], env=env(), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"caravan plan failed: {p.stderr.strip()}")
    act = re.search(r"activation peak [\d.]+ \w+ \((\d+) bytes\)", p.stdout)
    state = re.search(r"weights, gradients and optimizer state: ([\d.]+) MiB", p.stdout)
    if not act or not state:
        sys.exit(f"unexpected caravan plan output:\n{p.stdout}")
    return int(act.group(1)), float(state.group(1)) * MIB


def train(name, sets, steps, work, refusal_ok=False):
    run_dir = tempfile.mkdtemp(dir=work)
    cmd = [CARAVAN, "train", "-q", "--workers", str(WORKERS), "--config", "/dev/null",
           "--run-dir", run_dir, "--set"] + MODEL + sets + [f"train.max_steps={steps}",
                                                           "train.log_every=2"]
    p = subprocess.run(cmd, env=env(), capture_output=True, text=True)
    if p.returncode != 0:
        if refusal_ok and p.returncode == 8:
            first = p.stderr.strip().splitlines()[0]
            m = re.search(r"the smallest budget the planner can fit is [\d.]+ \w+ \((\d+) bytes\)",
                          first)
            return {"refused": first, "smallest_budget": int(m.group(1)) if m else None}
        sys.exit(f"{name}: caravan train failed ({p.returncode}): {p.stderr.strip()}")
    peaks = [0] * WORKERS
    rates, rss = [], 0
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") != "train":
                continue
            peaks = [max(a, b) for a, b in zip(peaks, r["rank_mem_tracked_peak"])]
            rss = max(rss, r.get("rss_bytes", 0))
            if r["step"] > 2:  # the first window holds the first step's allocations
                rates.append(r["samples_per_s"])
    plan = ""
    path = os.path.join(run_dir, "pipeline_plan.txt")
    if os.path.exists(path):
        with open(path) as f:
            plan = f.read()
    shutil.rmtree(run_dir)
    return {"samples_per_s": statistics.median(rates), "peak_mib": [x / MIB for x in peaks],
            "rank0_rss_mib": rss / MIB, "plan": plan}


def sides(budget):
    return {
        "pipeline K=4": [f"data.batch_size={BATCH}", "parallel.pipeline_stages=4",
                         "parallel.micro_batches=8", "parallel.schedule=1f1b",
                         "parallel.partition=auto", f"memory.budget={budget}"],
        "DP offload x4": [f"data.batch_size={BATCH // WORKERS}", "sync.mode=allreduce",
                          "memory.weights=offload", "memory.policy=auto",
                          f"memory.budget={budget}"],
    }


def show(n, r, rep):
    print(f"  {n:14s} #{rep}: {r['samples_per_s']:.2f} samples/s, rank peaks " +
          " ".join(f"{p:.1f}" for p in r["peak_mib"]) +
          f" MiB, rank 0 RSS {r['rank0_rss_mib']:.0f} MiB", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pipeline-reach"))
    a = ap.parse_args()
    print(f"cores: {os.cpu_count()}; OPENBLAS_CORETYPE removed from every run "
          f"({'set' if 'OPENBLAS_CORETYPE' in os.environ else 'not set'} in this shell)")
    activations, state = whole_need()
    need = activations + state
    budget = int(a.fraction * need)
    print(f"one worker, batch {BATCH}, keep: activations {activations / MIB:.1f} MiB + weights, "
          f"gradients and AdamW state {state / MIB:.1f} MiB = {need / MIB:.1f} MiB; budget per "
          f"worker {budget / MIB:.1f} MiB ({need / budget:.2f}x less)")
    work = tempfile.mkdtemp(prefix="pipeline-reach-")
    try:
        # Reach: the pipeline at a quarter of the need; data parallelism tried there.
        reach = sides(budget)
        pipe = train("pipeline K=4", reach["pipeline K=4"], a.steps, work)
        show("pipeline K=4", pipe, "reach")
        dp = train("DP offload x4", reach["DP offload x4"], a.steps, work, refusal_ok=True)
        if "refused" in dp:
            print(f"  DP offload x4 at {budget / MIB:.1f} MiB: refused: {dp['refused']}")
        else:
            show("DP offload x4", dp, "reach")
        common = max(budget, dp.get("smallest_budget") or 0)
        print(f"throughput at {common / MIB:.1f} MiB per worker ({need / common:.2f}x less than "
              f"one worker's need), interleaved:")
        runs = {n: [] for n in sides(common)}
        for rep in range(a.repeats):
            for n, sets in sides(common).items():
                r = train(n, sets, a.steps, work)
                runs[n].append(r)
                show(n, r, rep)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    print(f"\n| run at {common / MIB:.1f} MiB per worker | samples/s (median) | largest rank peak "
          f"MiB | within budget | rank 0 RSS MiB |")
    print("|---|---|---|---|---|")
    for n in runs:
        rate = statistics.median(r["samples_per_s"] for r in runs[n])
        peak = max(max(r["peak_mib"]) for r in runs[n])
        rss = max(r["rank0_rss_mib"] for r in runs[n])
        rows.append({"run": n, "samples_per_s_median": rate, "largest_peak_mib": peak,
                     "fits": peak <= common / MIB, "rank0_rss_mib": rss, "runs": runs[n]})
        print(f"| {n} | {rate:.2f} | {peak:.1f} | {'yes' if peak <= common / MIB else 'no'} | "
              f"{rss:.0f} |")
    ratio = rows[0]["samples_per_s_median"] / rows[1]["samples_per_s_median"]
    print(f"pipeline / DP offload throughput: {ratio:.2f}")
    print("pipeline cut at the reach budget:\n" + pipe["plan"])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"bench": "pipeline_reach", "need_bytes": need, "reach_budget_bytes": budget,
                   "activation_bytes": activations, "state_bytes": state,
                   "reach": {"pipeline": pipe, "dp_offload": dp}, "common_budget_bytes": common,
                   "rows": rows, "pipeline_over_dp_offload": ratio}, f, indent=1)
    print(f"wrote {a.out}/results.json")


if __name__ == "__main__":
    main()
