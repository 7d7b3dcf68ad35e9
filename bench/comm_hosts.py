#!/usr/bin/env python3
"""All-reduce between hosts: hierarchical (dist.backend = auto) against flat Gloo, and striping
(dist.connections) against one connection, on network-namespace hosts joined by rate-limited
links (scripts/netns_hosts.sh: veth pairs to a bridge, tc tbf on both ends of each host's link).

Each host runs --ranks-per-host processes of build/caravan_bench_comm (ranks 2h, 2h + 1, ...;
rank 0's host serves the store); the implementations are interleaved within one invocation per
link rate (A B C A B C ..., bench/bench_comm.cpp):
  caravan-gloo      flat Gloo ring over every rank, one connection per pair
  caravan-gloo-xN   the same, striped over N connections
  caravan-auto      hierarchical: shared memory inside each host, Gloo between the leaders
  caravan-auto-xN   the same, the leaders' Gloo striped over N connections
  raw-gloo          gloo::allreduce on a raw context, flat

Reported per size: median time, and the link use: the bytes each host must send over its link
per all-reduce at the least (a ring over the hosts: size x 2(h-1)/h) over time and link rate.
The hierarchical all-reduce sends exactly that; a flat ring over every rank sends more over each
host's link (its ring crosses each host boundary with a full rank's share: size x 2(n-1)/n).

    sudo .venv/bin/python bench/comm_hosts.py [--hosts 2] [--ranks-per-host 2]
        [--rates 1gbit 300mbit] [--connections 2] [--min-bytes 1048576]
        [--max-bytes 67108864] [--repeats 3] [--out DIR]

Needs root (namespaces). OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE are removed from the measured
processes' environment; the output says whether they were set.
"""
import argparse
import json
import os
import re
import subprocess
import sys

from train_throughput import env  # the measured processes' environment

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BENCH = os.path.join(ROOT, "build", "caravan_bench_comm")
NETNS = os.path.join(ROOT, "scripts", "netns_hosts.sh")


def rate_bytes_per_s(rate):
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(k|m|g)bit", rate)
    if not m:
        sys.exit(f"comm_hosts: --rates takes tc rates such as 1gbit or 300mbit, got {rate}")
    return float(m.group(1)) * {"k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] / 8


def size_label(b):
    for unit, scale in (("MB", 1 << 20), ("KB", 1 << 10)):
        if b >= scale and b % scale == 0:
            return f"{b // scale} {unit}"
    return f"{b} B"


def run(a, rate, environ, outdir):
    impls = ["caravan-gloo", f"caravan-gloo-x{a.connections}", "caravan-auto",
             f"caravan-auto-x{a.connections}", "raw-gloo"]
    n = a.hosts * a.ranks_per_host
    log = os.path.join(outdir, f"{rate}.rank")
    bench = " ".join([BENCH, "--min-bytes", str(a.min_bytes), "--max-bytes", str(a.max_bytes),
                      "--factor", str(a.factor), "--repeats", str(a.repeats), "--warmup", "1",
                      "--batch-bytes", "1", "--connections", str(a.connections),
                      "--timeout", str(a.timeout), "--impls"] + impls)
    # One shell per host starts its ranks and exits with the first failure.
    host = (f"s=0; for k in $(seq 0 {a.ranks_per_host - 1}); do "
            f"r=$(({a.ranks_per_host}*HOST_INDEX+k)); "
            f"RANK=$r WORLD_SIZE={n} MASTER_ADDR=198.18.0.1 MASTER_PORT=29561 {bench} "
            f">{log}$r.out 2>{log}$r.err & pids=\"$pids $!\"; done; "
            "for p in $pids; do wait $p || s=$?; done; exit $s")
    cmd = [NETNS, "--hosts", str(a.hosts), "--rate", rate, "--timeout", str(a.timeout), "--",
           "bash", "-c", host]
    p = subprocess.run(cmd, env=environ, capture_output=True, text=True)
    if p.returncode == 77:
        sys.exit("comm_hosts: needs root and ip netns (scripts/netns_hosts.sh said 77)")
    if p.returncode != 0:
        errs = "".join(open(f"{log}{r}.err").read() for r in range(n)
                       if os.path.exists(f"{log}{r}.err"))
        sys.exit(f"comm_hosts: {rate}: exit {p.returncode}\n{p.stderr}{errs}")
    lines = [json.loads(l) for l in open(f"{log}0.out") if l.startswith("{")]
    return bench, [l for l in lines if l["bench"] == "allreduce"]


def table(rows, a, rate):
    h, n = a.hosts, a.hosts * a.ranks_per_host
    link = rate_bytes_per_s(rate)
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    by = {(r["impl"], r["bytes"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    head = ["size"] + [f"{i} ms" for i in impls] + [f"{i} link use" for i in impls]
    ratios = [("auto / gloo", "caravan-auto", "caravan-gloo"),
              (f"gloo x{a.connections} / x1", f"caravan-gloo-x{a.connections}", "caravan-gloo"),
              (f"auto x{a.connections} / x1", f"caravan-auto-x{a.connections}", "caravan-auto")]
    head += [f"{r[0]} (speed)" for r in ratios]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for b in sizes:
        least = b * 2 * (h - 1) / h  # bytes each host sends over its link, at the least
        cells = [size_label(b)]
        cells += [f"{by[(i, b)]['median_s'] * 1e3:.1f}" for i in impls]
        cells += [f"{least / by[(i, b)]['median_s'] / link:.0%}" for i in impls]
        cells += [f"{by[(den, b)]['median_s'] / by[(num, b)]['median_s']:.2f}"
                  for _, num, den in ratios]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--rates", nargs="+", default=["1gbit", "300mbit"])
    p.add_argument("--connections", type=int, default=2)
    p.add_argument("--min-bytes", type=int, default=1 << 20)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=int, default=1200, help="seconds per rate")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "comm-hosts"))
    a = p.parse_args()
    if not os.path.exists(BENCH):
        sys.exit(f"comm_hosts: {BENCH} missing; build the caravan_bench_comm target")
    environ, removed = env()
    runs = os.path.join(a.out, "runs")
    os.makedirs(runs, exist_ok=True)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"all-reduce (sum, float32, in place) between {a.hosts} namespace hosts x "
          f"{a.ranks_per_host} ranks, median of {a.repeats} interleaved rounds after 1 warm-up; "
          f"{os.cpu_count()} CPUs, load average {' '.join(load)}; removed from the environment: "
          f"{', '.join(removed) or 'nothing (not set)'}")
    print("link use = (size x 2(h-1)/h, the bytes each host sends over its link at the least) / "
          "time / link rate; speed ratios are time(denominator) / time(numerator), > 1: "
          "numerator faster")
    results = []
    for rate in a.rates:
        bench, rows = run(a, rate, environ, runs)
        results.append({"rate": rate, "command": bench, "rows": rows})
        print(f"\n### links at {rate} (tc tbf)\n\n`{' '.join(sys.argv)}`; per rank: `{bench}`\n")
        print(table(rows, a, rate))
        sys.stdout.flush()
    with open("/proc/loadavg") as f:
        print(f"\nload average after: {' '.join(f.read().split()[:3])}")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"args": vars(a), "removed_env": removed, "load_before": load,
                   "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
