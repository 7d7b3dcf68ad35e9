#!/usr/bin/env python3
"""Reach of sharded data parallelism: the deepest GPT that trains on W = 4 workers of one host
when each worker has a fixed memory.budget (the tracked bytes: activations, and the weights,
gradients and optimizer state held in memory) and a fixed share of the machine (a memory cgroup
around the whole job of W x --worker-mib: the host tier, the allocator and LibTorch included).

Four ways to train it, each walked up the --depths grid until a depth fails (refused by the
planner, over the budget, or killed by the cgroup):
  offload           sync.shard = none, memory.weights = offload on the host tier, memory.policy
                    = auto (today's KARMA way: every worker keeps the whole model state on its
                    tier and a window of blocks in memory);
  pipeline-4        parallel.pipeline_stages = 4 (one pipeline of 4 stages, 4 micro-batches),
                    parallel.partition and memory.policy = auto under the budget;
  shard             sync.shard = parameters (ZeRO stage 3), memory.policy = auto (which plans
                    keep and recompute under sharding);
  shard+offload     sync.shard = parameters with memory.weights = offload on the host tier
                    (ZeRO-Infinity's composition: each worker's slices on its tier),
                    memory.policy = auto.
Then speed, interleaved (A B A B, --repeats): offload and shard+offload on offload's deepest
model, samples/s (the median of each run's steps after the first), and their ratio.

Without a bound on the host memory the tier is unbounded and offload alone reaches any depth:
the cgroup is the bound that makes reach a number (a node's RAM, shared by its workers).

    sudo .venv/bin/python bench/shard_reach.py [--width 384] [--budget-mib 256]
        [--worker-mib 1024] [--depths 8 12 16 ...] [--steps 3] [--repeats 2] [--out DIR]

Synthetic tokens (vocabulary 256), 6 heads, context 32, batch 2 per worker (the pipeline: 8 per
pipeline in 4 micro-batches: the same global batch), AdamW, float32, one thread per worker,
train.freed_memory_cache = 64 MiB. OPENBLAS_CORETYPE is removed from every run. Needs root for
the cgroup. Writes DIR/results.json (default bench/results/shard-2.13/reach).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_sweep import Cgroup, cgroups_available  # noqa: E402
from train_throughput import env  # noqa: E402

MIB = 1 << 20
WORKERS = 4
MODES = ["offload", "pipeline-4", "shard", "shard+offload"]


def mode_sets(mode):
    host = ["memory.weights=offload", "memory.tier=host"]
    return {
        "offload": host + ["memory.policy=auto"],
        "pipeline-4": ["parallel.pipeline_stages=4", "parallel.micro_batches=4",
                       "parallel.partition=auto", "memory.policy=auto"],
        "shard": ["sync.shard=parameters", "memory.policy=auto"],
        "shard+offload": ["sync.shard=parameters", "memory.policy=auto"] + host,
    }[mode]


def parameters(model_pt):
    """Parameters in the run's model.pt (torch.load: the export every run writes)."""
    import torch
    sd = torch.load(model_pt)
    seen, n = set(), 0
    for t in sd.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:  # a tied weight is exported under each name
            seen.add(key)
            n += t.numel()
    return n


def run(mode, depth, a, environ, tmp, tag):
    run_dir = os.path.join(tmp, tag)
    batch = a.batch * (WORKERS if mode == "pipeline-4" else 1)
    sets = ["data.dataset=synthetic", "data.synthetic_task=tokens", "data.synthetic_size=8192",
            "data.vocab_size=256", f"data.seq_len={a.context}", f"data.batch_size={batch}",
            "model.name=gpt", f"model.width={a.width}", f"model.depth={depth}",
            f"model.heads={a.heads}", "optim.name=adamw", "optim.lr=0.0003",
            f"train.max_steps={a.steps}", "train.log_every=1", "train.eval_every=0",
            "checkpoint.every=0", "train.threads=1", "train.precision=float32",
            "train.freed_memory_cache=64MiB", "dist.backend=shm", "fault.timeout=900",
            f"memory.budget={a.budget_mib}MiB", "memory.profile_repeats=1"] + mode_sets(mode)
    cmd = [CARAVAN, "train", "-q", "--config", "/dev/null", "--workers", str(WORKERS),
           "--run-dir", run_dir]
    for s in sets:
        cmd += ["--set", s]
    cgroup = Cgroup(f"caravan-reach-{os.getpid()}-{tag}", WORKERS * a.worker_mib * MIB)
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True,
                           timeout=3600, preexec_fn=cgroup.enter)
        r = {"mode": mode, "depth": depth, "rc": p.returncode, "wall_s": time.time() - t0,
             "cgroup_max_mib": cgroup.max_usage() / MIB, "oom_kills": cgroup.oom_kills()}
    finally:
        cgroup.remove()
    r["killed"] = p.returncode in (-9, 137) or r["oom_kills"] > 0
    if p.returncode == 0:
        rates, peaks = [], []
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                if rec.get("kind") == "train":
                    if rec["step"] >= 2:
                        rates.append(rec["samples_per_s"])
                    peaks.append(max(rec.get("rank_mem_tracked_peak", [rec["mem_tracked_peak"]])))
        r["samples_per_s"] = statistics.median(rates) if rates else None
        r["tracked_peak_mib"] = max(peaks) / MIB
        r["parameters"] = parameters(os.path.join(run_dir, "model.pt"))
    else:
        lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
        r["error"] = next((l for l in lines if "caravan:" in l), lines[-1] if lines else "")
    shutil.rmtree(run_dir, ignore_errors=True)
    return r


def describe(r):
    if r["rc"] == 0:
        return (f"ok: {r['parameters'] / 1e6:.1f} M parameters, {r['samples_per_s']:.2f} "
                f"samples/s, tracked peak {r['tracked_peak_mib']:.0f} MiB, cgroup "
                f"{r['cgroup_max_mib']:.0f} MiB")
    if r["killed"]:
        return f"KILLED by the cgroup ({r['cgroup_max_mib']:.0f} MiB)"
    return "failed: " + r.get("error", "")[:160]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--budget-mib", type=int, default=256)
    p.add_argument("--worker-mib", type=int, default=1024)
    p.add_argument("--depths", type=int, nargs="+",
                   default=[8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 144, 160])
    p.add_argument("--modes", nargs="+", default=MODES, choices=MODES)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--speed-depth", type=int, default=0,
                   help="skip the reach walk: only the speed runs, at this depth")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "shard-2.13", "reach"))
    a = p.parse_args()
    if not cgroups_available():
        sys.exit("shard_reach.py: needs a memory cgroup (run as root)")
    environ, removed = env()
    print(f"OPENBLAS_CORETYPE and the like removed from the runs' environment: {removed}")
    results = {"args": vars(a), "removed_env": removed, "trials": [], "speed": []}
    reach = {}
    with tempfile.TemporaryDirectory(prefix="caravan-reach-") as tmp:
        for mode in a.modes if not a.speed_depth else []:
            best = None
            for depth in a.depths:
                r = run(mode, depth, a, environ, tmp, f"{mode.replace('+', '-')}-{depth}")
                results["trials"].append(r)
                print(f"{mode:>14} depth {depth:>3}: {describe(r)}", flush=True)
                if r["rc"] != 0:
                    break
                best = r
            reach[mode] = best
        results["reach"] = reach
        base = reach.get("offload") or ({"depth": a.speed_depth} if a.speed_depth else None)
        if base and "shard+offload" in a.modes and a.repeats > 0:
            depth = base["depth"]
            for rep in range(a.repeats):
                for mode in ("offload", "shard+offload"):
                    r = run(mode, depth, a, environ, tmp, f"speed-{rep}-{mode.replace('+', '-')}")
                    results["speed"].append(r)
                    print(f"speed {rep} {mode:>14} depth {depth}: {describe(r)}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    name = f"speed-{a.speed_depth}.json" if a.speed_depth else "results.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(results, f, indent=1)
    print("\nreach (deepest that trained):")
    for mode, r in reach.items():
        print(f"  {mode:>14}: " + (f"depth {r['depth']}, {r['parameters'] / 1e6:.1f} M parameters, "
                                   f"{r['samples_per_s']:.2f} samples/s" if r else "none"))
    if reach.get("offload") and reach.get("shard+offload"):
        print(f"  shard+offload / offload parameters: "
              f"{reach['shard+offload']['parameters'] / reach['offload']['parameters']:.2f}x")
    speeds = {m: [r["samples_per_s"] for r in results["speed"] if r["mode"] == m and r["rc"] == 0]
              for m in ("offload", "shard+offload")}
    if all(speeds.values()) and results["speed"]:
        a_, b_ = statistics.median(speeds["offload"]), statistics.median(speeds["shard+offload"])
        print(f"speed at offload's deepest (depth {base['depth']}), medians of {a.repeats}: "
              f"offload {a_:.2f}, shard+offload {b_:.2f} samples/s: {b_ / a_:.2f}x")


if __name__ == "__main__":
    main()
