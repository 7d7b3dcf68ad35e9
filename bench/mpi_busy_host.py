#!/usr/bin/env python3
"""Training under mpirun on a host with as many ranks as cores: each transport's wall time for the
same job, interleaved (A B C D A B C D ...), medians and ratios to Gloo (issue 19).

    .venv/bin/python bench/mpi_busy_host.py [--ranks 2] [--steps 100] [--repeats 3]
        [--config configs/fmnist-cnn.toml] [--out DIR]

Transports, every one started by the same `mpirun -np N` (Open MPI's vader for MPI itself):
  mpi         dist.backend = mpi as shipped (caravan asks Open MPI to yield while it waits)
  mpi-spin    the same with `--mca mpi_yield_when_idle 0`: waiting ranks spin (Open MPI's default
              before caravan set it)
  gloo        dist.backend = gloo (TCP loopback; MASTER_ADDR/MASTER_PORT passed by mpirun)
  shm         dist.backend = shm (collectives through shared memory, send/recv over Gloo)
Every run trains the same steps from the same seed; the final losses are printed so a reader
sees they agree. OPENBLAS_CORETYPE is removed from the environment (the output says so);
one thread per rank.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

from train_throughput import env  # the measured processes' environment, shared

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
          "--mca", "btl", "self,vader"]
TRANSPORTS = {
    "mpi": (["dist.backend=mpi"], []),
    "mpi-spin": (["dist.backend=mpi"], ["--mca", "mpi_yield_when_idle", "0"]),
    "gloo": (["dist.backend=gloo"], []),
    "shm": (["dist.backend=shm"], []),
}


def run(name, a, run_dir, environ, port):
    sets, mca = TRANSPORTS[name]
    sets = sets + [f"train.max_steps={a.steps}", "train.threads=1", "train.eval_every=0",
                   "checkpoint.every=0"]
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = MPIRUN + mca + ["-np", str(a.ranks), "-x", "OMP_NUM_THREADS=1",
                          "-x", "OPENBLAS_NUM_THREADS=1", "-x", "MASTER_ADDR=127.0.0.1",
                          "-x", f"MASTER_PORT={port}", CARAVAN, "train", "-q", "--config",
                          a.config] + [x for s in sets for x in ("--set", s)] + \
        ["--run-dir", run_dir]
    start = time.monotonic()
    out = subprocess.run(cmd, env=environ, capture_output=True, text=True, timeout=a.timeout)
    wall = time.monotonic() - start
    if out.returncode != 0:
        sys.exit(f"mpi_busy_host: {name} failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        train = [json.loads(line) for line in f if '"kind":"train"' in line]
    return wall, train[-1]["loss"] if train else float("nan")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "fmnist-cnn.toml"))
    p.add_argument("--transports", nargs="+", default=list(TRANSPORTS), choices=list(TRANSPORTS))
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "mpi-busy-host"))
    a = p.parse_args()
    if shutil.which("mpirun") is None:
        sys.exit("mpi_busy_host: mpirun not installed (bash scripts/setup.sh installs openmpi-bin)")
    environ, removed = env()
    print(f"{a.ranks} ranks under mpirun on {os.cpu_count()} CPUs, {a.steps} steps of "
          f"{os.path.basename(a.config)}, one thread each; removed from the environment: "
          f"{', '.join(removed) or 'nothing (not set)'}", flush=True)
    walls = {t: [] for t in a.transports}
    losses = {t: [] for t in a.transports}
    port = 29571
    for k in range(a.repeats):
        for t in a.transports:
            port += 1
            wall, loss = run(t, a, os.path.join(a.out, "runs", f"{t}-{k}"), environ, port)
            walls[t].append(wall)
            losses[t].append(loss)
            print(f"repeat {k} {t:9s} {wall:7.2f} s  final loss {loss:.6f}", flush=True)
    base = statistics.median(walls["gloo"]) if "gloo" in walls else None
    lines = ["| transport | wall s (median, min-max) | vs gloo | final loss |", "|---|---|---|---|"]
    for t in a.transports:
        m = statistics.median(walls[t])
        ratio = f"{m / base:.2f}" if base else "-"
        lines.append(f"| {t} | {m:.2f} ({min(walls[t]):.2f}-{max(walls[t]):.2f}) | {ratio} | "
                     f"{losses[t][0]:.6f} |")
    table = "\n".join(lines)
    print("\n" + table)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"args": vars(a), "walls": walls, "losses": losses, "removed_env": removed}, f,
                  indent=1)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
