#!/usr/bin/env python3
"""Where a training step's time goes, per op kind: runs `caravan_bench train --trace` (LibTorch's
autograd profiler over the timed steps) and sums each op's *self* time (its own time less the
ops it called), per step, sorted; the rest of the step (Python-free glue, waits) is the
difference to the step's wall time.

    .venv/bin/python bench/op_profile.py --config configs/brown-gpt.toml [--threads 1]
        [--steps 10] [--set KEY=VALUE ...] [--top 25] [--json OUT]
        [--peer pytorch-t|pytorch-p|compile-f32|autocast-t|compile-t]

--peer profiles PyTorch instead (bench/peer_train.py --trace under torch.profiler), in the
configuration bench/train_throughput.py runs that arm in, so the two engines' profiles can be
set side by side; --set does not apply to it.

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the environment (they slow OpenBLAS on
this CPU). The profiler adds its own cost per op (a few microseconds): compare profiles with
each other, and step times with bench/train_throughput.py.
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

import train_throughput  # the peer arms' commands and environments

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def self_times(events):
    """{name: (self microseconds, calls)} from complete events (ph X), nesting per thread."""
    by_tid = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X":
            by_tid[e["tid"]].append(e)
    total = collections.defaultdict(float)
    calls = collections.Counter()
    for evs in by_tid.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []  # [end, event, child time]
        for e in evs:
            while stack and stack[-1][0] <= e["ts"]:
                end, p, child = stack.pop()
                total[p["name"]] += p["dur"] - child
            if stack:
                stack[-1][2] += e["dur"]
            stack.append([e["ts"] + e["dur"], e, 0.0])
            calls[e["name"]] += 1
        while stack:
            end, p, child = stack.pop()
            total[p["name"]] += p["dur"] - child
    return {k: (total[k], calls[k]) for k in total}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], dest="overrides")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json")
    p.add_argument("--peer", choices=[a for a in train_throughput.ARMS
                                      if not a.startswith("caravan")],
                   help="profile this PyTorch arm (bench/train_throughput.py) instead of Caravan")
    a = p.parse_args()
    # The measured processes' environment, as bench/train_throughput.py's (Caravan chooses its
    # threads' waits; the peers get Caravan's).
    env, removed = train_throughput.env()
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        common = ["--config", a.config, "--steps", str(a.steps), "--warmup", "3", "--threads",
                  str(a.threads), "--trace", trace]
        if a.peer:
            if a.overrides:
                sys.exit("op_profile: --set applies to Caravan only; drop it with --peer")
            cmd, env = train_throughput.peer_command(a.peer, common, env)
        else:
            cmd = [os.path.join(ROOT, "build", "caravan_bench"), "train"] + common
            for o in a.overrides:
                cmd += ["--set", o]
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        if out.returncode != 0:
            sys.exit(f"op_profile: {' '.join(cmd)} failed:\n{out.stderr}")
        run = json.loads(out.stdout.strip().splitlines()[-1])
        with open(trace) as f:
            d = json.load(f)
    events = d["traceEvents"] if isinstance(d, dict) else d
    times = self_times(events)
    step_ms = 1e3 * run["seconds"] / a.steps
    rows = sorted(((n, t / a.steps / 1e3, c / a.steps) for n, (t, c) in times.items()),
                  key=lambda r: -r[1])
    print(f"{a.peer or 'caravan'}, {a.config}, {a.threads} thread(s), {a.steps} profiled steps: "
          f"{step_ms:.1f} ms per "
          f"step (profiled); removed from the environment: {', '.join(removed) or 'nothing'}")
    print(f"{'op':<48}{'self ms/step':>14}{'calls/step':>12}{'of step':>9}")
    for n, ms, c in rows[:a.top]:
        print(f"{n[:47]:<48}{ms:>14.2f}{c:>12.0f}{100 * ms / step_ms:>8.1f}%")
    # The matrix products' share and rate: the analytic FLOPs of a step (3x the forward's
    # matrix products and convolutions) over the self time of the ops that do them.
    products = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addmm_",
                "aten::mkldnn_convolution", "aten::convolution_backward",
                "aten::_convolution", "aten::conv2d"}
    product_ms = sum(ms for n, ms, _ in rows if n in products)
    line = (f"matrix products and convolutions: {product_ms:.1f} ms/step "
            f"({100 * product_ms / step_ms:.1f}% of the step)")
    if "train_flops_per_sample" in run:  # Caravan's runs count them; the peer's do not
        flops = run["train_flops_per_sample"] * run["batch_size"]
        line += (f", {flops / product_ms / 1e6:.1f} GFLOP/s over their own time "
                 f"({flops / 1e9:.2f} GFLOP a step)")
    print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "step_ms": step_ms, "product_ms": product_ms, "run": run, "removed_env": removed,
                       "ops": [{"op": n, "self_ms_per_step": ms, "calls_per_step": c}
                               for n, ms, c in rows]}, f, indent=1)


if __name__ == "__main__":
    main()
