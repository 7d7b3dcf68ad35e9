#!/usr/bin/env python3
"""Soak (issue 6): a long OSP job of 4 workers and 1 parameter server, every process's resident
memory sampled, to show that nothing deadlocks and nothing grows.

    .venv/bin/python bench/soak.py [--minutes 20] [--warmup-minutes 3] [--sample-s 10]
        [--out bench/results/soak]
    .venv/bin/python bench/soak.py --replot [--warmup-minutes 3] [--out bench/results/soak]

The job is `caravan train --workers 4` (the local launcher) on Fashion-MNIST with the CNN,
sync.mode = osp (sync.servers = 1, half the chunks in stage 2, LGP), train.max_minutes =
--minutes, with an evaluation every 200 steps and a checkpoint every 500 (so the servers'
optimizer state is collected again and again). Every --sample-s seconds the script reads
VmRSS of every caravan process of the job (/proc/PID/status) and the job's step count
(metrics.jsonl). Reported per process: RSS at the end of the warm-up, at the end, the peak
after warm-up, and the growth (end / warm-up - 1); and the steps of every minute (a deadlock
shows as a minute with none). Written: OUT/soak.json (every sample), the table on stdout and
OUT/charts.json (for `caravan report`, docs/report.md: RSS per process against time, its growth
after the warm-up, the steps in each minute, the table). --replot runs nothing: it rebuilds
OUT/charts.json from OUT/soak.json (with the run's --warmup-minutes, which soak.json records;
for an older soak.json, this command line's).
OPENBLAS_CORETYPE is removed from the job's environment; every process is single-threaded.
"""
import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts  # noqa: E402  (charts.json for caravan report)
from train_throughput import env  # noqa: E402  (the benchmark environment, shared)


def children(pid):
    """Every descendant pid of `pid` (from /proc/*/stat)."""
    parent = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                pass
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c, pp in parent.items():
            if pp == p:
                out.append(c)
                todo.append(c)
    return out


def rss_kib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def rank_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"RANK="):
                    return int(kv[5:])
    except OSError:
        return None
    return None


def steps(metrics):
    last = 0
    try:
        with open(metrics) as f:
            for line in f:
                try:
                    j = json.loads(line)
                except ValueError:
                    continue
                if j.get("kind") == "train":
                    last = j["step"]
    except OSError:
        pass
    return last


def rss_by_rank(sample):
    """A sample's {rank: RSS KiB} (soak.json's keys are strings, a live sample's ints)."""
    return {int(r): kib for r, kib in sample["rss_kib"].items()}


def summarize(data, warmup_minutes):
    """From what soak.json holds: (the table's lines, steps per minute, the largest growth
    after the warm-up, PASS), or None where no sample after the warm-up has all 5 processes.
    Growth per process is against its first sample after the warm-up."""
    samples, elapsed, code = data["samples"], data["elapsed_s"], data["exit"]
    warm = [rss_by_rank(s) for s in samples
            if s["t"] >= warmup_minutes * 60 and len(s["rss_kib"]) == 5]
    if not warm:
        return None
    lines = ["| rank | role | RSS after warm-up | RSS at the end | peak after warm-up | growth |",
             "|---|---|---|---|---|---|"]
    worst = 0.0
    for r in sorted(warm[0]):
        first, last = warm[0][r], warm[-1].get(r, 0)
        peak = max(s.get(r, 0) for s in warm)
        growth = last / first - 1.0
        worst = max(worst, growth, peak / first - 1.0)
        lines.append(f"| {r} | {'server' if r == 4 else 'worker'} | {first / 1024:.1f} MiB | "
                     f"{last / 1024:.1f} MiB | {peak / 1024:.1f} MiB | {100 * growth:+.2f}% |")
    per_minute = []
    for m in range(int(elapsed // 60)):
        inside = [s["step"] for s in samples if m * 60 <= s["t"] < (m + 1) * 60]
        if len(inside) >= 2:
            per_minute.append(inside[-1] - inside[0])
    ok = code == 0 and all(n > 0 for n in per_minute) and worst < 0.05
    return lines, per_minute, worst, ok


def write_charts(data, out, warmup_minutes):
    """OUT/charts.json for `caravan report` (docs/report.md) from what soak.json holds: every
    process's resident set against time, its growth after the warm-up, and the steps done in
    each minute (from the last sample before the minute to the last one in it, so the minutes
    add up to the run; a deadlock shows as a minute with none); the table as printed."""
    samples = data["samples"]
    t = [s["t"] / 60 for s in samples]
    ranks = sorted({r for s in samples for r in rss_by_rank(s)})
    name = lambda r: f"rank {r} ({'server' if r == 4 else 'worker'})"  # noqa: E731
    rss = [charts.series(name(r), t,
                         [rss_by_rank(s).get(r, 0) / 1024 or None for s in samples])
           for r in ranks]
    summary = summarize(data, warmup_minutes)
    # Growth after the warm-up against each process's first sample then (the table's measure).
    warm = [s for s in samples if s["t"] >= warmup_minutes * 60 and len(s["rss_kib"]) == 5]
    base = rss_by_rank(warm[0]) if warm else {}
    growth = [charts.series(name(r), [s["t"] / 60 for s in warm],
                            [100 * (rss_by_rank(s)[r] / base[r] - 1) if rss_by_rank(s).get(r)
                             else None for s in warm]) for r in sorted(base)]
    # Steps in each whole minute: from the last sample before it to the last sample in it.
    minutes, done, before = [], [], 0
    for m in range(int(data["elapsed_s"] // 60)):
        inside = [s["step"] for s in samples if s["t"] < (m + 1) * 60]
        end = inside[-1] if inside else 0
        minutes.append(str(m + 1))
        done.append(end - before)
        before = end
    last = samples[-1]["step"] if samples else 0
    every = (samples[-1]["t"] - samples[0]["t"]) / (len(samples) - 1) if len(samples) > 1 else 0
    note = (f"caravan train --workers 4 (OSP, 1 parameter server), exit {data['exit']} after "
            f"{data['elapsed_s'] / 60:.1f} min and {last} steps; resident set (VmRSS) of every "
            f"process sampled every {every:.0f} s; growth is against the first sample after "
            f"the {warmup_minutes:g}-minute warm-up.")
    if summary:
        _, per_minute, worst, ok = summary
        note += (f" Largest growth after the warm-up (end or peak over the first sample): "
                 f"{100 * worst:.2f}%. Steps per minute as printed (first to last sample "
                 "within each minute, so the steps between one minute's last sample and the "
                 f"next one's first are left out): {', '.join(map(str, per_minute))}. "
                 f"Soak: {'PASS' if ok else 'FAIL'} (exit 0, progress every minute, growth "
                 "under 5%).")
    else:
        note += " No sample after the warm-up has all 5 processes: FAIL."
    args = data.get("args")  # soak.json has them since charts.json was added
    return charts.write(
        out, "soak", "Soak: resident memory and progress of a long OSP job", [
            charts.line("rss", "Resident set per process", "minutes", "RSS (MiB)", rss),
            charts.line("rss-growth", f"Resident set after the {warmup_minutes:g}-minute warm-up, "
                        "against its first sample there", "minutes", "growth (%)", growth),
            charts.bar("steps-per-minute", "Training steps in each minute (none: stalled)",
                       minutes, [charts.series("steps", y=done)], "steps", x_label="minute"),
        ], note=note,
        command=charts.command("bench/soak.py", args) or
        "build/caravan " + " ".join(data["command"]),
        table=charts.markdown_table("\n".join(summary[0])) if summary else None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--warmup-minutes", type=float, default=3.0)
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "soak"))
    p.add_argument("--replot", action="store_true",
                   help="run nothing: rebuild OUT/charts.json from OUT/soak.json")
    a = p.parse_args()
    if a.replot:
        with open(os.path.join(a.out, "soak.json")) as f:
            data = json.load(f)
        warmup = data.get("args", {}).get("warmup_minutes", a.warmup_minutes)
        print("soak: wrote", write_charts(data, a.out, warmup))
        return
    if not os.path.exists(CARAVAN):
        sys.exit("soak: build/caravan missing; run bash scripts/setup.sh first")
    os.makedirs(a.out, exist_ok=True)
    run = os.path.join(a.out, "run")
    if os.path.exists(run):
        subprocess.run(["rm", "-rf", run], check=True)
    environ, removed = env()
    cmd = [CARAVAN, "train", "--workers", "4", "--config", os.path.join(ROOT, "configs", "fmnist-cnn.toml"),
           "--run-dir", run, "--quiet",
           "--set", "sync.mode=osp", "--set", "sync.servers=1", "--set", "sync.osp_fraction=0.5",
           "--set", "data.batch_size=32", "--set", "train.threads=1",
           "--set", "train.max_steps=100000000", "--set", f"train.max_minutes={a.minutes}",
           "--set", "train.eval_every=200", "--set", "train.eval_batches=10",
           "--set", "checkpoint.every=500", "--set", "train.log_every=20"]
    print("soak:", " ".join(cmd[1:]), f"(OPENBLAS_CORETYPE removed: {bool(removed)})", flush=True)
    start = time.time()
    job = subprocess.Popen(cmd, cwd=ROOT, env=environ)
    samples = []
    while job.poll() is None:
        time.sleep(a.sample_s)
        t = time.time() - start
        ranks = {}
        for c in children(job.pid):
            r, kib = rank_of(c), rss_kib(c)
            if r is not None and kib is not None:
                ranks[r] = kib
        samples.append({"t": t, "step": steps(os.path.join(run, "metrics.jsonl")), "rss_kib": ranks})
    code = job.wait()
    elapsed = time.time() - start
    data = {"command": cmd[1:], "exit": code, "elapsed_s": elapsed, "args": vars(a),
            "samples": samples}
    with open(os.path.join(a.out, "soak.json"), "w") as f:
        json.dump(data, f)
    print(f"soak: exit {code} after {elapsed / 60:.1f} min, {samples[-1]['step'] if samples else 0} "
          "steps", flush=True)
    summary = summarize(data, a.warmup_minutes)
    if summary is None:
        print("soak: wrote", write_charts(data, a.out, a.warmup_minutes))
        sys.exit("soak: no sample after the warm-up with all 5 processes")
    lines, per_minute, worst, ok = summary
    print("\n".join(lines))
    print(f"steps per minute (first to last sample of each minute): {per_minute}")
    print(f"largest growth after warm-up (end or peak over the first sample): {100 * worst:.2f}%")
    print("soak:", "PASS" if ok else "FAIL", "(exit 0, progress every minute, growth under 5%)")
    print("soak: wrote", write_charts(data, a.out, a.warmup_minutes))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
