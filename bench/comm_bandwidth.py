#!/usr/bin/env python3
"""All-reduce bus bandwidth: Caravan's shared-memory, Gloo and MPI communicators against raw Gloo
and raw MPI,
measured in the same process with the implementations interleaved (build/caravan_bench_comm, see
the comment at the top of bench/bench_comm.cpp). Runs the benchmark at each rank count once
per Open MPI all-reduce rule (default; MPI_Allreduce forced to the ring with
coll_tuned_use_dynamic_rules 1 + coll_tuned_allreduce_algorithm 4; and that plus
coll_libnbc_iallreduce_algorithm 1, the ring for MPI_Iallreduce, which Caravan's MPI backend
uses) and prints one markdown table per run.

    .venv/bin/python bench/comm_bandwidth.py [--ranks 2 4] [--rules default ring ring+nbc]
        [--repeats 10] [--min-bytes 1024] [--max-bytes 67108864] [--factor 4] [--json OUT]
    .venv/bin/python bench/comm_bandwidth.py --op pingpong [--ranks 2] ...
    .venv/bin/python bench/comm_bandwidth.py --replot OUT

--op pingpong measures send/recv instead (pairs of ranks, a message and its reply): the table's
GB/s is bytes / one-way time, the times are one way, and "shm / gloo" and "shm / raw mpi" compare
the shared-memory channels with Caravan's Gloo and with MPI_Send/MPI_Recv.

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the measured processes' environment;
the output says whether they were set. Bus bandwidth follows nccl-tests:
busbw = bytes / time * 2 (n - 1) / n. The memcpy column is every rank copying a buffer of the
size into another at once (GB/s copied per rank), in the same rounds: "shm / memcpy" is the
shared-memory all-reduce's bus bandwidth as a fraction of that memory bandwidth.

With --json OUT, every measurement goes to OUT and charts.json (for `caravan report`,
docs/report.md: bus bandwidth against the message size per rank count and rule, Caravan over raw
Gloo and over raw MPI_Iallreduce against the size, the tables) to the same directory.
--replot OUT runs nothing: it rebuilds that charts.json from OUT.
"""
import argparse
import json
import os
import subprocess
import sys

import charts  # charts.json for caravan report
from train_throughput import env  # the measured processes' environment

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
DEFAULT_BENCH = os.path.join(ROOT, "build", "caravan_bench_comm")
# Works as root (containers) and with more ranks than cores; no core binding (the machine is
# shared); shared memory within the host. Unlike CTest's CommMpi tests this keeps vader's
# single-copy mechanism (CMA) on: with it off, a 40 MB all-reduce took 7x longer here.
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
          "--mca", "btl", "self,vader"]
# Open MPI's all-reduce rules. MPI_Allreduce goes through coll/tuned; MPI_Iallreduce (what
# Caravan's MPI backend calls) through coll/libnbc, which has its own algorithm parameter.
TUNED_RING = ["--mca", "coll_tuned_use_dynamic_rules", "1",
              "--mca", "coll_tuned_allreduce_algorithm", "4"]
RULES = {
    "default": [],
    "ring": TUNED_RING,                       # MPI_Allreduce forced to the ring
    "ring+nbc": TUNED_RING + ["--mca", "coll_libnbc_iallreduce_algorithm", "1"],  # both
}
COLUMNS = ["caravan-shm", "caravan-gloo", "raw-gloo", "caravan-mpi", "raw-mpi-nb", "raw-mpi",
           "memcpy"]


def has_mpi(bench):
    out = subprocess.run(["ldd", bench], capture_output=True, text=True)
    return "libmpi" in out.stdout


def run(bench, ranks, rule, a, environ, with_mpi):
    if a.op == "pingpong":
        impls = ["caravan-shm", "caravan-gloo"] + (["caravan-mpi", "raw-mpi"] if with_mpi else [])
    else:
        impls = ["caravan-shm", "caravan-gloo", "raw-gloo", "memcpy"]
        if with_mpi:
            impls += ["caravan-mpi", "raw-mpi", "raw-mpi-nb"]
    args = [bench, "--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes),
            "--factor", str(a.factor), "--repeats", str(a.repeats), "--warmup", str(a.warmup),
            "--op", a.op, "--impls"] + impls
    if with_mpi:
        cmd = MPIRUN + RULES[rule] + a.mpirun_arg + ["-np", str(ranks)] + args
        procs = [subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)]
    else:  # caravan's own launcher variables; rank 0 serves the store on MASTER_PORT
        cmd = args
        procs = []
        for r in range(ranks):
            e = dict(environ, RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=str(a.port))
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=e, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=a.timeout))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        sys.exit(f"comm_bandwidth: {' '.join(cmd)} ran past {a.timeout} s")
    for p, (_, err) in zip(procs, outs):
        if p.returncode != 0:
            sys.exit(f"comm_bandwidth: {' '.join(cmd)} failed ({p.returncode}):\n{err}")
    lines = [json.loads(l) for l in outs[0][0].splitlines() if l.startswith("{")]
    info = next(l for l in lines if l["bench"] == f"{a.op}-info")
    rows = [l for l in lines if l["bench"] == a.op]
    return " ".join(cmd), info, rows


def size_label(b):
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale} {unit}"
    return f"{b} B"


def table(rows):
    by = {}
    for r in rows:
        by.setdefault(r["bytes"], {})[r["impl"]] = r
    cols = [c for c in COLUMNS if any(c in v for v in by.values())]
    head = ["size"] + [f"{c} GB/s" for c in cols]
    ratios = []
    if {"caravan-gloo", "raw-gloo"} <= set(cols):
        ratios.append(("gloo: caravan/raw", "caravan-gloo", "raw-gloo"))
    if {"caravan-shm", "caravan-gloo"} <= set(cols) and "raw-gloo" not in cols:
        ratios.append(("shm / gloo", "caravan-shm", "caravan-gloo"))
    if {"caravan-shm", "raw-gloo"} <= set(cols):
        ratios.append(("shm / raw gloo", "caravan-shm", "raw-gloo"))
    if {"caravan-shm", "raw-mpi"} <= set(cols):
        ratios.append(("shm / raw mpi", "caravan-shm", "raw-mpi"))
    if {"caravan-shm", "memcpy"} <= set(cols):
        ratios.append(("shm / memcpy", "caravan-shm", "memcpy"))
    if {"caravan-mpi", "raw-mpi"} <= set(cols):
        ratios.append(("mpi: caravan/raw", "caravan-mpi", "raw-mpi"))
    if {"caravan-mpi", "raw-mpi-nb"} <= set(cols):
        ratios.append(("mpi: caravan/raw-nb", "caravan-mpi", "raw-mpi-nb"))
    head += [r[0] for r in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in sorted(by):
        v = by[b]
        cells = [size_label(b)]
        for c in cols:
            cells.append(f"{v[c]['busbw_GBps']:.3g}" if c in v else "")
        for _, num, den in ratios:
            cells.append(f"{v[num]['busbw_GBps'] / v[den]['busbw_GBps']:.2f}"
                         if num in v and den in v else "")
        lines.append("| " + " | ".join(cells) + " |")
    times = ["| size | " + " | ".join(f"{c} us" for c in cols) + " |",
             "|" + "---|" * (len(cols) + 1)]
    for b in sorted(by):
        times.append("| " + size_label(b) + " | " + " | ".join(
            f"{by[b][c]['median_s'] * 1e6:.1f}" if c in by[b] else "" for c in cols) + " |")
    return "\n".join(lines), "\n".join(times)


def write_charts(data, path):
    """charts.json next to the --json file `path` for `caravan report` (docs/report.md), from
    what that file holds: per rank count and rule, bus bandwidth against the message size for
    every implementation (log-log); Caravan's bus bandwidth over the raw library's for Gloo and
    for MPI (against MPI_Iallreduce, what Caravan's MPI backend calls) against the size; the
    tables as printed, one row per run and size."""
    runs = data["runs"]
    sizes_of = lambda rows: sorted({r["bytes"] for r in rows})  # noqa: E731
    out, ratios = [], {"gloo": ("caravan-gloo", "raw-gloo"), "mpi": ("caravan-mpi", "raw-mpi-nb")}
    for run in runs:
        sizes = sizes_of(run["rows"])
        bw = {(r["impl"], r["bytes"]): r["busbw_GBps"] for r in run["rows"]}
        impls = [c for c in COLUMNS if any((c, b) in bw for b in sizes)]
        out.append(charts.line(
            f"busbw-{run['ranks']}-{run['rule']}",
            f"All-reduce bus bandwidth, {run['ranks']} ranks, Open MPI rule {run['rule']}",
            "message size (KiB)", "bus bandwidth (GB/s)",
            [charts.series(c, [b / 1024 for b in sizes], [bw.get((c, b)) for b in sizes])
             for c in impls], log_x=True, log_y=True))
    for lib, (num, den) in ratios.items():
        lines = []
        for run in runs:
            sizes = sizes_of(run["rows"])
            bw = {(r["impl"], r["bytes"]): r["busbw_GBps"] for r in run["rows"]}
            if not any((num, b) in bw and (den, b) in bw for b in sizes):
                continue
            lines.append(charts.series(
                f"{run['ranks']} ranks, {run['rule']}", [b / 1024 for b in sizes],
                [bw[(num, b)] / bw[(den, b)] if (num, b) in bw and (den, b) in bw and
                 bw[(den, b)] else None for b in sizes]))
        if lines:
            xs = sorted({x for s in lines for x in s["x"]})
            lines.append(charts.series("as fast", [xs[0], xs[-1]], [1.0, 1.0], dashed=True))
            out.append(charts.line(
                f"ratio-{lib}", f"{lib.upper() if lib == 'mpi' else 'Gloo'}: Caravan's bus "
                f"bandwidth over {den}'s (> 1: Caravan faster)", "message size (KiB)",
                f"{num} / {den}", lines, log_x=True))
    columns, rows = None, []
    for run in runs:
        t = charts.markdown_table(table(run["rows"])[0])
        if t is None:
            continue
        if columns is None:
            columns = ["ranks", "rule"] + t["columns"]
        if ["ranks", "rule"] + t["columns"] == columns:
            rows += [[run["ranks"], run["rule"]] + r for r in t["rows"]]
    removed = data.get("removed_env") or []
    note = ("All-reduce (sum, float32, in place), median of interleaved rounds; busbw = bytes / "
            "time * 2(n-1)/n (nccl-tests); ratio = Caravan busbw / raw busbw. Load average "
            f"before: {' '.join(data.get('load_before', [])) or 'not recorded'}; removed from "
            f"the environment: {', '.join(removed) or 'nothing (not set)'}.")
    args = data.get("args")  # the --json file has them since charts.json was added
    return charts.write(
        charts.beside(path), "comm-bandwidth",
        "Collective bus bandwidth: Caravan's communicators against raw Gloo and MPI", out,
        note=note, command=charts.command("bench/comm_bandwidth.py", args,
                                          skip=("replot", "bench"), repeated=("mpirun_arg",)),
        table=charts.table(columns, rows) if columns else None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--op", choices=["allreduce", "pingpong"], default="allreduce",
                   help="allreduce, or pingpong: send/recv between pairs of ranks")
    p.add_argument("--rules", nargs="+", choices=list(RULES),
                   default=["default", "ring", "ring+nbc"],
                   help="Open MPI all-reduce rule(s), one run each: default; ring = "
                        "MPI_Allreduce forced to the ring (coll_tuned algorithm 4); ring+nbc = "
                        "also MPI_Iallreduce (libnbc algorithm 1)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=1024)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--timeout", type=int, default=900, help="seconds per benchmark run")
    p.add_argument("--port", type=int, default=29561, help="store port without MPI")
    p.add_argument("--mpirun-arg", action="append", default=[],
                   help="extra mpirun argument (repeatable)")
    p.add_argument("--bench", default=os.environ.get("CARAVAN_BENCH_COMM", DEFAULT_BENCH))
    p.add_argument("--times", action="store_true", help="also print median times (us)")
    p.add_argument("--json", help="write all measurements here (and charts.json beside it)")
    p.add_argument("--replot", metavar="JSON",
                   help="run nothing: rebuild charts.json beside this --json file from it")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            print("wrote", write_charts(json.load(f), a.replot))
        return
    if not os.path.exists(a.bench):
        sys.exit(f"comm_bandwidth: {a.bench} missing; build the caravan_bench_comm target "
                 "(bash scripts/setup.sh)")
    environ, removed = env()
    with_mpi = has_mpi(a.bench)
    rules = a.rules if with_mpi else ["default"]
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    what = "all-reduce (sum, float32, in place)" if a.op == "allreduce" else \
        "send/recv ping-pong between pairs of ranks (one-way time)"
    print(f"{what}, median of {a.repeats} interleaved rounds after "
          f"{a.warmup} warm-up; {os.cpu_count()} CPUs, load average {' '.join(load)}; removed "
          f"from the environment: {', '.join(removed) or 'nothing (not set)'}")
    print("busbw = bytes / time * 2(n-1)/n; ratio = Caravan busbw / raw busbw (1.00 = as fast, "
          "< 1 = Caravan slower)")
    results = []
    for n in a.ranks:
        for rule in rules:
            cmd, info, rows = run(a.bench, n, rule, a, environ, with_mpi)
            results.append({"ranks": n, "rule": rule, "command": cmd, "info": info, "rows": rows})
            oversub = f", {n} ranks on {os.cpu_count()} CPUs (oversubscribed)" \
                if n > (os.cpu_count() or 1) else ""
            print(f"\n### {n} ranks, MPI_Allreduce rule: {rule}{oversub}\n\n`{cmd}`\n")
            bw, times = table(rows)
            print(bw)
            if a.times:
                print(f"\nmedian time per {'all-reduce' if a.op == 'allreduce' else 'message, one way'}"
                      " (us):\n")
                print(times)
            sys.stdout.flush()
    with open("/proc/loadavg") as f:
        print(f"\nload average after: {' '.join(f.read().split()[:3])}")
    if a.json:
        data = {"removed_env": removed, "load_before": load, "runs": results, "args": vars(a)}
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)
        print("wrote", write_charts(data, a.json))


if __name__ == "__main__":
    main()
