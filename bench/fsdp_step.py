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
        [--shards none optimizer gradients parameters] [--precisions float32 bf16]
        [--peers fsdp2 fsdp2-grad-op fsdp2-offload zero1 zero1-views zero1-overlap
                 ddp fsdp2-compile fsdp2-compile-model fsdp2-grad-op-compile fsdp2-autocast
                 fsdp2-mp-bf16 fsdp2-bf16 fsdp2-grad-op-bf16 zero1-compile zero1-autocast
                 zero1-bf16] [--peer-allocator {caravan,glibc}]

Sharded data parallelism (ZeRO stages): --shards runs one Caravan arm per sync.shard level
("caravan" for none, which adds nothing; "caravan-shard-LEVEL" with --set sync.shard=LEVEL
otherwise), and no caravan-offload arm unless --caravan-offload-args is given. --peers picks the
PyTorch arms (pytorch-NAME): fsdp2 (fully_shard, reshard_after_forward=True: FULL_SHARD, ZeRO-3),
fsdp2-grad-op (reshard_after_forward=False: SHARD_GRAD_OP, ZeRO-2), fsdp2-offload
(CPUOffloadPolicy), zero1 (bench/peer_zero.py: DDP + ZeroRedundancyOptimizer over AdamW,
ZeRO-1), zero1-views (the same with parameters_as_bucket_view and DDP's
gradient_as_bucket_view), zero1-overlap (overlap_with_ddp, which torch 2.13 refuses on Gloo:
reported as not running) and ddp (bench/peer_ddp.py, replicated).

The stronger peers (the project's rule: the strongest configuration a good engineer would run,
torch.compile where it runs, bf16 autocast where Caravan runs bf16): fsdp2-compile and
fsdp2-grad-op-compile (each transformer block torch.compile'd, then fully_shard'ed, as PyTorch's
torchtitan does), fsdp2-compile-model (the whole module compiled after fully_shard),
zero1-compile (the DDP module compiled, PyTorch's documented way for DDP), all float32; in bf16:
fsdp2-autocast and zero1-autocast (eager, forward and loss under torch.autocast("cpu",
bfloat16)), fsdp2-mp-bf16 (eager, FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32): blocks gathered and computed in bf16), and the strongest bf16 forms
fsdp2-bf16 and fsdp2-grad-op-bf16 (MixedPrecisionPolicy + autocast + per-block compile) and
zero1-bf16 (autocast + compile). Compilation runs in the warmup steps (the peers start timing
after them) and each peer reports how many graphs it compiled in the timed steps: a nonzero count
is printed as a timed recompilation (raise --warmup). --precisions float32 bf16 runs every
Caravan level in both train.precision = float32 and bf16 (the bf16 arms named ...-bf16), so
each comparison is like for like. The peers run with Caravan's allocator settings
(GLIBC_TUNABLES = ddp_step.TUNED_MALLOC: freed memory kept for reuse, as Caravan's
train.keep_freed_memory does) unless --peer-allocator glibc (glibc's defaults, as the runs
recorded before these arms). All arms are interleaved (the Caravan arms, then the peers, each
repeat).

With any of --shards, --peers and --precisions the table gives every Caravan arm's ratio against
every arm, the other Caravan arms included (so each level against Caravan's none), a second
table the ratio of the largest rank's peak RSS likewise, and a last one pairs each Caravan arm
with the fastest peer arm measured at its ZeRO stage (none: ddp; optimizer: zero1*; gradients:
fsdp2-grad-op*; parameters: fsdp2*, offload excluded) and precision (float32 peers: eager or
compiled; bf16 peers: autocast, MixedPrecisionPolicy, compiled or not), with both ratios.
Without them the arms and output are as before: caravan, caravan-offload, pytorch-fsdp2,
pytorch-fsdp2-offload.

Caravan: ddp_step.run_caravan (caravan_bench train, RANK/WORLD_SIZE per worker, rendezvous on
127.0.0.1) with train.precision = float32 (the eager and compiled peers train in float32), and
bf16 for the --precisions bf16 arms. Its step time is per step the slowest rank's, median over
steps, as the peer's. Peak RSS: each caravan_bench worker
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

from ddp_step import TUNED_MALLOC, environment, free_port, last_json, loadavg, run_caravan
from pipeline_peer import run_group

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
GRAD_OP = ["--reshard-after-forward", "false"]  # FSDP2's SHARD_GRAD_OP (ZeRO-2-like)
BF16 = ["--mp-bf16", "--autocast", "--compile"]  # FSDP2's strongest bf16 form
# --peers: name -> (script in bench/, its arguments, the ZeRO stage it is the counterpart of,
# its precision); the arm is "pytorch-" + name. The stage and precision pair each Caravan arm
# with its like-for-like peers (None: no Caravan level is its counterpart).
PEERS = {
    "fsdp2": ("peer_fsdp.py", [], 3, "float32"),  # FULL_SHARD-like: reshard_after_forward=True
    "fsdp2-offload": ("peer_fsdp.py", ["--offload"], None, "float32"),
    "fsdp2-grad-op": ("peer_fsdp.py", GRAD_OP, 2, "float32"),
    "zero1": ("peer_zero.py", [], 1, "float32"),  # DDP + ZeroRedundancyOptimizer(AdamW)
    "zero1-views": ("peer_zero.py", ["--bucket-view", "--gradient-as-bucket-view"], 1,
                    "float32"),
    "zero1-overlap": ("peer_zero.py", ["--overlap-with-ddp"], 1, "float32"),  # refused on Gloo
    "ddp": ("peer_ddp.py", [], 0, "float32"),  # replicated, the baseline
    # The stronger forms (PyTorch's advice for speed): torch.compile, bf16.
    "fsdp2-compile": ("peer_fsdp.py", ["--compile"], 3, "float32"),  # each block compiled
    "fsdp2-compile-model": ("peer_fsdp.py", ["--compile", "model"], 3, "float32"),
    "fsdp2-grad-op-compile": ("peer_fsdp.py", GRAD_OP + ["--compile"], 2, "float32"),
    "fsdp2-autocast": ("peer_fsdp.py", ["--autocast"], 3, "bf16"),
    "fsdp2-mp-bf16": ("peer_fsdp.py", ["--mp-bf16"], 3, "bf16"),
    "fsdp2-bf16": ("peer_fsdp.py", BF16, 3, "bf16"),
    "fsdp2-grad-op-bf16": ("peer_fsdp.py", GRAD_OP + BF16, 2, "bf16"),
    "zero1-compile": ("peer_zero.py", ["--compile"], 1, "float32"),  # the DDP module compiled
    "zero1-autocast": ("peer_zero.py", ["--autocast"], 1, "bf16"),
    "zero1-bf16": ("peer_zero.py", ["--autocast", "--compile"], 1, "bf16"),
}
DEFAULT_PEERS = ["fsdp2", "fsdp2-offload"]
SHARDS = ["none", "optimizer", "gradients", "parameters"]  # Caravan's sync.shard (ZeRO 0-3)
PRECISIONS = ["float32", "bf16"]  # Caravan's train.precision per arm
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
    script, args, _, _ = PEERS[peer]
    cmd = [sys.executable, os.path.join(ROOT, "bench", script), "--config", a.config,
           "--workers", str(a.workers), "--steps", str(a.steps), "--warmup", str(a.warmup),
           "--threads", str(a.threads), "--port", str(free_port())] + args
    rc, out, err = run_group(cmd, environ)
    if rc != 0:
        sys.exit(f"fsdp_step: {' '.join(cmd)} failed ({rc}):\n{err.strip()}")
    return last_json(out, script)


def caravan_name(level, precision="float32"):
    return (("caravan" if level == "none" else f"caravan-shard-{level}")
            + ("" if precision == "float32" else f"-{precision}"))


def like_for_like(rows, caravans, peers):
    """Per Caravan arm (level, precision), the fastest peer arm that ran at the same ZeRO stage
    and precision: [(Caravan arm, peer arm or None, the candidates)]."""
    out = []
    for name, (level, precision) in caravans.items():
        if level is None:  # caravan-offload: FSDP2's offload is not its like
            continue
        candidates = [f"pytorch-{p}" for p in peers
                      if PEERS[p][2] == SHARDS.index(level) and PEERS[p][3] == precision]
        ran = [c for c in candidates if c in rows]
        best = max(ran, key=lambda c: rows[c]["samples_per_s"]) if ran else None
        out.append((name, best, candidates))
    return out


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
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=["float32"],
                   help="Caravan's train.precision: each --shards level runs once per "
                        "precision (bf16 arms named ...-bf16); default float32")
    p.add_argument("--peers", nargs="+", choices=list(PEERS),
                   help="PyTorch arms (pytorch-NAME): " + ", ".join(
                       f"{n} = {s} {' '.join(x)}".strip() for n, (s, x, _, _) in PEERS.items())
                   + f"; default: {' '.join(DEFAULT_PEERS)}")
    p.add_argument("--peer-allocator", choices=("caravan", "glibc"), default="caravan",
                   help="the peers' allocator settings: caravan = GLIBC_TUNABLES="
                        f"{TUNED_MALLOC} (Caravan keeps freed memory for reuse, "
                        "train.keep_freed_memory; the default), glibc = glibc's defaults (the "
                        "runs recorded before the stronger peers)")
    p.add_argument("--json", help="write every measurement here")
    a = p.parse_args()
    extended = (a.shards is not None or a.peers is not None  # the default: the table as before
                or a.precisions != ["float32"])
    if a.caravan_offload_args is None:
        a.caravan_offload_args = "" if a.shards else "--set memory.weights=offload"
    peers = list(dict.fromkeys(a.peers or DEFAULT_PEERS))
    if not os.path.exists(a.bench):
        sys.exit(f"fsdp_step: {a.bench} missing; run bash scripts/setup.sh first")
    environ, removed = environment(a.threads)
    peer_environ = dict(environ)
    if a.peer_allocator == "caravan":
        peer_environ["GLIBC_TUNABLES"] = TUNED_MALLOC
    extra = a.caravan_args.split()
    cores = os.cpu_count()
    print(f"fsdp_step: {cores} cores; load average before: {loadavg()}; removed from the "
          f"environment: {', '.join(removed) or 'nothing (not set)'}; the peers' allocator: "
          + (f"GLIBC_TUNABLES={TUNED_MALLOC}" if a.peer_allocator == "caravan"
             else "glibc's defaults"), flush=True)

    work = tempfile.mkdtemp(prefix="fsdp-step-")
    a.wrapper = os.path.join(work, "caravan_bench_rss")
    with open(a.wrapper, "w") as f:
        f.write(WRAPPER.format(python=sys.executable, bench=os.path.abspath(a.bench)))
    os.chmod(a.wrapper, 0o755)
    caravans, kinds = {}, {}  # Caravan arm -> its arguments; -> (level, precision)
    for precision in dict.fromkeys(a.precisions):
        for level in dict.fromkeys(a.shards or ["none"]):
            name = caravan_name(level, precision)
            caravans[name] = (["--set", f"train.precision={precision}"] + extra
                              + ([] if level == "none" else ["--set", f"sync.shard={level}"]))
            kinds[name] = (level, precision)
    if a.caravan_offload_args.strip():
        caravans["caravan-offload"] = (["--set", "train.precision=float32"] + extra
                                       + a.caravan_offload_args.split())
        kinds["caravan-offload"] = (None, "float32")
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
                q = peer_arm(a, peer_environ, peer)
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
    pairs = like_for_like(rows, kinds, peers) if extended else []
    if any(candidates for _, _, candidates in pairs):
        print("\nlike for like: each Caravan arm against the fastest peer arm that ran at its "
              "ZeRO stage (none: ddp, optimizer: zero1*, gradients: fsdp2-grad-op*, "
              "parameters: fsdp2*) and precision")
        print("| Caravan arm | samples/s | fastest peer (of those measured) | samples/s | "
              "Caravan / peer | peak RSS Caravan / peer |")
        print("|---|---|---|---|---|---|")
        for name, best, candidates in pairs:
            if not candidates:
                continue
            c = rows[name]
            if best is None:
                print(f"| {name} | {c['samples_per_s']:.1f} | none ran of "
                      f"{', '.join(candidates)} | | | |")
                continue
            print(f"| {name} | {c['samples_per_s']:.1f} | {best} | "
                  f"{rows[best]['samples_per_s']:.1f} | {rows[best]['ratio'][name]:.3f} | "
                  f"{rows[best]['rss_ratio'][name]:.3f} |")
    timed = {n: [r["compiled_graphs"]["timed"] for r in runs] for n, runs in arms.items()
             if any(r.get("compiled_graphs", {}).get("timed") for r in runs)}
    for name, counts in timed.items():
        print(f"{name}: torch.compile captured graphs during the timed steps ({counts} per "
              "repeat): a recompilation was timed; give it more --warmup")
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
                       "cores": cores, "removed_env": removed,
                       "peer_env": {"GLIBC_TUNABLES": peer_environ.get("GLIBC_TUNABLES")},
                       "rows": rows, "failures": failures,
                       "like_for_like": {n: b for n, b, c in pairs if c}}, f, indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
