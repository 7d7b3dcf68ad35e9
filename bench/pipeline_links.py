#!/usr/bin/env python3
"""Pipeline against data parallelism on slow links: a GPT of width 512 and depth 16, every
worker a separate host in a network namespace (scripts/netns_hosts.sh: each host's link limited
to RATE in both directions with tc tbf), the same global batch on every side.

    .venv/bin/python bench/pipeline_links.py [--rates 1gbit 100mbit] [--repeats 1] [--steps 6]
        [--out bench/results/pipeline-links]

Sides (global batch 32, AdamW, one thread per process):
  pipeline   4 hosts: parallel.pipeline_stages = 4, 1f1b, 8 micro-batches of 4, even partition
             (16 equal layers; rank 0 does not profile the model at start-up); only activations
             and their gradients travel, between neighbouring stages
  allreduce  4 hosts, batch 8 each: every step all-reduces every gradient (ring)
  osp-auto   4 worker hosts + 1 parameter server host, batch 8 each, sync.mode = osp with the
             automatic stage-1 fraction (the OSP paper's 2-stage synchronization)
Interleaved: at each rate every side in turn, then the next rate, then the next repeat. From
rank 0's metrics.jsonl (train.log_every = 1, the first step dropped as warm-up): median
samples/s, compute and wait per step, MB sent per step by rank 0.

Needs root and iproute2 (exit 77 otherwise). OPENBLAS_CORETYPE is removed from every process's
environment. 4 or 5 processes share this machine's cores: compute includes waiting for a core.
Writes OUT/results.json and OUT/table.md at the end, OUT/partial.json after every run.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from network_sweep import ROOT, env, train_on_hosts  # noqa: E402  (the hosts, shared)

MODEL = ["data.dataset=synthetic", "data.synthetic_task=tokens", "data.synthetic_size=4096",
         "data.vocab_size=8192", "data.seq_len=64", "model.name=gpt", "model.width=512",
         "model.depth=16", "model.heads=8", "optim.name=adamw", "optim.lr=0.0003",
         "train.threads=1", "train.eval_every=0", "checkpoint.every=0", "fault.timeout=600",
         "train.log_every=1"]
GLOBAL_BATCH = 32
SIDES = {
    "pipeline": (4, [f"data.batch_size={GLOBAL_BATCH}", "parallel.pipeline_stages=4",
                     "parallel.micro_batches=8", "parallel.schedule=1f1b",
                     "parallel.partition=even"]),
    "allreduce": (4, [f"data.batch_size={GLOBAL_BATCH // 4}"]),
    "osp-auto": (5, [f"data.batch_size={GLOBAL_BATCH // 4}", "sync.mode=osp",
                     "sync.osp_auto_fraction=true", "sync.servers=1"]),
}


def run(side, rate, steps, work, timeout):
    hosts, sets = SIDES[side]
    run_dir = tempfile.mkdtemp(prefix=f"{side}-{rate}-", dir=work)
    records = train_on_hosts(hosts, rate, timeout, "/dev/null",
                             MODEL + sets + [f"train.max_steps={steps}"], run_dir,
                             f"pipeline_links: {side} at {rate}")
    train = [r for r in records if r.get("kind") == "train" and r["step"] > 1]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in train)  # noqa: E731
    shutil.rmtree(run_dir, ignore_errors=True)
    return {"samples_per_s": med("samples_per_s"), "compute_s": med("compute_s"),
            "wait_s": med("sync_wait_s"), "sent_mb": med("sent_bytes") / 1e6}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--timeout", type=int, default=1500, help="seconds per run")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "pipeline-links"))
    a = p.parse_args()
    _, removed = env()
    print(f"cores: {os.cpu_count()}; removed from every process's environment: "
          f"{', '.join(removed) or 'nothing (not set)'}", flush=True)
    work = tempfile.mkdtemp(prefix="pipeline-links-")
    raw = {(s, r): [] for s in a.sides for r in a.rates}
    try:
        for rep in range(a.repeats):
            for rate in a.rates:
                for side in a.sides:
                    x = run(side, rate, a.steps, work, a.timeout)
                    raw[(side, rate)].append(x)
                    # Every run's numbers as they come: a stopped invocation keeps them.
                    os.makedirs(a.out, exist_ok=True)
                    with open(os.path.join(a.out, "partial.json"), "w") as f:
                        json.dump([{"side": s, "rate": r, "runs": v} for (s, r), v in raw.items()
                                   if v], f, indent=1)
                    print(f"  #{rep} {rate:8s} {side:10s} {x['samples_per_s']:.2f} samples/s, "
                          f"compute {x['compute_s']:.2f} s, wait {x['wait_s']:.2f} s, "
                          f"sent {x['sent_mb']:.1f} MB per step (rank 0)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [f"GPT width 512 depth 16, global batch {GLOBAL_BATCH}, {a.steps} steps "
             f"(first dropped), {a.repeats} repeat(s); medians",
             "", "| link | side | samples/s | compute s/step | wait s/step | MB sent/step "
             "(rank 0) | vs allreduce |", "|---|---|---|---|---|---|---|"]
    rows = []
    for rate in a.rates:
        base = statistics.median(x["samples_per_s"] for x in raw[("allreduce", rate)]) \
            if ("allreduce", rate) in raw else None
        for side in a.sides:
            xs = raw[(side, rate)]
            m = {k: statistics.median(x[k] for x in xs) for k in xs[0]}
            ratio = m["samples_per_s"] / base if base else None
            rows.append({"rate": rate, "side": side, **m, "vs_allreduce": ratio, "runs": xs})
            lines.append(f"| {rate} | {side} | {m['samples_per_s']:.2f} | {m['compute_s']:.2f} | "
                         f"{m['wait_s']:.2f} | {m['sent_mb']:.1f} | "
                         f"{'-' if ratio is None else format(ratio, '.2f')} |")
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"bench": "pipeline_links", "rows": rows, "steps": a.steps,
                   "repeats": a.repeats, "removed_env": removed}, f, indent=1)
    print(f"wrote {a.out}/table.md and results.json")


if __name__ == "__main__":
    main()
