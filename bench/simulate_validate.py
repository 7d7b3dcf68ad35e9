#!/usr/bin/env python3
"""caravan simulate against real runs (issue 21).

    .venv/bin/python bench/simulate_validate.py \\
        --measured bench/results/sim-measured-cnn bench/results/sim-measured-gpt \\
        --calibrate fmnist-cnn:1gbit fmnist-cnn:100mbit --out bench/results/simulate

The measured runs are bench/network_sweep.py's (namespace hosts on this machine, each host's link
held to a rate by tc tbf, W workers plus S server hosts for the server modes, all sharing the
machine's cores). For each sweep this script profiles the sweep's config once (caravan simulate
-o: its workload.json), then:
  1. calibrates the cluster's two free numbers, link_efficiency (what TCP gets of the rate) and
     latency_us (a message's fixed cost), plus straggler_cv, on the --calibrate points only
     (every mode at those model:rate pairs): the grid point with the least mean absolute
     percentage error of step time;
  2. predicts every point with them and reports the error on the held-out points (everything not
     calibrated on), the ranking of the modes at each held-out model:rate (Kendall tau), and the
     predicted memory peak per worker against the runs' tracked peak;
  3. times 1024 simulated workers for 100 steps (one core: taskset -c 0), per mode.
Targets (issue 21): held-out MAPE <= 10%, Kendall tau >= 0.8, memory within 10%, 1024 workers in
under 10 s.
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts  # noqa: E402
from network_sweep import MODES, mbit  # noqa: E402  (the sweep's modes, as it ran them)


def model_name(config):
    return os.path.splitext(os.path.basename(config))[0]


def sweep_sets(args, mode):
    """The --set overrides network_sweep.py gave this mode's runs (less the loop's own keys)."""
    settings, _ = MODES[mode]
    return settings + args.get("extra", []) + [
        "train.threads=1", f"data.batch_size={args['batch']}", f"sync.servers={args['servers']}"]


def cluster_file(path, hosts, rate_mbit, efficiency, latency_us, cv):
    with open(path, "w") as f:
        f.write(f"[cluster]\nhosts = {hosts}\nlink_mbit = {rate_mbit}\ncores_per_host = 1\n"
                f"shared_cores = {os.cpu_count()}\nlink_efficiency = {efficiency}\n"
                f"latency_us = {latency_us}\nstraggler_cv = {cv}\n")


def simulate(config, sets, cluster, workers, workload=None, out=None, steps=100, extra=()):
    cmd = [CARAVAN, "simulate", "--config", config, "--cluster", cluster,
           "--workers", str(workers), "--steps", str(steps)]
    for s in sets:
        cmd += ["--set", s]
    if workload:
        cmd += ["--workload", workload]
    if out:
        cmd += ["-o", out]
    cmd += list(extra)
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"simulate_validate: {' '.join(cmd)} failed:\n{p.stderr[-800:]}")
    return p


def predict(point, params, work):
    """Predicted step seconds and memory peak of one measured point under `params`."""
    eff, lat, cv = params
    cluster = os.path.join(work, "cluster.toml")
    hosts = point["workers"] + (point["servers"] if MODES[point["mode"]][1] else 0)
    cluster_file(cluster, hosts, mbit(point["rate"]), eff, lat, cv)
    out = os.path.join(work, "pred")
    simulate(point["config"], point["sets"], cluster, point["workers"],
             workload=point["workload"], out=out, steps=60)
    with open(os.path.join(out, "predictions.jsonl")) as f:
        rec = json.loads(f.readline())
    return rec["step_s"], rec["memory_peak_bytes"]


def kendall_tau(a, b):
    pairs = list(itertools.combinations(range(len(a)), 2))
    s = sum((1 if (a[i] - a[j]) * (b[i] - b[j]) > 0 else -1 if (a[i] - a[j]) * (b[i] - b[j]) < 0
             else 0) for i, j in pairs)
    return s / len(pairs) if pairs else 1.0


def measured_points(sweep_dir, work):
    with open(os.path.join(sweep_dir, "results.json")) as f:
        res = json.load(f)
    args = res["args"]
    if args.get("colocate") or args.get("cpus"):
        sys.exit(f"simulate_validate: {sweep_dir} ran with --colocate or --cpus, which this "
                 "script does not describe as a cluster yet; use a sweep without them")
    config = os.path.join(ROOT, args["config"]) if not os.path.isabs(args["config"]) else args["config"]
    name = model_name(config)
    # The workload: profiled once, at the sweep's batch and one thread.
    wdir = os.path.join(work, f"workload-{name}")
    cluster = os.path.join(work, "profile-cluster.toml")
    cluster_file(cluster, 1, 1000, 1, 100, 0)
    simulate(config, sweep_sets(args, "allreduce"), cluster, 1, out=wdir, steps=1)
    points = []
    for key, runs in res["raw"].items():
        rate, mode = key.split("/")
        steps = [args["workers"] * args["batch"] / r["samples_per_s"] for r in runs]
        peaks = []
        for rep in range(len(runs)):
            metrics = os.path.join(sweep_dir, "runs", f"tp-{rate}-{mode}-{rep}", "metrics.jsonl")
            if os.path.exists(metrics):
                with open(metrics) as f:
                    recs = [json.loads(line) for line in f if '"kind":"train"' in line]
                if recs and "mem_tracked_peak" in recs[-1]:
                    peaks.append(recs[-1]["mem_tracked_peak"])
        points.append({"model": name, "config": config, "rate": rate, "mode": mode,
                       "workers": args["workers"], "servers": args["servers"],
                       "sets": sweep_sets(args, mode), "measured_s": statistics.median(steps),
                       "measured_peak": statistics.median(peaks) if peaks else None,
                       "workload": os.path.join(wdir, "workload.json")})
    return points


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--measured", nargs="+", required=True, help="network_sweep.py --out dirs")
    ap.add_argument("--calibrate", nargs="+", required=True,
                    help="model:rate pairs calibrated on (every mode there); the rest is held out")
    ap.add_argument("--efficiency", type=float, nargs="+",
                    default=[0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 1.0])
    ap.add_argument("--latency-us", type=float, nargs="+", default=[100, 300, 1000, 3000])
    ap.add_argument("--straggler-cv", type=float, nargs="+", default=[0.0, 0.15])
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "simulate"))
    a = ap.parse_args()
    if not os.path.exists(CARAVAN):
        sys.exit("simulate_validate: build caravan first (cmake --build build)")
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="simval-")
    points = []
    for d in a.measured:
        points += measured_points(d, work)
    calib = set(tuple(c.split(":")) for c in a.calibrate)
    for p in points:
        p["calibration"] = (p["model"], p["rate"]) in calib
    cal = [p for p in points if p["calibration"]]
    if not cal:
        sys.exit(f"simulate_validate: no measured point matches --calibrate {a.calibrate}")

    # 1. Calibrate.
    best = None
    for params in itertools.product(a.efficiency, a.latency_us, a.straggler_cv):
        errs = [abs(predict(p, params, work)[0] / p["measured_s"] - 1) for p in cal]
        mape = statistics.mean(errs)
        if best is None or mape < best[0]:
            best = (mape, params)
    cal_mape, params = best
    print(f"calibrated on {sorted(calib)}: link_efficiency {params[0]}, latency_us {params[1]}, "
          f"straggler_cv {params[2]} (calibration MAPE {100 * cal_mape:.1f}%)")

    # 2. Predict everything.
    for p in points:
        p["predicted_s"], p["predicted_peak"] = predict(p, params, work)
        p["error"] = p["predicted_s"] / p["measured_s"] - 1
    held = [p for p in points if not p["calibration"]]
    mape = statistics.mean(abs(p["error"]) for p in held) if held else float("nan")
    taus = []
    for key in sorted(set((p["model"], p["rate"]) for p in held)):
        group = [p for p in held if (p["model"], p["rate"]) == key]
        taus.append((key, kendall_tau([p["measured_s"] for p in group],
                                      [p["predicted_s"] for p in group])))
    mem = [p for p in points if p["measured_peak"]]
    mem_err = [p["predicted_peak"] / p["measured_peak"] - 1 for p in mem]

    # 3. 1024 workers, 100 steps, one core.
    timing = []
    w0 = points[0]
    cluster = os.path.join(work, "big.toml")
    cluster_file(cluster, 1025, 1000, params[0], params[1], params[2])
    for mode in ("allreduce", "ps-bsp", "ps-asp", "ps-ssp", "osp-auto", "local-sgd", "gossip"):
        cmd_extra = []
        sets = sweep_sets({"batch": int(json.load(open(w0["workload"]))["batch_per_worker"]),
                           "servers": 1, "extra": []}, mode)
        t0 = time.time()
        subprocess.run(["taskset", "-c", "0", CARAVAN, "simulate", "--config", w0["config"],
                        "--cluster", cluster, "--workers", "1024", "--steps", "100",
                        "--workload", w0["workload"]] + sum((["--set", s] for s in sets), []) +
                       cmd_extra, capture_output=True, check=True)
        timing.append((mode, time.time() - t0))

    rows = []
    for p in points:
        rows.append([p["model"], p["rate"], p["mode"], "calibration" if p["calibration"] else "held out",
                     f"{1e3 * p['measured_s']:.1f}", f"{1e3 * p['predicted_s']:.1f}",
                     f"{100 * p['error']:+.1f}%",
                     f"{p['measured_peak'] / 2**20:.1f}" if p["measured_peak"] else "-",
                     f"{p['predicted_peak'] / 2**20:.1f}" if p["predicted_peak"] else "-"])
    columns = ["model", "rate", "mode", "set", "measured step ms", "predicted ms", "error",
               "tracked peak MiB", "predicted MiB"]
    table = charts.table(columns, rows)
    md = "\n".join(["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] +
                    ["| " + " | ".join(r) + " |" for r in rows])
    lines = [md, "",
             f"calibrated on {', '.join(':'.join(c) for c in sorted(calib))}: link_efficiency "
             f"{params[0]}, latency_us {params[1]}, straggler_cv {params[2]}; calibration MAPE "
             f"{100 * cal_mape:.1f}%",
             f"held out ({len(held)} points): MAPE of step time **{100 * mape:.1f}%** (target <= 10%)"]
    for key, tau in taus:
        lines.append(f"- ranking of the modes at {key[0]} {key[1]}: Kendall tau {tau:.2f}")
    if mem_err:
        lines.append(f"memory peak per worker (rank 0's tracked peak, {len(mem)} points): error "
                     f"{100 * min(mem_err):+.1f}% to {100 * max(mem_err):+.1f}% (target within 10%)")
    for mode, secs in timing:
        lines.append(f"- 1024 workers, 100 steps, {mode}, one core: {secs:.2f} s (the whole "
                     f"caravan simulate process; target < 10 s)")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"params": params, "calibration_mape": cal_mape, "held_out_mape": mape,
                   "kendall_tau": [[list(k), t] for k, t in taus], "memory_error": mem_err,
                   "timing_1024": timing, "points": points}, f, indent=1)
    series = []
    for model in sorted(set(p["model"] for p in points)):
        pts = [p for p in points if p["model"] == model]
        series.append(charts.series(f"{model}", x=[p["measured_s"] * 1e3 for p in pts],
                                    y=[p["predicted_s"] * 1e3 for p in pts]))
    charts.write(a.out, "simulate", "caravan simulate against measured runs",
                 [charts.line("predicted-vs-measured", "Predicted against measured step time",
                              "measured step ms", "predicted step ms", series, log_x=True,
                              log_y=True)],
                 note=f"held-out MAPE {100 * mape:.1f}%", command=" ".join(sys.argv), table=table)


if __name__ == "__main__":
    main()
