#!/usr/bin/env python3
"""Every synchronization mode on one host, `caravan train --workers N` (the embedded default),
with the shared-memory transport (dist.backend = auto: collectives and send/recv through shared
memory) against Gloo over TCP loopback (dist.backend = gloo), interleaved in one invocation
(auto gloo auto gloo ... per mode); medians and ratios (issue 19).

    .venv/bin/python bench/one_host_modes.py [--workers 2] [--servers 1] [--steps 200]
        [--repeats 3] [--modes ps-bsp osp gossip local-sgd allreduce pipeline]
        [--config configs/fmnist-cnn.toml] [--out DIR]

A run's step time is its training time between the first and the last train record (the
first `--skip` steps excluded: start-up, first allocations), divided by the steps between them.
Parameter-server modes (ps-*, osp) start --servers server ranks besides the workers; pipeline
runs the model as --workers stages. Every process runs one thread. OPENBLAS_CORETYPE is removed
from the measured processes' environment (the output says so). The final losses of the two
transports are printed side by side: the same seed and data give the same run where the mode's
order of operations does not depend on timing (allreduce, local-sgd, gossip, ps-bsp, pipeline).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

from train_throughput import env  # the measured processes' environment, shared

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
MODES = {
    "allreduce": [],
    "local-sgd": ["sync.mode=local-sgd", "sync.local_period=4"],
    "gossip": ["sync.mode=gossip"],
    "ps-bsp": ["sync.mode=ps-bsp"],
    "ps-asp": ["sync.mode=ps-asp"],
    "osp": ["sync.mode=osp", "sync.osp_fraction=0.5"],
    "pipeline": ["parallel.pipeline_stages={workers}"],
}
SERVED = {"ps-bsp", "ps-asp", "osp"}


def run(mode, backend, a, run_dir, environ):
    sets = [s.format(workers=a.workers) for s in MODES[mode]] + [
        f"dist.backend={backend}", f"train.max_steps={a.steps}", "train.threads=1",
        "train.eval_every=0", "checkpoint.every=0", "train.log_every=10"]
    if mode in SERVED:
        sets.append(f"sync.servers={a.servers}")
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [CARAVAN, "train", "-q", "--config", a.config, "--workers", str(a.workers),
           "--run-dir", run_dir] + [x for s in sets for x in ("--set", s)]
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=a.timeout)
    if out.returncode != 0:
        sys.exit(f"one_host_modes: {mode} on {backend} failed (exit {out.returncode}):\n"
                 f"{' '.join(cmd)}\n{out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [json.loads(l) for l in f if '"kind":"train"' in l]
    steady = [r for r in train if r["step"] > a.skip]
    if len(steady) < 2:
        sys.exit(f"one_host_modes: {mode} on {backend}: too few train records after step "
                 f"{a.skip} (raise --steps)")
    per_step = (steady[-1]["time_s"] - steady[0]["time_s"]) / (steady[-1]["step"] -
                                                               steady[0]["step"])
    return per_step, train[-1]["loss"], " ".join(cmd)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--skip", type=int, default=20, help="steps left out of the step time")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", nargs="+", default=["ps-bsp", "osp", "gossip", "local-sgd",
                                                   "allreduce", "pipeline"],
                   choices=list(MODES))
    p.add_argument("--config", default="configs/fmnist-cnn.toml")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "one-host-modes"))
    a = p.parse_args()
    environ, removed = env()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    print(f"{a.workers} workers on one host ({os.cpu_count()} CPUs, load average {load}), "
          f"{a.config}, {a.steps} steps, {a.repeats} interleaved repeats; removed from the "
          f"environment: {', '.join(removed) or 'nothing (not set)'}")
    results = {}
    for mode in a.modes:
        for i in range(a.repeats):
            for backend in ("auto", "gloo"):
                d = os.path.join(a.out, "runs", f"{mode}-{backend}-{i}")
                per_step, loss, cmd = run(mode, backend, a, d, environ)
                results.setdefault(mode, {}).setdefault(backend, []).append((per_step, loss))
                print(f"  {mode} {backend} #{i}: {per_step * 1e3:.2f} ms/step, loss {loss:.5f}",
                      flush=True)
    print("\n| mode | auto (shm) ms/step | gloo ms/step | auto / gloo (< 1: shm faster) | "
          "final loss auto | final loss gloo |")
    print("|---|---|---|---|---|---|")
    rows = []
    for mode, by in results.items():
        shm = statistics.median(t for t, _ in by["auto"])
        gloo = statistics.median(t for t, _ in by["gloo"])
        rows.append({"mode": mode, "auto_s": shm, "gloo_s": gloo, "ratio": shm / gloo,
                     "loss_auto": by["auto"][-1][1], "loss_gloo": by["gloo"][-1][1],
                     "samples": by})
        print(f"| {mode} | {shm * 1e3:.2f} | {gloo * 1e3:.2f} | {shm / gloo:.2f} | "
              f"{by['auto'][-1][1]:.5f} | {by['gloo'][-1][1]:.5f} |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"args": vars(a), "removed_env": removed, "load_before": load, "rows": rows},
                  f, indent=1)
    print("wrote", os.path.join(a.out, "results.json"))


if __name__ == "__main__":
    main()
