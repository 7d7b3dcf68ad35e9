#!/usr/bin/env python3
"""parallel.layout = auto against every layout measured (issue 50).

    .venv/bin/python bench/layout_search.py [--cases fmnist-cnn brown-gpt gpt-512x16]
        [--rates 1gbit 100mbit] [--repeats 2] [--steps 40] [--out bench/results/layout-50]
    .venv/bin/python bench/layout_search.py --replot [--out ...]

For each case (a model config) and link rate, on 4 namespace hosts (scripts/netns_hosts.sh: each
host's link held to the rate by tc tbf, each host held to a CPU share of --cpus cores by a cgroup;
the 4 hosts share this machine's cores):
  1. profile the case once (`caravan simulate -o`: its workload.json, on this host, one thread);
  2. `caravan plan --cluster CLUSTER --workload ... -o layout.json`: the search's every layout with
     its prediction, and the one parallel.layout = auto runs (the first that fits);
  3. run every layout that fits for --steps steps (each with the keys the search gives it),
     interleaved: layout A, B, C, ... of every case and rate, then the next repeat;
  4. per case: each layout's measured samples/s (rank 0's train records after the first window,
     as bench/network_sweep.py counts them; the median over repeats), the chosen layout's over the
     best measured, and Kendall's tau between the predicted and the measured order.
Targets (issue 50): chosen within 10% of the best measured in every case; tau >= 0.7.

The cluster file's constants are issue 21's (bench/README.md "caravan simulate against real
runs"): link_efficiency 0.7, latency_us 2000, straggler_cv 0.15, fitted there on fmnist-cnn's
sync modes at 1 Gbit/s and 100 Mbit/s, whose steps without exchange computed ~110 ms
(straggler_step_ms 110: the cv is that step's); nothing here is fitted, so the GPT cases were never
calibrated on and the CNN's layouts (sharding, pipelines) were not either.

Written under --out: results.json (every run's numbers, the predictions), table.md.
Each run directory is kept (runs/CASE/RATE/LAYOUT-rREPEAT); a run whose model.pt exists and
that ran with the same --set keys (RUN.bench-keys.json) is reused (--fresh runs it again); one
from before that file is reused and listed in results.json's "older_runs". The run directories
are not committed (.gitignore): a measurement in --out's results.json with the same --set keys
(its "run_keys") is reused too, so a benchmark stopped part way (a session's time limit) goes on
where it stopped. OPENBLAS_CORETYPE is removed from the
measured processes' environment (bench/train_throughput.py env()); the table says so.
Needs root and iproute2 (exit 77 otherwise).
"""
import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from network_sweep import mbit, throughput_numbers, train_on_hosts  # noqa: E402
from train_throughput import env  # noqa: E402

# name -> (config, overrides). Every case runs in float32 at one thread per worker.
COMMON = ["train.threads=1", "train.precision=\"float32\"", "checkpoint.every=0",
          "fault.timeout=300", "train.eval_every=1000000", "train.eval_batches=1",
          "schedule.horizon=\"steps\"", "train.max_minutes=0"]
CASES = {
    "fmnist-cnn": ("configs/fmnist-cnn.toml", []),
    "brown-gpt": ("configs/brown-gpt.toml", []),
    # The width-512 depth-16 GPT under a budget that keeping every activation cannot meet.
    "gpt-512x16": ("configs/brown-gpt.toml",
                   ["model.width=512", "model.depth=16", "model.heads=8", "data.batch_size=8",
                    "data.seq_len=64", "memory.policy=\"auto\"", "memory.budget=\"1GiB\""]),
}
HOSTS = 4
CLUSTER = """[cluster]
hosts = {hosts}
link_mbit = {rate}
cores_per_host = {cpus}
shared_cores = {cores}
memory_gib = {memory}
latency_us = 2000
link_efficiency = 0.7
straggler_cv = 0.15
straggler_step_ms = 110
"""


def run_cmd(cmd, what):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env()[0])
    if p.returncode != 0:
        sys.exit(f"layout_search: {what} failed (exit {p.returncode}): {' '.join(cmd)}\n"
                 f"{p.stderr[-1500:]}")
    return p


def sets_args(sets):
    out = []
    for s in sets:
        out += ["--set", s]
    return out


def predictions(a, case, rate):
    """layout.json of `caravan plan --cluster` for this case and rate (profiled once per case)."""
    config, extra = CASES[case]
    sets = COMMON + extra
    base = os.path.join(a.out, case)
    os.makedirs(base, exist_ok=True)
    cluster = os.path.join(base, f"cluster-{rate}.toml")
    with open(cluster, "w") as f:
        f.write(CLUSTER.format(hosts=HOSTS, rate=mbit(rate), cpus=a.cpus, cores=os.cpu_count(),
                               memory=a.memory_gib))
    workload = os.path.join(base, "profile", "workload.json")
    if not os.path.exists(workload):
        run_cmd([CARAVAN, "simulate", "--config", config, "--cluster", cluster, "--workers",
                 str(HOSTS), "-o", os.path.join(base, "profile")] + sets_args(sets),
                f"profiling {case}")
    out = os.path.join(base, f"layout-{rate}.json")
    p = run_cmd([CARAVAN, "plan", "--config", config, "--cluster", cluster, "--workload", workload,
                 "-o", out] + sets_args(sets), f"the layout search for {case} at {rate}")
    with open(os.path.join(base, f"plan-{rate}.txt"), "w") as f:
        f.write(p.stdout + p.stderr)
    with open(out) as f:
        return json.load(f)


def slug(name):
    """A layout's name as a file name: allreduce+pipeline(2x4) -> allreduce-pipeline-2x4."""
    return "".join(ch if ch.isalnum() else "-" for ch in name).strip("-")


def run_sets(a, case, layout):
    """The --set keys of a layout's run."""
    return COMMON + CASES[case][1] + layout["keys"] + [f"train.max_steps={a.steps}",
                                                       f"train.log_every={max(1, a.steps // 8)}"]


def earlier_measurement(earlier, key, layout, repeat, sets):
    """samples/s of this repeat in an earlier results.json, where it ran with the same keys."""
    for lay in earlier.get("cases", {}).get(key, {}).get("layouts", []):
        if lay["name"] != layout["name"]:
            continue
        keys, measured = lay.get("run_keys", []), lay.get("measured", [])
        if repeat < len(keys) and repeat < len(measured) and keys[repeat] == sets:
            return measured[repeat]
    return None


def run_layout(a, case, rate, layout, repeat):
    config, _ = CASES[case]
    run_dir = os.path.join(a.out, "runs", case, rate, f"{slug(layout['name'])}-r{repeat}")
    done = os.path.join(run_dir, "model.pt")
    sets = run_sets(a, case, layout)
    # A run is reused only with the keys it ran with (bench-keys.json beside it; a run from
    # before that file is reused as it is, and counted in results.json's "older_runs").
    keys_file = run_dir + ".bench-keys.json"
    if not a.fresh and os.path.exists(done):
        if not os.path.exists(keys_file):
            a.older_runs.append(run_dir)
        elif json.load(open(keys_file)) != sets:
            done = None
        if done:
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                return [json.loads(line) for line in f]
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    records = train_on_hosts(HOSTS, rate, a.timeout, config, sets, run_dir,
                             f"layout_search: {case} {layout['name']} at {rate}", a.cpus)
    with open(keys_file, "w") as f:
        json.dump(sets, f)
    return records


def kendall_tau(xs, ys):
    """Kendall's tau-b of two equally long lists."""
    n = len(xs)
    concordant = discordant = tx = ty = 0
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                tx += 1
            elif dy == 0:
                ty += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = ((concordant + discordant + tx) * (concordant + discordant + ty)) ** 0.5
    return (concordant - discordant) / denom if denom else float("nan")


def repeatability(measured, trials=4000, seed=50):
    """How well the measurement orders the layouts itself: (the mean Kendall tau between two
    repeats' orders, over every pair of repeats; the mean tau a prediction that were the measured
    medians exactly would get against medians of as many repeats again, drawn with the runs'
    spread). `measured`: each layout's runs. The spread is the pooled sample variance of
    log(run) about each layout's mean log; the draws are lognormal about the medians. Both are
    ceilings for tau against a measurement this noisy (the second optimistic: the medians
    themselves are spread by the noise, so the layouts are taken as further apart than they
    are). (None, None) with fewer than two repeats."""
    n = min(len(m) for m in measured)
    if n < 2:
        return None, None
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    between = statistics.mean(kendall_tau([m[i] for m in measured], [m[j] for m in measured])
                              for i, j in pairs)
    squares = dof = 0.0
    for m in measured:
        logs = [math.log(v) for v in m[:n]]
        mean = statistics.mean(logs)
        squares += sum((v - mean) ** 2 for v in logs)
        dof += n - 1
    sd = math.sqrt(squares / dof)
    truth = [statistics.median(m[:n]) for m in measured]
    rng = random.Random(seed)
    drawn = statistics.mean(
        kendall_tau(truth, [statistics.median(t * math.exp(rng.gauss(0.0, sd)) for _ in range(n))
                            for t in truth]) for _ in range(trials))
    return between, drawn


def analyse(results):
    """Per case and rate: the table rows and the summary line."""
    out = []
    for key, r in results["cases"].items():
        rows = []
        for lay in r["layouts"]:
            m = lay.get("measured", [])
            rows.append({"name": lay["name"], "predicted": lay["predicted_samples_per_s"],
                         "measured": statistics.median(m) if m else None, "runs": m,
                         "memory": lay["memory_bytes"], "fits": lay["fits"]})
        measured = [x for x in rows if x["measured"] is not None]
        if not measured:
            continue
        best = max(measured, key=lambda x: x["measured"])
        chosen = next((x for x in rows if x["name"] == r["chosen"]), None)
        tau = kendall_tau([x["predicted"] for x in measured], [x["measured"] for x in measured])
        ratio = chosen["measured"] / best["measured"] if chosen and chosen["measured"] else None
        between, ceiling = repeatability([x["runs"] for x in measured])
        out.append({"case": key, "rows": rows, "best": best["name"], "chosen": r["chosen"],
                    "chosen_over_best": ratio, "tau": tau, "layouts_measured": len(measured),
                    "tau_repeat_vs_repeat": between, "tau_ceiling": ceiling})
    return out


def table(results, analysis):
    lines = [f"# parallel.layout = auto against every layout ({results['started']})", "",
             f"{HOSTS} namespace hosts, each held to {results['cpus']} cores of this machine's "
             f"{os.cpu_count()} (cgroup) and its link to the rate (tc tbf); {results['steps']} "
             f"steps per run, {results['repeats']} repeats interleaved, medians (of two: the "
             "mean); samples/s from "
             "rank 0's train records after the first window. OPENBLAS_CORETYPE unset in the "
             "measured processes. Cluster constants: issue 21's (link_efficiency 0.7, latency_us "
             "2000, straggler_cv 0.15 at straggler_step_ms 110), nothing fitted here.", ""]
    lines += ["The last two columns are the measurement's own repeatability (layout_search.py "
              "repeatability()): Kendall tau between two repeats' orders (the mean over pairs of "
              "repeats), and the mean tau the measured medians themselves would get as a "
              "prediction against medians of as many repeats again, drawn with the runs' spread "
              "(optimistic).", ""]
    lines += ["| case | chosen | best measured | chosen / best | Kendall tau | layouts | "
              "tau repeat vs repeat | tau of exact medians |",
              "|---|---|---|---|---|---|---|---|"]

    def num(v):
        return f"{v:.2f}" if v is not None else "–"
    for c in analysis:
        ratio = f"{c['chosen_over_best']:.3f}" if c["chosen_over_best"] else "–"
        lines.append(f"| {c['case']} | {c['chosen']} | {c['best']} | {ratio} | {c['tau']:.2f} | "
                     f"{c['layouts_measured']} | {num(c.get('tau_repeat_vs_repeat'))} | "
                     f"{num(c.get('tau_ceiling'))} |")
    for c in analysis:
        lines += ["", f"## {c['case']}", "",
                  "| layout | predicted samples/s | measured samples/s (median) | runs | "
                  "memory per worker (MiB) |", "|---|---|---|---|---|"]
        for x in sorted(c["rows"], key=lambda x: -(x["measured"] or 0)):
            mark = " (chosen)" if x["name"] == c["chosen"] else ""
            meas = f"{x['measured']:.1f}" if x["measured"] is not None else "not run" + (
                "" if x["fits"] else " (does not fit)")
            runs = ", ".join(f"{v:.1f}" for v in x["runs"])
            lines.append(f"| {x['name']}{mark} | {x['predicted']:.1f} | {meas} | {runs} | "
                         f"{x['memory'] / 2**20:.1f} |")
    return "\n".join(lines) + "\n"


def write(a, results):
    analysis = analyse(results)
    results["analysis"] = analysis
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = table(results, analysis)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text)
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--rates", nargs="+", default=["1gbit", "100mbit"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cpus", type=float, default=0.5, help="each host's CPU share in cores")
    p.add_argument("--memory-gib", type=float, default=5.0, help="the cluster file's memory_gib")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run at most")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "layout-50"))
    p.add_argument("--fresh", action="store_true", help="run again what was run before")
    p.add_argument("--replot", action="store_true", help="run nothing: the table from results.json")
    a = p.parse_args()
    if a.replot:
        with open(os.path.join(a.out, "results.json")) as f:
            print(write(a, json.load(f)), end="")
        return
    os.makedirs(a.out, exist_ok=True)
    a.older_runs = []
    earlier = {}
    if not a.fresh and os.path.exists(os.path.join(a.out, "results.json")):
        with open(os.path.join(a.out, "results.json")) as f:
            earlier = json.load(f)
    results = {"started": time.strftime("%Y-%m-%d %H:%M"), "steps": a.steps,
               "repeats": a.repeats, "cpus": a.cpus, "cases": {}, "older_runs": a.older_runs}
    for case in a.cases:
        for rate in a.rates:
            j = predictions(a, case, rate)
            results["cases"][f"{case} at {rate}"] = {
                "case": case, "rate": rate, "chosen": j["chosen"]["name"],
                "search": j, "layouts": [dict(x, measured=[], run_keys=[]) for x in j["layouts"]]}
    write(a, results)
    for repeat in range(a.repeats):
        for key, r in results["cases"].items():
            for lay in r["layouts"]:
                if not lay["fits"]:
                    continue
                start = time.time()
                sets = run_sets(a, r["case"], lay)
                rate = earlier_measurement(earlier, key, lay, repeat, sets)
                how = "from the earlier results.json"
                if rate is None:
                    records = run_layout(a, r["case"], r["rate"], lay, repeat)
                    rate = throughput_numbers(records)["samples_per_s"]
                    how = f"{time.time() - start:.0f} s"
                lay["measured"].append(rate)
                lay["run_keys"].append(sets)
                print(f"[r{repeat}] {key}: {lay['name']}: {rate:.1f} samples/s (predicted "
                      f"{lay['predicted_samples_per_s']:.1f}; {how})", flush=True)
                write(a, results)
    print(write(a, results), end="")


if __name__ == "__main__":
    main()
