#!/usr/bin/env python3
"""Data-parallel step time: Caravan (build/caravan_bench train, W worker processes) against
PyTorch DDP over Gloo (bench/peer_ddp.py) with the same model, per-worker batch, optimizer,
clipping, threads per worker and gradient bucket sizes, measured in the same invocation with
the runs interleaved (A B A B ...). Reports the median step time of each (per step the slowest
rank's, median over steps, then median over repeats), the ratio Caravan/PyTorch (<= 1.0: Caravan
at least as fast) and the fraction of Caravan's gradient communication hidden behind backward.

    .venv/bin/python bench/ddp_step.py [--repeats 3] [--workers 2 4] [--threads 1]
                                       [--configs ...] [--json OUT] [--bench PATH]
    variants: --caravan-args "--no-agree | --set key=value | --trace PATH",
              --caravan-env KEY=VALUE (Caravan's workers only),
              --bucket-mb M / --first-bucket-mb M (both engines)
    .venv/bin/python bench/ddp_step.py --replot OUT

With --json OUT, every measurement goes to OUT and charts.json (for `caravan report`,
docs/report.md: step time of both engines, their ratio, Caravan's communication hidden and
exposed, page faults, the table) to the same directory. --replot OUT runs nothing: it rebuilds
that charts.json from OUT.

The default invocation takes about 8 minutes on the 2-core development machine; results and
their reading are in bench/README.md.

Every worker runs on this machine and talks over loopback (127.0.0.1, GLOO_SOCKET_IFNAME=lo).
OMP_NUM_THREADS and OPENBLAS_NUM_THREADS are set to --threads for both engines (what caravan's
launcher and torchrun do); OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the measured
processes' environment and the output says whether they were set.
"""
import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import charts  # charts.json for caravan report
from train_throughput import env  # the measured processes' environment

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
PEER = os.path.join(ROOT, "bench", "peer_ddp.py")
# (config, timed steps, warm-up steps): 6-20 s of timed steps per run.
CASES = [("configs/fmnist-cnn.toml", 60, 5), ("configs/brown-gpt.toml", 16, 3)]
# The allocator settings Caravan applies to itself (train.keep_freed_memory): the peer's strongest
# configuration runs with them, and with convolutions in channels-last layout as Caravan's
# (peer_ddp.py --channels-last; --no-peer-tuned leaves that column out).
TUNED_MALLOC = "glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432"
RUN_TIMEOUT = 600


def environment(threads):
    e, removed = env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CARAVAN_LAUNCHER",
              "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS"):
        e.pop(k, None)
    e["OMP_NUM_THREADS"] = str(threads)
    e["OPENBLAS_NUM_THREADS"] = str(threads)
    e["GLOO_SOCKET_IFNAME"] = "lo"
    return e, removed


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json(text, what):
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    sys.exit(f"ddp_step: {what} printed no JSON")


def run_caravan(bench, config, workers, steps, warmup, threads, environ, extra):
    port = free_port()
    procs = []
    for r in range(workers):
        e = dict(environ, RANK=str(r), WORLD_SIZE=str(workers), LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [bench, "train", "--config", config, "--steps", str(steps), "--warmup", str(warmup),
               "--threads", str(threads)] + extra
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs, failed = [], []
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        for r, p in enumerate(procs):
            try:
                out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, err = p.communicate()
                failed.append((r, "timed out", err))
                continue
            outs.append(out)
            if p.returncode != 0:
                failed.append((r, f"exit {p.returncode}", err))
    finally:  # a failed rank, a timeout, Ctrl-C or SIGTERM: no worker outlives the driver
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    if failed:
        r, how, err = failed[0]
        sys.exit(f"ddp_step: caravan_bench rank {r} of {workers} ({config}) {how}:\n{err}")
    return last_json(outs[0], f"caravan_bench rank 0 ({config})")


def run_pytorch(config, workers, steps, warmup, threads, environ, extra):
    cmd = [sys.executable, PEER, "--config", config, "--workers", str(workers),
           "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads),
           "--port", str(free_port())] + extra
    # Its own process group, so that the spawned workers go with it on a timeout or interrupt.
    p = subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        err = "timed out"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    if p.returncode != 0:
        sys.exit(f"ddp_step: {' '.join(cmd)} failed:\n{err}")
    return last_json(out, f"peer_ddp.py ({config})")


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def write_charts(data, path):
    """charts.json next to the --json file `path` for `caravan report` (docs/report.md), from
    what that file holds: step time of Caravan and PyTorch DDP per config and worker count, the
    ratio Caravan/PyTorch (median and every interleaved pair), Caravan's gradient all-reduce
    time split into hidden behind backward and exposed, minor page faults per worker and step;
    the table as printed."""
    rows = data["rows"]
    labels = [f"{os.path.basename(r['config']).removesuffix('.toml')} W={r['workers']}"
              for r in rows]
    ms = lambda v: 1e3 * v if v is not None else None  # noqa: E731
    pairs = max((min(len(r["caravan_runs_s"]), len(r["pytorch_runs_s"])) for r in rows),
                default=0)
    ratio = [charts.series("ratio of the medians", y=[r["ratio"] for r in rows])] + [
        charts.series(f"pair {i + 1}", y=[
            r["caravan_runs_s"][i] / r["pytorch_runs_s"][i]
            if i < min(len(r["caravan_runs_s"]), len(r["pytorch_runs_s"])) else None
            for r in rows]) for i in range(pairs)]
    comm = [charts.series("hidden behind backward",
                          y=[ms(r["caravan_comm_s"] - r["caravan_exposed_s"]) for r in rows]),
            charts.series("exposed: waiting for a slower rank", y=[
                ms(r["caravan_exposed_s"] - r["caravan_exposed_after_all_backward_s"])
                for r in rows]),
            charts.series("exposed after every rank's backward",
                          y=[ms(r["caravan_exposed_after_all_backward_s"]) for r in rows])]
    table = [[r["config"], r["workers"], f"{ms(r['caravan_step_s']):.1f}",
              f"{ms(r['pytorch_step_s']):.1f}", f"{r['ratio']:.3f}",
              f"{100 * r['hidden_fraction']:.0f}%", f"{ms(r['caravan_comm_s']):.2f}",
              f"{ms(r['caravan_exposed_s']):.2f}",
              f"{ms(r['caravan_exposed_after_all_backward_s']):.2f}",
              f"{100 * r['bytes_done_during_backward_fraction']:.0f}%",
              f"{ms(r['caravan_agree_s']):.1f}",
              f"{r['caravan_minor_faults_per_step'] / r['workers']:.0f} / "
              f"{r['pytorch_minor_faults_per_step'] / r['workers']:.0f}",
              f"{r['caravan_cpu_s_per_step']:.2f} / {r['pytorch_cpu_s_per_step']:.2f}"]
             for r in rows]
    threads = data.get("threads", rows[0]["threads"] if rows else 1)
    repeats = max((len(r["caravan_runs_s"]) for r in rows), default=0)
    cores = data.get("cores")
    removed = data.get("removed_env") or []
    note = (f"W local workers of each engine on 127.0.0.1 (Gloo over loopback), {threads} "
            f"thread(s) per worker, {cores} cores; median of {repeats} interleaved runs, each the "
            "median over steps of the slowest rank's step. ratio = Caravan / PyTorch step time "
            "(<= 1.0: Caravan at least as fast). comm = union of Caravan's bucket all-reduces "
            "in flight; exposed = its part after this rank's backward ended; hid. B = share of "
            "gradient bytes whose all-reduce finished before backward ended; agree = the "
            "per-step loss/stop all-reduce (ms); faults = minor page faults per worker and "
            "step; cpu = CPU seconds per step summed over workers. Removed from the "
            f"environment: {', '.join(removed) or 'nothing (not set)'}.")
    args = data.get("args")  # the --json file has them since charts.json was added
    return charts.write(
        charts.beside(path), "ddp-step",
        "Data-parallel step time: Caravan against PyTorch DDP", [
            charts.bar("step-time", "Step time (slowest rank, median)", labels,
                       [charts.series("Caravan", y=[ms(r["caravan_step_s"]) for r in rows]),
                        charts.series("PyTorch DDP", y=[ms(r["pytorch_step_s"]) for r in rows])],
                       "ms / step", x_label="config, workers"),
            charts.bar("ratio", "Caravan / PyTorch step time (<= 1: Caravan at least as fast)",
                       labels, ratio, "ratio", x_label="config, workers"),
            charts.bar("comm", "Caravan's gradient all-reduce per step: hidden and exposed",
                       labels, comm, "ms / step", stacked=True, x_label="config, workers"),
            charts.bar("faults", "Minor page faults per worker and step", labels,
                       [charts.series("Caravan", y=[r["caravan_minor_faults_per_step"] /
                                                    r["workers"] for r in rows]),
                        charts.series("PyTorch DDP", y=[r["pytorch_minor_faults_per_step"] /
                                                        r["workers"] for r in rows])],
                       "faults (log scale)", x_label="config, workers", log_y=True),
        ], note=note,
        command=charts.command("bench/ddp_step.py", args, skip=("replot", "bench"),
                               repeated=("caravan_env",)),
        table=charts.table(["config", "W", "caravan ms", "pytorch ms", "ratio", "hidden",
                            "comm ms", "exposed ms", "exp.all ms", "hid. B", "agree ms",
                            "faults/step C/P", "cpu s/step C/P"], table))


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs the cleanup in run_caravan
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    p.add_argument("--configs", nargs="+", default=[c for c, _, _ in CASES])
    p.add_argument("--steps", type=int, help="timed steps for every config (default: per config)")
    p.add_argument("--warmup", type=int, help="warm-up steps (default: per config)")
    p.add_argument("--bench", default=os.path.join(ROOT, "build", "caravan_bench"),
                   help="the caravan_bench binary (default: build/caravan_bench)")
    p.add_argument("--caravan-args", default="",
                   help="extra caravan_bench train arguments (Caravan only), e.g. "
                        "'--no-agree' or '--set sync.first_bucket_mb=1.6'")
    p.add_argument("--bucket-mb", type=float,
                   help="gradient bucket cap for both engines (sync.bucket_mb / bucket_cap_mb)")
    p.add_argument("--first-bucket-mb", type=float,
                   help="first bucket cap for both engines (sync.first_bucket_mb / "
                        "dist._DEFAULT_FIRST_BUCKET_BYTES)")
    p.add_argument("--caravan-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable for Caravan's workers only, e.g. "
                        "GLIBC_TUNABLES=glibc.malloc.trim_threshold=268435456:"
                        "glibc.malloc.mmap_threshold=33554432")
    p.add_argument("--no-peer-tuned", action="store_true",
                   help="do not also run PyTorch with Caravan's allocator settings "
                        f"(GLIBC_TUNABLES={TUNED_MALLOC})")
    p.add_argument("--json", help="write all measurements here (and charts.json beside it)")
    p.add_argument("--replot", metavar="JSON",
                   help="run nothing: rebuild charts.json beside this --json file from it")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            print("wrote", write_charts(json.load(f), a.replot))
        return
    if not os.path.exists(a.bench):
        sys.exit(f"ddp_step: {a.bench} missing; run bash scripts/setup.sh first")
    environ, removed = environment(a.threads)
    # The peer trains in float32 (configs/brown-gpt.toml ships train.precision = bf16).
    extra = ["--set", "train.precision=float32"] + a.caravan_args.split()
    caravan_environ = dict(environ, **dict(kv.split("=", 1) for kv in a.caravan_env))
    peer_extra = []
    if a.bucket_mb is not None:
        extra += ["--set", f"sync.bucket_mb={a.bucket_mb}"]
        peer_extra += ["--bucket-mb", str(a.bucket_mb)]
    if a.first_bucket_mb is not None:
        extra += ["--set", f"sync.first_bucket_mb={a.first_bucket_mb}"]
        peer_extra += ["--first-bucket-mb", str(a.first_bucket_mb)]
    cores = os.cpu_count()
    print(f"ddp_step: {cores} cores; load average before: {loadavg()}; removed from the "
          f"environment: {', '.join(removed) or 'nothing (not set)'}", flush=True)

    rows, raw = [], []
    for config, default_steps, default_warmup in CASES:
        if config not in a.configs:
            continue
        steps = a.steps or default_steps
        warmup = a.warmup if a.warmup is not None else default_warmup
        for w in a.workers:
            ours, theirs, tuned = [], [], []
            # Interleaved: caravan, pytorch, pytorch tuned, caravan, pytorch, ...
            for rep in range(a.repeats):
                c = run_caravan(a.bench, config, w, steps, warmup, a.threads, caravan_environ,
                                extra)
                ours.append(c)
                q = run_pytorch(config, w, steps, warmup, a.threads, environ, peer_extra)
                theirs.append(q)
                line = (f"  {config} W={w} repeat {rep + 1}: caravan "
                        f"{1e3 * c['step_s_median']:.1f} ms"
                        f" (hidden {100 * c['comm']['hidden_fraction']:.0f}%), pytorch "
                        f"{1e3 * q['step_s_median']:.1f} ms")
                if not a.no_peer_tuned:
                    t = run_pytorch(config, w, steps, warmup, a.threads,
                                    dict(environ, GLIBC_TUNABLES=TUNED_MALLOC),
                                    peer_extra + ["--channels-last"])
                    tuned.append(t)
                    line += f", pytorch tuned {1e3 * t['step_s_median']:.1f} ms"
                print(f"{line}; load {loadavg()}", flush=True)
            raw += ours + theirs + tuned
            mo = statistics.median(r["step_s_median"] for r in ours)
            mt = statistics.median(r["step_s_median"] for r in theirs)
            mtt = statistics.median(r["step_s_median"] for r in tuned) if tuned else None
            med = lambda runs, f: statistics.median(f(r) for r in runs)  # noqa: E731
            rows.append({
                "config": config, "workers": w, "threads": a.threads, "steps": steps,
                "caravan_step_s": mo, "pytorch_step_s": mt, "ratio": mo / mt,
                "pytorch_tuned_step_s": mtt, "ratio_tuned": mo / mtt if mtt else None,
                "pytorch_tuned_runs_s": [r["step_s_median"] for r in tuned],
                "hidden_fraction": med(ours, lambda r: r["comm"]["hidden_fraction"]),
                "caravan_comm_s": med(ours, lambda r: r["comm"]["comm_s_median"]),
                "caravan_exposed_s": med(ours, lambda r: r["comm"]["exposed_s_median"]),
                "caravan_exposed_after_all_backward_s":
                    med(ours, lambda r: r["comm"]["exposed_after_all_backward_s_median"]),
                "caravan_sync_wait_s": med(ours, lambda r: r["phases"]["sync_wait_s"]),
                "caravan_agree_s": med(ours, lambda r: r["phases"]["agree_s"]),
                "caravan_cpu_s_per_step": med(ours, lambda r: r["cpu_s_per_step"]),
                "pytorch_cpu_s_per_step": med(theirs, lambda r: r["cpu_s_per_step"]),
                "caravan_trainer_cpu_s_per_step":
                    med(ours, lambda r: r["trainer_thread_cpu_s_per_step"]),
                "pytorch_trainer_cpu_s_per_step":
                    med(theirs, lambda r: r["trainer_thread_cpu_s_per_step"]),
                "buckets": ours[0]["comm"]["buckets_per_step"],
                "bytes_done_during_backward_fraction":
                    med(ours, lambda r: r["comm"]["bytes_done_during_backward_fraction"]),
                "caravan_minor_faults_per_step": med(ours, lambda r: r["minor_faults_per_step"]),
                "pytorch_minor_faults_per_step": med(theirs, lambda r: r["minor_faults_per_step"]),
                "caravan_runs_s": [r["step_s_median"] for r in ours],
                "pytorch_runs_s": [r["step_s_median"] for r in theirs],
            })

    over = [w for w in a.workers if w * a.threads > (cores or 1)]
    print(f"\ndata-parallel step time, {a.threads} thread(s) per worker, median of {a.repeats} "
          f"interleaved runs (each: median over steps of the slowest rank's step)"
          + (f"; {cores} cores, so W={','.join(map(str, over))} oversubscribes them"
             if over else ""))
    print(f"{'config':<24}{'W':>2}{'caravan ms':>11}{'pytorch ms':>11}{'ratio':>7}"
          f"{'pt tuned':>9}{'ratio t':>8}"
          f"{'hidden':>7}{'comm ms':>8}{'exposed':>8}{'exp.all':>8}{'hid. B':>8}{'agree':>6}"
          f"{'faults/step C/P':>17}{'cpu s/step C/P':>15}")
    for r in rows:
        print(f"{r['config']:<24}{r['workers']:>2}{1e3 * r['caravan_step_s']:>11.1f}"
              f"{1e3 * r['pytorch_step_s']:>11.1f}{r['ratio']:>7.3f}"
              + (f"{1e3 * r['pytorch_tuned_step_s']:>9.1f}{r['ratio_tuned']:>8.3f}"
                 if r["pytorch_tuned_step_s"] else f"{'-':>9}{'-':>8}") +
              f"{100 * r['hidden_fraction']:>6.0f}%{1e3 * r['caravan_comm_s']:>8.2f}"
              f"{1e3 * r['caravan_exposed_s']:>8.2f}"
              f"{1e3 * r['caravan_exposed_after_all_backward_s']:>8.2f}"
              f"{100 * r['bytes_done_during_backward_fraction']:>7.0f}%"
              f"{1e3 * r['caravan_agree_s']:>6.1f}"
              f"{r['caravan_minor_faults_per_step'] / r['workers']:>9.0f}/"
              f"{r['pytorch_minor_faults_per_step'] / r['workers']:<7.0f}"
              f"{r['caravan_cpu_s_per_step']:>7.2f}/{r['pytorch_cpu_s_per_step']:.2f}")
    print("ratio = caravan/pytorch step time (<= 1.0: Caravan at least as fast); pt tuned / "
          f"ratio t = PyTorch with GLIBC_TUNABLES={TUNED_MALLOC} (Caravan's allocator "
          "settings), its strongest configuration here\n"
          "hidden = 1 - exposed/comm; comm = union of Caravan's bucket all-reduces in flight "
          "(launch to completion), exposed = its part after backward ended, exp.all = its part "
          "after every rank's backward ended (the rest of exposed is waiting for a slower "
          "rank); medians in ms\n"
          "hid. B = share of gradient bytes whose all-reduce finished before backward ended; "
          "agree = the per-step loss/stop all-reduce (ms)\n"
          "faults = minor page faults per worker and step; cpu = CPU seconds per step summed "
          "over workers")
    print(f"load average after: {loadavg()}")
    if a.json:
        data = {"rows": rows, "raw": raw, "removed_env": removed, "cores": cores,
                "threads": a.threads, "args": vars(a)}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
        print("wrote", write_charts(data, a.json))


if __name__ == "__main__":
    main()
