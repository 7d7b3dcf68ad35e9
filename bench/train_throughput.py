#!/usr/bin/python3
"""Single-worker training throughput: Caravan (build/caravan_bench) against the same model,
batch, optimizer and thread count in Python PyTorch (bench/peer_train.py), measured in the
same invocation with the runs interleaved (A B A B ...); reports medians and the ratio, plus
achieved GFLOP/s against the machine's measured float32 matmul peak.

    /usr/bin/python3 bench/train_throughput.py [--repeats 3] [--threads 1 2] [--json OUT]
                                               [--bench PATH]
    /usr/bin/python3 bench/train_throughput.py --replot OUT

With --json OUT, every measurement goes to OUT and charts.json (for `caravan report`,
docs/report.md: samples/s against threads per config, the ratio, GFLOP/s against the matmul
peak, the table) to the same directory. --replot OUT runs nothing: it rebuilds that
charts.json from OUT.

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the environment of the measured
processes (they slow OpenBLAS on this CPU); the table says so.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import charts  # charts.json for caravan report

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BENCH = os.path.join(ROOT, "build", "caravan_bench")
PEER = os.path.join(ROOT, "bench", "peer_train.py")
CASES = [("configs/fmnist-cnn.toml", 300), ("configs/brown-gpt.toml", 60)]


def env():
    e = dict(os.environ)
    removed = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if e.pop(k, None) is not None]
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        e.pop(k, None)
    return e, removed


def run_json(cmd, environ):
    out = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"train_throughput: {' '.join(cmd)} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def write_charts(data, path):
    """charts.json next to the --json file `path` for `caravan report` (docs/report.md), from
    what that file holds: per config, samples/s of Caravan and PyTorch at each thread count;
    the ratio Caravan/PyTorch; Caravan's achieved GFLOP/s against the float32 matmul peak at
    the same thread count; the table as printed."""
    # rows: [config, threads, caravan samples/s, pytorch samples/s, ratio, GFLOP/s, mm peak]
    rows = data["rows"]
    short = lambda c: os.path.basename(c).removesuffix(".toml")  # noqa: E731
    configs = list(dict.fromkeys(r[0] for r in rows))
    out = []
    for c in configs:
        mine = sorted((r for r in rows if r[0] == c), key=lambda r: r[1])
        out.append(charts.bar(
            f"throughput-{short(c)}", f"{short(c)}: training samples per second (one worker)",
            [f"{r[1]} thread{'s' if r[1] != 1 else ''}" for r in mine],
            [charts.series("Caravan", y=[r[2] for r in mine]),
             charts.series("PyTorch", y=[r[3] for r in mine])], "samples / s",
            x_label="compute threads"))
    labels = [f"{short(r[0])}, {r[1]} thread{'s' if r[1] != 1 else ''}" for r in rows]
    out.append(charts.bar("ratio", "Caravan / PyTorch samples per second (>= 1: Caravan at "
                          "least as fast)", labels,
                          [charts.series("ratio", y=[r[4] for r in rows])], "ratio",
                          x_label="config, threads"))
    out.append(charts.bar("gflops", "Caravan's training GFLOP/s against the float32 matmul peak",
                          labels, [charts.series("Caravan training", y=[r[5] for r in rows]),
                                   charts.series("1024x1024 mm peak", y=[r[6] for r in rows])],
                          "GFLOP/s", x_label="config, threads"))
    table = [[r[0], r[1], f"{r[2]:.1f}", f"{r[3]:.1f}", f"{r[4]:.3f}", f"{r[5]:.1f}",
              f"{r[6]:.1f}", f"{100 * r[5] / r[6]:.1f}%"] for r in rows]
    removed = data.get("removed_env") or []
    note = ("Single worker, interleaved runs (Caravan, PyTorch, ...), medians. GFLOP/s counts 3x "
            "the analytic forward FLOPs per example; mm peak is the best of 3 float32 1024x1024 "
            "matmuls at the same thread count. Removed from the environment: "
            f"{', '.join(removed) or 'nothing (not set)'}.")
    args = data.get("args")  # the --json file has them since charts.json was added
    return charts.write(
        charts.beside(path), "train-throughput",
        "Single-worker training throughput: Caravan against PyTorch", out, note=note,
        command=charts.command("bench/train_throughput.py", args, skip=("replot", "bench")),
        table=charts.table(["config", "threads", "caravan/s", "pytorch/s", "ratio", "GFLOP/s",
                            "mm peak", "of peak"], table))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--configs", nargs="+", default=[c for c, _ in CASES],
                   help="which configs to measure (default: all)")
    p.add_argument("--json", help="write all measurements here (and charts.json beside it)")
    p.add_argument("--bench", default=BENCH,
                   help="the caravan_bench to measure (default build/caravan_bench; another "
                        "build's, to compare two commits)")
    p.add_argument("--replot", metavar="JSON",
                   help="run nothing: rebuild charts.json beside this --json file from it")
    a = p.parse_args()
    bench = a.bench
    if a.replot:
        with open(a.replot) as f:
            print("wrote", write_charts(json.load(f), a.replot))
        return
    if not os.path.exists(bench):
        sys.exit(f"train_throughput: {bench} missing; build it with bash scripts/test.sh first")
    environ, removed = env()

    peaks = {}
    for t in a.threads:
        runs = [run_json([bench, "matmul", "--size", "1024", "--threads", str(t)], environ)
                for _ in range(3)]
        peaks[t] = max(r["gflops"] for r in runs)

    rows, raw = [], []
    for config, steps in CASES:
        if config not in a.configs:
            continue
        for t in a.threads:
            ours, theirs, flops = [], [], 0.0
            for _ in range(a.repeats):  # interleaved: caravan, pytorch, caravan, pytorch, ...
                r = run_json([bench, "train", "--config", config, "--steps", str(steps),
                              "--warmup", "10", "--threads", str(t)], environ)
                ours.append(r["samples_per_s"])
                flops = r["train_flops_per_sample"]
                raw.append(r)
                q = run_json(["/usr/bin/python3", PEER, "--config", config, "--steps", str(steps),
                              "--warmup", "10", "--threads", str(t)], environ)
                theirs.append(q["samples_per_s"])
                raw.append(q)
            mo, mt = statistics.median(ours), statistics.median(theirs)
            rows.append((config, t, mo, mt, mo / mt, mo * flops / 1e9, peaks[t]))

    print(f"single-worker training throughput, median of {a.repeats} interleaved runs each; "
          f"removed from the environment: {', '.join(removed) or 'nothing (not set)'}")
    print(f"{'config':<28}{'threads':>8}{'caravan/s':>12}{'pytorch/s':>12}{'ratio':>8}"
          f"{'GFLOP/s':>10}{'mm peak':>10}{'of peak':>9}")
    for config, t, mo, mt, ratio, gf, peak in rows:
        print(f"{config:<28}{t:>8}{mo:>12.1f}{mt:>12.1f}{ratio:>8.3f}{gf:>10.1f}{peak:>10.1f}"
              f"{100 * gf / peak:>8.1f}%")
    if a.json:
        data = {"rows": rows, "raw": raw, "matmul_peak_gflops": peaks, "removed_env": removed,
                "args": vars(a)}
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
        print("wrote", write_charts(data, a.json))


if __name__ == "__main__":
    main()
