#!/usr/bin/env python3
"""What each data-parallel worker holds under sync.shard (ZeRO's stages), measured: W workers of
`caravan train --workers W` on one host (shm) train a GPT for a few steps at every level, and
each run's last train record gives the model state a worker holds after a step (mem_weights,
mem_gradients, mem_optimizer_state: the tracker's counts of the tensors themselves) and every
worker's tracked peak within a step (rank_mem_tracked_peak: activations on top of the model state,
gathered blocks included). Printed against ZeRO's accounting (Psi parameters, AdamW, float32):

    none        16 Psi           optimizer   8 Psi + 8 Psi / W
    gradients   4 Psi + 12 Psi / W           parameters  16 Psi / W

and each level's largest per-worker peak as a fraction of none's. Memory, not speed: one run per
level is the measurement (the counts are deterministic); the machine's load does not move them.

    .venv/bin/python bench/shard_memory.py [--workers 2 4] [--width 512] [--depth 16]
        [--steps 2] [--batch 2] [--seq-len 64] [--levels ...] [--json OUT]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
LEVELS = ["none", "optimizer", "gradients", "parameters"]


def formula(level, psi_bytes, w):
    """ZeRO's accounting in bytes: (weights, gradients, optimizer state) per worker."""
    p = psi_bytes
    return {
        "none": (p, p, 2 * p),
        "optimizer": (p, p, 2 * p / w),
        "gradients": (p, p / w, 2 * p / w),
        "parameters": (p / w, p / w, 2 * p / w),
    }[level]


def run(level, a, w, run_dir):
    sets = {
        "data.dataset": "synthetic", "data.synthetic_task": "tokens", "data.synthetic_size": 4096,
        "data.vocab_size": 256, "data.seq_len": a.seq_len, "data.batch_size": a.batch,
        "model.name": "gpt", "model.width": a.width, "model.depth": a.depth,
        "optim.name": "adamw", "optim.lr": 0.0003, "train.max_steps": a.steps,
        "train.log_every": 1, "train.eval_every": 0, "checkpoint.every": 0,
        "train.threads": 1, "dist.backend": "shm", "sync.shard": level,
        "fault.timeout": 600,
    }
    cmd = [CARAVAN, "train", "-q", "--config", "/dev/null", "--workers", str(w), "--run-dir",
           run_dir]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        sys.exit(f"shard_memory: {level} W={w} failed: {out.stderr.strip()}")
    last = None
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("kind") == "train":
                last = rec
    return last


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--levels", nargs="+", default=LEVELS, choices=LEVELS,
                   help="levels to run (none always runs first: the peaks' base)")
    p.add_argument("--json")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for w in a.workers:
            none_peak = None
            for level in ["none"] + [lv for lv in a.levels if lv != "none"]:
                rec = run(level, a, w, os.path.join(tmp, f"{level}-{w}"))
                if level == "none":
                    base_psi = rec["mem_weights"]  # none holds every weight: 4 Psi bytes
                    none_peak = max(rec["rank_mem_tracked_peak"])
                want = formula(level, base_psi, w)
                got = (rec["mem_weights"], rec["mem_gradients"], rec["mem_optimizer_state"])
                peak = max(rec["rank_mem_tracked_peak"])
                row = {"workers": w, "level": level, "weights": got[0], "gradients": got[1],
                       "optimizer_state": got[2], "zero_weights": want[0],
                       "zero_gradients": want[1], "zero_optimizer_state": want[2],
                       "model_state_vs_zero": sum(got) / sum(want),
                       "peak": peak, "peak_vs_none": peak / none_peak}
                results.append(row)
                print(f"W={w} {level:10s} weights {got[0] / 2**20:8.1f} MiB (ZeRO {want[0] / 2**20:8.1f}) "
                      f"gradients {got[1] / 2**20:8.1f} ({want[1] / 2**20:8.1f}) "
                      f"state {got[2] / 2**20:8.1f} ({want[2] / 2**20:8.1f}) "
                      f"model state / ZeRO {row['model_state_vs_zero']:.3f}  "
                      f"peak {peak / 2**20:8.1f} MiB = {row['peak_vs_none']:.3f} of none's",
                      flush=True)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"bench": "shard_memory", "args": vars(a), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
