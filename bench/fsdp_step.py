#!/usr/bin/env python3
"""Data parallelism against PyTorch's fully sharded data parallelism: Caravan
(build/caravan_bench train, W worker processes, as bench/ddp_step.py runs it) and PyTorch
2.13's FSDP2 over Gloo (bench/peer_fsdp.py: every transformer block fully_shard'ed, then the
root), without and with its CPUOffloadPolicy, on the same model, per-worker batch, optimizer,
clipping and threads per worker, measured in the same invocation with the runs interleaved
(A A' B B' A A' B B' ...). Reports each arm's median samples/s and peak RSS per worker, and the
ratio Caravan / PyTorch in samples/s (>= 1.0: Caravan at least as fast). Caravan runs twice per
round: as it is, and (caravan-offload, --caravan-offload-args) with its weights, gradients and
optimizer state out of core (memory.weights = offload), the counterpart of FSDP2's CPU offload.

    .venv/bin/python bench/fsdp_step.py [--config configs/brown-gpt.toml] [--workers 2]
        [--repeats 3] [--steps 20] [--warmup 3] [--threads 1] [--caravan-args "..."]
        [--caravan-offload-args "--set memory.weights=offload"] [--json OUT] [--bench PATH]
        [--shards none optimizer gradients parameters]
        [--peers fsdp2 fsdp2-grad-op fsdp2-offload zero1 zero1-views zero1-overlap
                 ddp]

Sharded data parallelism (ZeRO stages): --shards runs one Caravan arm per sync.shard level
("caravan" for none, which adds nothing; "caravan-shard-LEVEL" with --set sync.shard=LEVEL
otherwise), and no caravan-offload arm unless --caravan-offload-args is given. --peers picks the
PyTorch arms (pytorch-NAME): fsdp2 (fully_shard, reshard_after_forward=True: FULL_SHARD, ZeRO-3),
fsdp2-grad-op (reshard_after_forward=False: SHARD_GRAD_OP, ZeRO-2), fsdp2-offload
(CPUOffloadPolicy), zero1 (bench/peer_zero.py: DDP + ZeroRedundancyOptimizer over AdamW,
ZeRO-1), zero1-views (the same with parameters_as_bucket_view and DDP's
gradient_as_bucket_view), zero1-overlap (overlap_with_ddp, which torch 2.13 refuses on Gloo:
reported as not running) and ddp (bench/peer_ddp.py, replicated). All arms are interleaved (the
Caravan arms, then the peers, each repeat). With either option the table gives every Caravan
arm's ratio against every arm, the other Caravan arms included (so each level against
Caravan's none), and a second table the ratio of the largest rank's peak RSS likewise. Without
them the arms and output are as before: caravan, caravan-offload, pytorch-fsdp2,
pytorch-fsdp2-offload.

Caravan: ddp_step.run_caravan (caravan_bench train, RANK/WORLD_SIZE per worker, rendezvous on
127.0.0.1) with train.precision = float32 (the peer trains in float32). Its step time is per
step the slowest rank's, median over steps, as the peer's. Peak RSS: each caravan_bench worker
runs under a small wrapper that waits for it and records its ru_maxrss (os.wait4); the peer's
ranks report their own (getrusage). Both include the process's start-up (libtorch, the data).

Where FSDP2 fails, the peer prints {"runs": false, "error": ...}: this driver reports the error
(its first line, verbatim) and the repeat, runs the arm again in the next repeat (it may have
crashed once), and takes each arm's median over the runs that succeeded; an arm that failed in
every repeat is reported as not running on CPU/Gloo. Environment: ddp_step.environment (OMP_NUM_THREADS and
OPENBLAS_NUM_THREADS = --threads, GLOO_SOCKET_IFNAME=lo, OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE
removed; the output says whether they were set).
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile

from ddp_step import environment, free_port, last_json, loadavg, run_caravan
from pipeline_peer import run_group

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# --peers: name -> (script in bench/, its arguments); the arm is "pytorch-" + name.
PEERS = {
    "fsdp2": ("peer_fsdp.py", []),  # FULL_SHARD-like (ZeRO-3): reshard_after_forward=True
    "fsdp2-offload": ("peer_fsdp.py", ["--offload"]),
    "fsdp2-grad-op": ("peer_fsdp.py", ["--reshard-after-forward", "false"]),  # ZeRO-2-like
    "zero1": ("peer_zero.py", []),  # DDP + ZeroRedundancyOptimizer(AdamW)
    "zero1-views": ("peer_zero.py", ["--bucket-view", "--gradient-as-bucket-view"]),
    "zero1-overlap": ("peer_zero.py", ["--overlap-with-ddp"]),  # torch 2.13 refuses it on Gloo
    "ddp": ("peer_ddp.py", []),  # replicated, the baseline
}
DEFAULT_PEERS = ["fsdp2", "fsdp2-offload"]
SHARDS = ["none", "optimizer", "gradients", "parameters"]  # Caravan's sync.shard (ZeRO 0-3)
# Runs a caravan_bench worker, waits for it and writes its peak RSS (bytes) to
# $FSDP_STEP_RSS_DIR/rank$RANK; the worker dies with the wrapper (PR_SET_PDEATHSIG), so
# ddp_step.run_caravan's kill on a failure or timeout still reaches it.
WRAPPER = """#!{python}
import ctypes, os, signal, subprocess, sys
def die_with_parent():
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
p = subprocess.Popen([{bench!r}] + sys.argv[1:], preexec_fn=die_with_parent)
_, status, usage = os.wait4(p.pid, 0)
with open(os.path.join(os.environ["FSDP_STEP_RSS_DIR"], "rank" + os.environ["RANK"]), "w") as f:
    f.write(str(usage.ru_maxrss * 1024))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def caravan_arm(a, environ, extra, work):
    """ddp_step.run_caravan under the RSS wrapper: its JSON plus peak_rss_bytes per rank."""
    rss_dir = tempfile.mkdtemp(dir=work)
    r = run_caravan(a.wrapper, a.config, a.workers, a.steps, a.warmup, a.threads,
                    dict(environ, FSDP_STEP_RSS_DIR=rss_dir), extra)
    rss = []
    for rank in range(a.workers):
        with open(os.path.join(rss_dir, f"rank{rank}")) as f:
            rss.append(float(f.read()))
    shutil.rmtree(rss_dir)
    return dict(r, runs=True, peak_rss_bytes=rss)


def peer_arm(a, environ, peer):
    script, args = PEERS[peer]
    cmd = [sys.executable, os.path.join(ROOT, "bench", script), "--config", a.config,
           "--workers", str(a.workers), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--threads", str(a.threads), "--port", str(free_port())] + args
    rc, out, err = run_group(cmd, environ)
    if rc != 0:
        sys.exit(f"fsdp_step: {' '.join(cmd)} failed ({rc}):\n{err.strip()}")
    return last_json(out, script)


def caravan_name(level):
    return "caravan" if level == "none" else f"caravan-shard-{level}"


def mib(v):
    return v / (1 << 20)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # runs run_caravan's cleanup
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/brown-gpt.toml")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="compute threads per worker")
    p.add_argument("--bench", default=os.path.join(ROOT, "build", "caravan_bench"),
                   help="the caravan_bench binary (default: build/caravan_bench)")
    p.add_argument("--caravan-args", default="",
                   help="extra caravan_bench train arguments (every Caravan arm), e.g. "
                        "'--set sync.bucket_mb=4'")
    p.add_argument("--caravan-offload-args",
                   help="a further Caravan arm, caravan-offload, with these arguments (its "
                        "out-of-core weights, the peer's CPU offload's counterpart); '' = none; "
                        "default '--set memory.weights=offload' without --shards, none with it")
    p.add_argument("--shards", nargs="+", choices=SHARDS,
                   help="Caravan arms, one per sync.shard level (each run with --set "
                        "sync.shard=LEVEL; 'none' adds nothing: the arm 'caravan'); default: "
                        "the one arm 'caravan'")
    p.add_argument("--peers", nargs="+", choices=list(PEERS),
                   help="PyTorch arms (pytorch-NAME): " + ", ".join(
                       f"{n} = {s} {' '.join(x)}".strip() for n, (s, x) in PEERS.items())
                   + f"; default: {' '.join(DEFAULT_PEERS)}")
    p.add_argument("--json", help="write every measurement here")
    a = p.parse_args()
    extended = a.shards is not None or a.peers is not None  # the default: the table as before
    if a.caravan_offload_args is None:
        a.caravan_offload_args = "" if a.shards else "--set memory.weights=offload"
    peers = list(dict.fromkeys(a.peers or DEFAULT_PEERS))
    if not os.path.exists(a.bench):
        sys.exit(f"fsdp_step: {a.bench} missing; run bash scripts/setup.sh first")
    environ, removed = environment(a.threads)
    extra = ["--set", "train.precision=float32"] + a.caravan_args.split()
    cores = os.cpu_count()
    print(f"fsdp_step: {cores} cores; load average before: {loadavg()}; removed from the "
          f"environment: {', '.join(removed) or 'nothing (not set)'}", flush=True)

    work = tempfile.mkdtemp(prefix="fsdp-step-")
    a.wrapper = os.path.join(work, "caravan_bench_rss")
    with open(a.wrapper, "w") as f:
        f.write(WRAPPER.format(python=sys.executable, bench=os.path.abspath(a.bench)))
    os.chmod(a.wrapper, 0o755)
    caravans = {caravan_name(level): extra + ([] if level == "none"
                                              else ["--set", f"sync.shard={level}"])
                for level in dict.fromkeys(a.shards or ["none"])}
    if a.caravan_offload_args.strip():
        caravans["caravan-offload"] = extra + a.caravan_offload_args.split()
    arms = {name: [] for name in caravans}
    arms.update({f"pytorch-{peer}": [] for peer in peers})
    failures = {}  # per PyTorch arm, the repeats where it failed (a crash is run again)
    try:
        for rep in range(a.repeats):  # interleaved: caravan(s), then each peer, ...
            line = []
            for name, args in caravans.items():
                c = caravan_arm(a, environ, args, work)
                arms[name].append(c)
                line.append(f"{name} {c['samples_per_s']:.1f}")
            for peer in peers:
                name = f"pytorch-{peer}"
                q = peer_arm(a, environ, peer)
                if not q.get("runs", True):
                    failures.setdefault(name, []).append(dict(q, repeat=rep + 1))
                    line.append(f"{name} failed ({q['error']})")
                    continue
                arms[name].append(q)
                line.append(f"{name} {q['samples_per_s']:.1f}")
            print(f"  {a.config} W={a.workers} repeat {rep + 1}: " + ", ".join(line)
                  + f" samples/s; load {loadavg()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = {}
    for name, runs in arms.items():
        if not runs:
            continue
        step = statistics.median(r["step_s_median"] for r in runs)
        rows[name] = {"samples_per_s": a.workers * runs[0]["batch_size"] / step,
                      "step_s_median": step,
                      "peak_rss_bytes_per_rank": [statistics.median(r["peak_rss_bytes"][k]
                                                                    for r in runs)
                                                  for k in range(a.workers)],
                      "runs": runs}
    for name, row in rows.items():
        if name not in caravans or extended:  # extended: Caravan's arms against each other too
            row["ratio"] = {c: rows[c]["samples_per_s"] / row["samples_per_s"]
                            for c in caravans if c in rows}
        if extended:  # the largest rank's peak RSS of each Caravan arm over this arm's
            row["rss_ratio"] = {c: max(rows[c]["peak_rss_bytes_per_rank"])
                                / max(row["peak_rss_bytes_per_rank"])
                                for c in caravans if c in rows}
    print(f"\n{a.config}, {a.workers} workers, {a.threads} thread(s) per worker, {cores} cores; "
          f"median of {a.repeats} interleaved runs of {a.steps} steps after {a.warmup}")
    print("| arm | samples/s | step ms | peak RSS per rank (MiB) | "
          + " | ".join(f"{c} / arm" for c in caravans) + " |")
    print("|---|---|---|---|" + "---|" * len(caravans))
    for name, row in rows.items():
        print(f"| {name} | {row['samples_per_s']:.1f} | {1e3 * row['step_s_median']:.1f} | "
              + " / ".join(f"{mib(v):.0f}" for v in row["peak_rss_bytes_per_rank"]) + " | "
              + " | ".join(f"{row['ratio'][c]:.3f}" if "ratio" in row and c != name else "-"
                           for c in caravans)
              + " |")
    for name, failed in failures.items():
        if not arms[name]:
            e = failed[0]
            print(f"| {name} | does not run on CPU/Gloo: {e['error']} (rank {e.get('rank')}, "
                  f"{e.get('phase')}) |" + " |" * (2 + len(caravans)))
    if extended:
        print("\npeak RSS, the largest rank's, Caravan arm / arm (<= 1.0: Caravan holds no more)")
        print("| arm | max peak RSS (MiB) | " + " | ".join(f"{c} / arm" for c in caravans) + " |")
        print("|---|---|" + "---|" * len(caravans))
        for name, row in rows.items():
            print(f"| {name} | {mib(max(row['peak_rss_bytes_per_rank'])):.0f} | "
                  + " | ".join(f"{row['rss_ratio'][c]:.3f}" if c != name else "-"
                               for c in caravans) + " |")
    for name, failed in failures.items():
        print(f"{name}: failed in {len(failed)} of {a.repeats} repeats"
              + (f" (its median is over the {len(arms[name])} that ran)" if arms[name] else "")
              + ": " + "; ".join(f"repeat {f['repeat']}: {f['error']}" for f in failed))
    print("ratio = Caravan / " + ("arm" if extended else "PyTorch") + " samples/s (>= 1.0: "
          "Caravan at least as fast); peak RSS = ru_maxrss of each worker process; "
          "caravan-offload: " + (a.caravan_offload_args or "-"))
    print(f"load average after: {loadavg()}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"bench": "fsdp_step", "args": {k: v for k, v in vars(a).items()
                                                      if k != "wrapper"},
                       "cores": cores, "removed_env": removed, "rows": rows,
                       "failures": failures}, f, indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
