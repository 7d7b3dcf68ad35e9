#!/usr/bin/env python3
"""Pipeline bubbles: the idle fraction each schedule leaves on its stages, measured by
`caravan train`, against the schedule's theory.

For each stage count K and micro-batch count M, the schedules run interleaved in one invocation
(gpipe 1f1b zb-h1 gpipe 1f1b zb-h1 ...) as `caravan train --workers K` with
parallel.pipeline_stages = K. Each train record of metrics.jsonl has every rank's compute and
wait per step (rank_compute_s: its forward and backward actions and the optimizer;
rank_sync_wait_s: blocked on its neighbours and the step's reductions; docs/metrics.md). The
measured bubble of a run is the mean over stages of wait / (compute + wait) over the records
after the warm-up; the report gives the median over repeats next to the theory:
(K-1)/(M+K-1) for gpipe and 1f1b, (K-1)/(3M+K-1) for zb-h1 (F = B = W, M >= K) — and the
step time (ms) of each schedule, which is what a user gains or loses.

    .venv/bin/python bench/pipeline_bubble.py [--stages 2 4] [--micro 4 8 16] [--repeats 2]
        [--steps 30] [--warmup 10] [--out DIR]

Model: a GPT (width 128, depth 6: 8 blocks, 4 heads, context 128, batch 32 per pipeline) on
synthetic tokens, AdamW, one thread per worker, parallel.partition = time (the fastest
balanced cut). OPENBLAS_CORETYPE is removed from every run's environment; the output says
whether it was set. On a machine with fewer cores than K the stages share cores: their waits
then include time other stages computed, and the measured bubble is not the schedule's alone
(the output prints the core count).
Writes DIR/results.json (default bench/results/pipeline).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
SCHEDULES = ["gpipe", "1f1b", "zb-h1"]
MODEL = ["data.dataset=synthetic", "data.synthetic_task=tokens", "data.synthetic_size=4096",
         "data.seq_len=128", "data.batch_size=32", "model.name=gpt", "model.width=128",
         "model.depth=6", "model.heads=4", "optim.name=adamw", "optim.lr=0.001",
         "train.threads=1", "train.eval_every=0", "checkpoint.every=0",
         "parallel.partition=time", "fault.timeout=120"]


def theory(schedule, k, m):
    if schedule == "zb-h1":
        return (k - 1) / (3 * m + k - 1) if m >= k else None
    return (k - 1) / (m + k - 1)


def run(k, m, schedule, steps, warmup, work):
    run_dir = tempfile.mkdtemp(dir=work)
    env = {key: v for key, v in os.environ.items() if key != "OPENBLAS_CORETYPE"}
    sets = MODEL + [f"parallel.pipeline_stages={k}", f"parallel.micro_batches={m}",
                    f"parallel.schedule={schedule}", f"train.max_steps={steps}",
                    f"train.log_every={warmup}"]
    cmd = [CARAVAN, "train", "-q", "--workers", str(k), "--config", "/dev/null",
           "--run-dir", run_dir, "--set"] + sets
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"caravan train failed ({p.returncode}): {p.stderr.strip()}")
    records = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "train" and r["step"] > warmup:
                records.append(r)
    shutil.rmtree(run_dir)
    compute = [statistics.mean(r["rank_compute_s"][s] for r in records) for s in range(k)]
    wait = [statistics.mean(r["rank_sync_wait_s"][s] for r in records) for s in range(k)]
    bubble = statistics.mean(w / (c + w) for c, w in zip(compute, wait))
    step_s = statistics.mean(32 / r["samples_per_s"] for r in records)
    return {"bubble": bubble, "step_s": step_s, "compute_s": compute, "wait_s": wait}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pipeline"))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="pipeline-bubble-")
    print(f"cores: {os.cpu_count()}; OPENBLAS_CORETYPE removed from every run "
          f"({'set' if 'OPENBLAS_CORETYPE' in os.environ else 'not set'} in this shell)")
    results = []
    try:
        for k in a.stages:
            for m in a.micro:
                runs = {s: [] for s in SCHEDULES}
                for rep in range(a.repeats):
                    for s in SCHEDULES:
                        r = run(k, m, s, a.steps, a.warmup, work)
                        runs[s].append(r)
                        print(f"  K={k} M={m} {s:6s} #{rep}: bubble {r['bubble']:.3f}, "
                              f"step {r['step_s'] * 1e3:.0f} ms", flush=True)
                for s in SCHEDULES:
                    results.append({"stages": k, "micro_batches": m, "schedule": s,
                                    "theory": theory(s, k, m),
                                    "bubble_median": statistics.median(r["bubble"] for r in runs[s]),
                                    "step_s_median": statistics.median(r["step_s"] for r in runs[s]),
                                    "runs": runs[s]})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| K | M | schedule | bubble measured | theory | step ms |")
    print("|---|---|---|---|---|---|")
    for r in results:
        t = f"{r['theory']:.3f}" if r["theory"] is not None else "-"
        print(f"| {r['stages']} | {r['micro_batches']} | {r['schedule']} | {r['bubble_median']:.3f} "
              f"| {t} | {r['step_s_median'] * 1e3:.0f} |")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"bench": "pipeline_bubble", "repeats": a.repeats, "steps": a.steps,
                   "warmup": a.warmup, "cores": os.cpu_count(), "results": results}, f, indent=1)
    print(f"wrote {a.out}/results.json")


if __name__ == "__main__":
    main()
