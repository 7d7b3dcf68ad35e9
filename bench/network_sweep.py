#!/usr/bin/env python3
"""Synchronization models on constrained links: W workers (+ S servers) as separate hosts in
network namespaces (scripts/netns_hosts.sh: veth pairs to a bridge, each host's link limited
to RATE in both directions with tc tbf), one table from one invocation.

    .venv/bin/python bench/network_sweep.py [--rates 1gbit 500mbit 300mbit 100mbit]
        [--repeats 2] [--steps 40] [--epochs 2] [--accuracy-rate 500mbit ...]
        [--modes allreduce osp-auto diloco streaming-diloco-int4 ...] [--diloco-period 32]
        [--out bench/results/network]
    .venv/bin/python bench/network_sweep.py --replot [--out bench/results/network]

Two parts, each interleaving its runs (mode A, B, ... at one rate, then the next rate, then the
next repeat):
  throughput  every mode at every rate for --steps steps; from rank 0's metrics.jsonl (the first
              log window dropped as warm-up): compute s/step (forward + backward + optimizer),
              wait s/step (blocked on synchronization), samples/s, MB sent per step. Medians
              over repeats.
  accuracy    every mode at each --accuracy-rate for --epochs epochs (or --accuracy-steps
              steps, at most --accuracy-minutes each), evaluating on the full test set four
              times per epoch (or every --eval-every steps): test accuracy and loss at the end,
              the wall-clock time and step (evaluations included) of the first evaluation at or
              above --target (or at or below --target-loss), and rank 0's bytes sent per step
              over the whole run, against allreduce's.
Samples/s, compute and wait s/step and MB sent per step are over all measured steps (not a
median of windows), so modes that exchange every H steps (diloco, local-sgd) show their
average; for those make the measured steps a multiple of H (--log-every).
OSP's speedup is its samples/s over ps-bsp's at the same rate; its bound is (compute + comm) /
max(compute, comm) with ps-bsp's compute and wait per step (ps-bsp exposes all communication).

Needs root and iproute2 (exit 77 otherwise, like netns_hosts.sh).

Written under --out: table.md (the tables as printed), results.json (medians, every repeat's
numbers, the accuracy curves, the settings), charts.json (for `caravan report`, docs/report.md:
OSP's speedup over ps-bsp and its bound against the link rate, samples/s against the link rate
per mode, compute and wait per step at the slowest rate, accuracy against time, time to the
target, and the throughput table; `caravan report OUT --png OUT/charts` draws them).
--replot runs nothing: it rebuilds OUT/charts.json from OUT/results.json.

OPENBLAS_CORETYPE is removed from the measured processes' environment (it slows OpenBLAS
here); the table says so. Every process runs single-threaded: 5 processes share this machine's
cores, so "compute" includes waiting for a core.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
HOSTS = os.path.join(ROOT, "scripts", "netns_hosts.sh")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts  # noqa: E402  (charts.json for caravan report)
from train_throughput import env  # noqa: E402  (the benchmark environment, shared)

# name -> (sync.* settings, uses servers)
MODES = {
    "allreduce": ([], False),
    "topk": (["sync.compression=topk", "sync.topk_ratio=0.01"], False),
    "local-sgd": (["sync.mode=local-sgd", "sync.local_period=4"], False),
    "gossip": (["sync.mode=gossip"], False),
    "ps-bsp": (["sync.mode=ps-bsp"], True),
    "ps-bsp-fp16": (["sync.mode=ps-bsp", "sync.compression=fp16"], True),
    "ps-asp": (["sync.mode=ps-asp"], True),
    "ps-ssp": (["sync.mode=ps-ssp", "sync.staleness=3"], True),
    "osp-0.25": (["sync.mode=osp", "sync.osp_fraction=0.25"], True),
    "osp": (["sync.mode=osp", "sync.osp_fraction=0.5"], True),
    "osp-0.75": (["sync.mode=osp", "sync.osp_fraction=0.75"], True),
    "osp-1.0": (["sync.mode=osp", "sync.osp_fraction=1.0"], True),
    "osp-nolgp": (["sync.mode=osp", "sync.osp_fraction=0.5", "sync.osp_lgp=false"], True),
    "osp-auto": (["sync.mode=osp", "sync.osp_auto_fraction=true"], True),
    "osp-auto-nolgp": (["sync.mode=osp", "sync.osp_auto_fraction=true", "sync.osp_lgp=false"],
                       True),
    # The transport before dist.backend = auto (hierarchical where a host has several ranks,
    # as with --colocate), for an interleaved comparison.
    "ps-bsp-gloo": (["sync.mode=ps-bsp", "dist.backend=gloo"], True),
    "osp-gloo": (["sync.mode=osp", "sync.osp_fraction=0.5", "dist.backend=gloo"], True),
    "allreduce-gloo": (["dist.backend=gloo"], False),
    # Sharded data parallelism (issue 48): ZeRO's stages over the all-reduce.
    "shard-optimizer": (["sync.shard=optimizer"], False),
    "shard-gradients": (["sync.shard=gradients"], False),
    "shard-parameters": (["sync.shard=parameters"], False),
    # Rare synchronization (issue 22): H = --diloco-period inner steps, outer Nesterov 0.7/0.9.
    "diloco": (["sync.mode=diloco", "sync.local_period={period}"], False),
    "diloco-int4": (["sync.mode=diloco", "sync.local_period={period}", "sync.compression=int4"],
                    False),
    "streaming-diloco-int4": (["sync.mode=diloco", "sync.local_period={period}",
                               "sync.fragments={fragments}", "sync.compression=int4"], False),
    "local-sgd-int4": (["sync.mode=local-sgd", "sync.local_period={period}",
                        "sync.compression=int4"], False),
    # The same through parameter servers (the outer step on the servers).
    "ps-diloco": (["sync.mode=ps-diloco", "sync.local_period={period}"], True),
    "ps-streaming-diloco-int4": (["sync.mode=ps-diloco", "sync.local_period={period}",
                                  "sync.fragments={fragments}", "sync.compression=int4"], True),
}


def mbit(rate):
    r = rate.lower()
    for suffix, scale in (("gbit", 1000.0), ("mbit", 1.0), ("kbit", 0.001)):
        if r.endswith(suffix):
            return float(r[: -len(suffix)]) * scale
    sys.exit(f"network_sweep: cannot read rate {rate} (use e.g. 300mbit or 1gbit)")


def run(mode, rate, a, run_dir, overrides):
    """One job on W (+S) namespace hosts; returns the run directory's metrics records."""
    done = os.path.join(run_dir, "model.pt")
    if a.reuse and os.path.exists(done):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]
    settings, servers = MODES[mode]
    settings = [x.format(period=a.diloco_period, fragments=a.fragments) for x in settings]
    sets = settings + a.extra + overrides + ["train.threads=1", f"data.batch_size={a.batch}",
                                   f"sync.servers={a.servers}", "fault.timeout=120",
                                   "checkpoint.every=0"]
    shutil.rmtree(run_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    if servers and a.colocate:  # server shard i on worker i's host, sharing its link
        return train_on_hosts(a.workers, rate, a.timeout, a.config, sets, run_dir,
                              f"network_sweep: {mode} at {rate}", a.cpus, per_host=2)
    world = a.workers + (a.servers if servers else 0)
    return train_on_hosts(world, rate, a.timeout, a.config, sets, run_dir,
                          f"network_sweep: {mode} at {rate}", a.cpus)


def train_on_hosts(hosts, rate, timeout, config, sets, run_dir, what, cpus=None, per_host=1):
    """`caravan train --config CONFIG --set SETS` as ranks 0..hosts*per_host-1 on `hosts`
    namespace hosts whose links run at `rate` (and, with `cpus`, each host on that many cores at
    most: netns_hosts.sh --cpus); host i runs ranks i, i + hosts, ... (per_host = 2 with as many
    servers as workers: worker i and server shard i on one host, as OSP's and BytePS's
    evaluations place them). Returns the run's metrics records. Exits 77 where namespaces (or
    CPU shares) cannot be made, and with every rank's log tail when a rank failed."""
    args = " ".join(f"--set '{s}'" for s in sets)
    world = hosts * per_host
    rank_cmd = (f"st=0; pids=''; for k in $(seq 0 {per_host - 1}); do r=$((HOST_INDEX + k * HOSTS)); "
                f"RANK=$r WORLD_SIZE={world} MASTER_ADDR=198.18.0.1 MASTER_PORT=29500 "
                f"OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 {CARAVAN} train -q "
                f"--config {config} {args} --run-dir {run_dir} "
                f">{run_dir}.log.$r 2>&1 & pids=\"$pids $!\"; done; "
                f"for p in $pids; do wait $p; rc=$?; [ $st -eq 0 ] && st=$rc; done; exit $st")
    cmd = [HOSTS, "--hosts", str(hosts), "--rate", rate, "--timeout", str(timeout)] + \
        (["--cpus", str(cpus)] if cpus else []) + ["--", "bash", "-c", rank_cmd]
    environ, _ = env()
    rc = subprocess.run(cmd, env=environ).returncode
    if rc == 77:
        sys.exit(77)
    if rc != 0:
        logs = "".join(open(f"{run_dir}.log.{i}").read()[-600:]
                       for i in range(world) if os.path.exists(f"{run_dir}.log.{i}"))
        sys.exit(f"{what} failed (exit {rc}):\n{logs}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def window_steps(records):
    """(train record, steps in its window) for every train record."""
    out, last = [], 0
    for r in records:
        if r["kind"] == "train":
            out.append((r, r["step"] - last))
            last = r["step"]
    return out


def mean_sent_mb(train):
    """Rank 0's MB sent per step over the windows `train` ((record, steps) pairs): total bytes
    over total steps, so a mode that exchanges every H steps shows its average."""
    steps = sum(n for _, n in train)
    return sum(r.get("sent_bytes", 0.0) * n for r, n in train) / max(steps, 1) / 1e6


def throughput_numbers(records):
    windows = window_steps(records)[1:]  # first window: warm-up
    train = [r for r, _ in windows]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in train)  # noqa: E731
    # Samples/s over the measured steps (the windows' rates harmonically weighted by their
    # steps): a window with a rare exchange counts as long as it took, not as one vote. Compute
    # and wait per step likewise: means over the steps, not the median window (which would
    # hide an exchange made every H steps).
    steps = sum(n for _, n in windows)
    rate = steps / sum(n / r["samples_per_s"] for r, n in windows)
    mean = lambda k: sum(r.get(k, 0.0) * n for r, n in windows) / max(steps, 1)  # noqa: E731
    return {"compute_s": mean("compute_s"), "wait_s": mean("sync_wait_s"),
            "samples_per_s": rate, "sent_mb": mean_sent_mb(windows),
            "stage1_fraction": med("stage1_fraction") if "stage1_fraction" in train[0] else None,
            "staleness": med("staleness") if "staleness" in train[0] else None}


def accuracy_numbers(records, target, target_loss=None):
    """The run's evaluations: final accuracy and loss, the time and step of the first evaluation
    at or above `target` accuracy (or, with `target_loss`, at or below that loss), rank 0's MB
    sent per step over the whole run, and the curve (time, accuracy or loss)."""
    evals = [r for r in records if r["kind"] == "eval"]
    if target_loss is not None:
        hit = next((r for r in evals if r["loss"] <= target_loss), None)
    else:
        hit = next((r for r in evals if r["accuracy"] >= target), None)
    key = "loss" if target_loss is not None else "accuracy"
    return {"accuracy": evals[-1].get("accuracy"), "loss": evals[-1]["loss"],
            "steps": evals[-1]["step"],
            "time_to_target_s": hit["time_s"] if hit else None,
            "steps_to_target": hit["step"] if hit else None,
            "sent_mb": mean_sent_mb(window_steps(records)),
            "curve": [(r["time_s"], r[key]) for r in evals],
            "step_curve": [(r["step"], r[key]) for r in evals],
            "wall_s": evals[-1]["time_s"]}


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def spread(raw, rate, mode, base=None):
    """min-max over repeats of a mode's samples/s, or (with base) of its ratio to base's run
    of the same repeat (runs are interleaved, so repeat k of each mode ran side by side)."""
    runs = raw.get((rate, mode)) or []
    if base is None:
        values = [r["samples_per_s"] for r in runs]
    else:
        values = [r["samples_per_s"] / b["samples_per_s"]
                  for r, b in zip(runs, raw.get((rate, base)) or [])]
    return (min(values), max(values)) if values else None


def table_text(a, tp, raw, acc, speedup, bound, removed, log_every):
    """The tables (markdown) from the medians, with the spread over repeats: throughput per
    rate and mode, OSP's fractions against ps-bsp and the bound, accuracy."""
    placement = (f"{a.servers} server shards, one on each worker's host" if
                 getattr(a, "colocate", False) else f"{a.servers} server host(s)")
    lines = [f"# {os.path.basename(a.config)}: {a.workers} workers + {placement} (PS "
             f"modes), per-worker batch {a.batch}, each host's link limited in both directions",
             f"# medians of {a.repeats} interleaved repeats of {a.steps} steps (first "
             f"{log_every} dropped); OPENBLAS_CORETYPE "
             f"{'removed from the environment' if removed else 'was not set'}; "
             f"{os.cpu_count()} cores for {a.workers + a.servers} single-threaded processes" +
             (f", each host held to {a.cpus} cores (netns_hosts.sh --cpus)"
              if getattr(a, "cpus", None) else
              " sharing them"),
             "", "| rate | mode | compute s/step | wait s/step | samples/s (min-max) | MB "
             "sent/step (rank 0) | vs ps-bsp | stage-1 fraction | staleness |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rate in a.rates:
        for mode in a.modes:
            if (rate, mode) not in tp:  # --repeats 0: the accuracy part alone
                continue
            n = tp[(rate, mode)]
            r = spread(raw, rate, mode)
            lines.append(f"| {rate} | {mode} | {n['compute_s']:.3f} | {n['wait_s']:.3f} | "
                         f"{n['samples_per_s']:.0f} "
                         f"{f'({r[0]:.0f}-{r[1]:.0f})' if r else ''} | {n['sent_mb']:.2f} | "
                         f"{fmt(speedup.get(rate, {}).get(mode), '.2f')} | "
                         f"{fmt(n['stage1_fraction'], '.2f')} | {fmt(n['staleness'], '.2f')} |")
    # OSP and the other modes over ps-bsp: the median of the medians' ratio, and in brackets
    # the min-max of the per-repeat ratios; auto against the best fixed fraction's median.
    # (Only when ps-bsp ran: without it the table would be its header alone.)
    others = [m for m in a.modes if m != "ps-bsp"]
    if speedup:
        lines += ["", "Times ps-bsp (per-repeat min-max); bound = (c + m) / max(c, m) with "
                  "ps-bsp's compute c and wait m:", "",
                  "| rate | c s | m s | bound | " + " | ".join(others) +
                  " | osp-auto / best fixed osp | osp-auto's fraction |",
                  "|" + "---|" * (len(others) + 6)]
    fixed = [m for m in ("osp-0.25", "osp", "osp-0.75") if m in a.modes]
    for rate in speedup:
        base = tp[(rate, "ps-bsp")]
        s = speedup[rate]
        cells = []
        for m in others:
            r = spread(raw, rate, m, "ps-bsp")
            cells.append(f"{s[m]:.2f} ({r[0]:.2f}-{r[1]:.2f})" if m in s and r else "-")
        best = max((tp[(rate, m)]["samples_per_s"] for m in fixed if (rate, m) in tp),
                   default=None)
        auto = tp.get((rate, "osp-auto"))
        lines.append(f"| {rate} | {base['compute_s']:.3f} | {base['wait_s']:.3f} | "
                     f"{bound[rate]:.2f} | " + " | ".join(cells) + " | " +
                     fmt(auto["samples_per_s"] / best if auto and best else None, ".2f") +
                     " | " + fmt(auto["stage1_fraction"] if auto else None, ".2f") + " |")
    for rate, runs in acc.items():
        loss = getattr(a, "target_loss", None) is not None
        goal = f"loss {a.target_loss:g}" if loss else f"{100 * a.target:.0f}%"
        length = (f"{a.accuracy_steps} steps" if getattr(a, "accuracy_steps", 0)
                  else f"{a.epochs:g} epochs")
        cap = (f", at most {a.accuracy_minutes:g} min of training each"
               if getattr(a, "accuracy_minutes", 0) else "")
        base = runs.get("allreduce")
        lines += ["", f"Quality at {rate}, {length} (one run each{cap}); bytes: rank 0's per "
                  "step over the whole run (evaluations' consolidations included):", "",
                  f"| mode | steps run | test accuracy | test loss | vs allreduce | time to "
                  f"{goal} (s) | steps to it | MB sent/step | fewer bytes than allreduce | "
                  "wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
        for mode, r in runs.items():  # (results from before issue 22 lack steps and bytes)
            if base is None or r.get("steps") is None or base.get("steps") != r["steps"]:
                versus = "-"  # not at equal steps
            elif loss:
                versus = f"{r['loss'] - base['loss']:+.3f} nats"
            else:
                versus = f"{100 * (r['accuracy'] - base['accuracy']):+.2f} pt"
            sent = r.get("sent_mb")
            fewer = (f"{base['sent_mb'] / sent:.0f}x" if base and base.get("sent_mb") and sent
                     else "-")
            accuracy = r.get("accuracy")
            lines.append(f"| {mode} | {fmt(r.get('steps'), 'd')} | "
                         f"{fmt(100 * accuracy if accuracy is not None else None, '.2f')} | "
                         f"{fmt(r.get('loss'), '.4f')} | {versus} | "
                         f"{fmt(r['time_to_target_s'], '.0f')} | "
                         f"{fmt(r.get('steps_to_target'), 'd')} | {fmt(sent, '.4f')} | "
                         f"{fewer} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def report(a, tp, raw, acc, speedup, bound, removed, log_every, started):
    """Prints the table and writes table.md, results.json and charts.json under --out."""
    table = table_text(a, tp, raw, acc, speedup, bound, removed, log_every)
    print("\n" + table)
    results = {"throughput": {f"{r}/{m}": v for (r, m), v in tp.items()},
               "raw": {f"{r}/{m}": v for (r, m), v in raw.items()},
               "accuracy": acc, "speedup": speedup, "bound": bound,
               "args": vars(a), "removed_env": removed, "seconds": time.time() - started}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table + "\n")
    print("wrote", write_charts(results, a.out))


def write_charts(results, out):
    """OUT/charts.json for `caravan report` (docs/report.md) from what results.json holds:
    OSP's speedup over ps-bsp against the link rate with its bound (log x), every mode's
    samples/s against the link rate (log x; the modes without servers dashed), compute and
    wait per step at the slowest rate, test accuracy against wall-clock time and the time to
    the target at --accuracy-rate; the throughput table as printed."""
    a = argparse.Namespace(**results["args"])
    tp = {tuple(k.split("/", 1)): v for k, v in results["throughput"].items()}
    speedup, bound, acc = results["speedup"], results["bound"], results.get("accuracy") or {}
    if isinstance(a.accuracy_rate, str):  # results.json from before issue 22: one rate
        acc = {a.accuracy_rate: acc} if acc else {}
        a.accuracy_rate = [a.accuracy_rate]
    rates = [r for r in a.rates if any((r, m) in tp for m in a.modes)]
    modes = [m for m in a.modes if any((r, m) in tp for r in rates)]
    x = [mbit(r) for r in rates]
    out_charts = []
    srates = [r for r in rates if r in speedup]
    if srates:
        sx = [mbit(r) for r in srates]
        osp = [m for m in ("osp-0.25", "osp", "osp-0.75", "osp-nolgp", "osp-auto",
                           "osp-auto-nolgp")
               if any(m in speedup[r] for r in srates)]
        out_charts.append(charts.line(
            "osp-speedup", "OSP's throughput over ps-bsp against the link rate",
            "link rate (Mbit/s)", "samples/s over ps-bsp's",
            [charts.series(m, sx, [speedup[r].get(m) for r in srates]) for m in osp]
            + [charts.series("bound (c+m)/max(c,m)", sx, [bound.get(r) for r in srates],
                             dashed=True),
               charts.series("ps-bsp", sx, [1.0] * len(sx), dashed=True)], log_x=True))
    out_charts.append(charts.line(
        "throughput", "Samples per second against the link rate (dashed: no servers)",
        "link rate (Mbit/s)", "samples / s",
        [charts.series(m, x, [tp.get((r, m), {}).get("samples_per_s") for r in rates],
                       dashed=not MODES.get(m, ([], True))[1]) for m in modes], log_x=True))
    if rates:
        slow = min(rates, key=mbit)
        here = [m for m in modes if (slow, m) in tp]
        out_charts.append(charts.bar(
            "step-split", f"Time per step at {slow}: compute and waiting on synchronization",
            here, [charts.series("compute", y=[tp[(slow, m)]["compute_s"] for m in here]),
                   charts.series("wait", y=[tp[(slow, m)]["wait_s"] for m in here])],
            "s / step (rank 0)", stacked=True, x_label="mode"))
    loss = getattr(a, "target_loss", None) is not None
    goal = f"loss {a.target_loss:g}" if loss else f"{100 * a.target:.0f}% test accuracy"
    scale = 1 if loss else 100
    for rate, runs in acc.items():
        suffix = "" if len(acc) == 1 else f"-{rate}"
        curves = []
        for m, r in runs.items():
            t, y = zip(*r["curve"]) if r["curve"] else ((), ())
            curves.append(charts.series(m, t, [scale * v for v in y]))
        end = max((r["wall_s"] for r in runs.values()), default=0)
        level = a.target_loss if loss else 100 * a.target
        curves.append(charts.series(f"target {level:g}", [0, end], [level] * 2, dashed=True))
        out_charts.append(charts.line(
            "accuracy" + suffix,
            f"Test {'loss' if loss else 'accuracy'} against wall-clock time, links {rate}",
            "wall-clock time (s)", "test loss (nats)" if loss else "test accuracy (%)", curves))
        out_charts.append(charts.bar(
            "time-to-target" + suffix, f"Time to {goal} at {rate} (missing: not reached)",
            list(runs),
            [charts.series("time to target", y=[r["time_to_target_s"] for r in runs.values()]),
             charts.series("whole run", y=[r["wall_s"] for r in runs.values()])],
            "seconds", x_label="mode"))
    removed = results.get("removed_env")  # not in a results.json from before charts.json
    raw = {tuple(k.split("/", 1)): v for k, v in results.get("raw", {}).items()}
    text = table_text(a, tp, raw, acc, speedup, bound, removed,
                      getattr(a, "log_every", 0) or max(1, a.steps // 4))
    head = [l[2:] for l in text.splitlines() if l.startswith("# ")]
    if removed is None:  # the line says "was not set": unknown here
        head[-1] = head[-1].replace("OPENBLAS_CORETYPE was not set; ", "")
    note = "; ".join(head) + (
        ". vs ps-bsp: samples/s over ps-bsp's at the same rate; OSP's bound is (compute + comm)"
        " / max(compute, comm) with ps-bsp's compute and wait per step.")
    # --set is stored as "extra" (its dest); the command line says --set once per value.
    command_args = {k: v for k, v in results["args"].items() if k != "extra"}
    command_args["set"] = results["args"].get("extra", [])
    return charts.write(out, "network", "Synchronization modes on constrained links",
                        out_charts, note=note,
                        command=charts.command("bench/network_sweep.py", command_args,
                                               skip=("replot", "reuse"), repeated=("set",)),
                        table=charts.markdown_table(text))



def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/fmnist-cnn.toml")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--batch", type=int, default=64, help="per-worker batch")
    p.add_argument("--set", dest="extra", action="append", default=[],
                   help="a config override for every run, e.g. --set optim.grad_clip=0 "
                        "(repeatable; brown-gpt's clipping is refused by the server modes)")
    p.add_argument("--rates", nargs="+", default=["1gbit", "500mbit", "300mbit", "100mbit"])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--steps", type=int, default=40, help="throughput runs: steps per run")
    p.add_argument("--log-every", type=int, default=0,
                   help="throughput runs: steps per metrics window, the first dropped (0: a "
                        "quarter of --steps); make the rest a multiple of --diloco-period")
    p.add_argument("--epochs", type=int, default=2, help="accuracy runs (0: skip them)")
    p.add_argument("--accuracy-rate", nargs="+", default=["500mbit"],
                   help="link rates of the accuracy runs (every mode at each)")
    p.add_argument("--accuracy-steps", type=int, default=0,
                   help="accuracy runs: this many steps instead of --epochs epochs")
    p.add_argument("--accuracy-minutes", type=float, default=0,
                   help="accuracy runs: stop each after this many minutes of training "
                        "(train.max_minutes; 0: no limit); a run cut short says so by its steps")
    p.add_argument("--eval-every", type=int, default=0,
                   help="accuracy runs: steps between evaluations (0: a quarter epoch of "
                        "Fashion-MNIST)")
    p.add_argument("--eval-batches", type=int, default=0,
                   help="accuracy runs: evaluation batches (0: the whole test split)")
    p.add_argument("--target", type=float, default=0.88)
    p.add_argument("--target-loss", type=float, default=None,
                   help="time to this test loss instead of --target accuracy (language models)")
    p.add_argument("--diloco-period", type=int, default=32,
                   help="H of the diloco and local-sgd-int4 modes")
    p.add_argument("--fragments", type=int, default=4,
                   help="fragments of streaming-diloco-int4 and ps-streaming-diloco-int4")
    p.add_argument("--timeout", type=int, default=1800, help="seconds per run")
    p.add_argument("--colocate", action="store_true",
                   help="parameter-server modes: as many servers as workers, server shard i on "
                        "worker i's host (sharing its link and CPU share), instead of servers on "
                        "hosts of their own")
    p.add_argument("--cpus", type=float, default=None,
                   help="each host's CPU share in cores (netns_hosts.sh --cpus): hosts x CPUS "
                        "at most this machine's cores, so no host takes another's")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "network"))
    p.add_argument("--reuse", action="store_true",
                   help="read runs already finished under OUT/runs instead of rerunning them "
                        "(to resume an interrupted sweep)")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: rebuild OUT/charts.json from OUT/results.json")
    a = p.parse_args()
    if a.replot:
        with open(os.path.join(a.out, "results.json")) as f:
            print("wrote", write_charts(json.load(f), a.out))
        return
    if not os.path.exists(CARAVAN):
        sys.exit("network_sweep: build/caravan missing; run bash scripts/setup.sh first")
    if a.cpus is not None and a.cpus <= 0:
        sys.exit(f"network_sweep: --cpus must be above 0 cores, got {a.cpus}")
    if a.colocate:
        a.servers = a.workers
    _, removed = env()
    os.makedirs(a.out, exist_ok=True)
    work = os.path.join(a.out, "runs")
    # Run directories name the placement and CPU share, so --reuse never takes another's runs.
    variant = ("-colocated" if a.colocate else "") + (f"-cpus{a.cpus:g}" if a.cpus else "")
    started = time.time()

    raw = {}  # (rate, mode) -> [numbers per repeat]
    log_every = a.log_every or max(1, a.steps // 4)
    for rep in range(a.repeats):
        for rate in a.rates:
            for mode in a.modes:
                rec = run(mode, rate, a, os.path.join(work, f"tp-{rate}-{mode}-{rep}{variant}"),
                          [f"train.max_steps={a.steps}", f"train.log_every={log_every}",
                           "train.eval_every=1000000", "train.eval_batches=1"])
                raw.setdefault((rate, mode), []).append(throughput_numbers(rec))
                n = raw[(rate, mode)][-1]
                print(f"[{time.time() - started:6.0f}s] {rate:>8} {mode:<10} repeat {rep}: "
                      f"{n['samples_per_s']:7.1f} samples/s", flush=True)
    tp = {}
    for key, runs in raw.items():
        tp[key] = {k: (statistics.median(r[k] for r in runs) if runs[0][k] is not None else None)
                   for k in runs[0]}

    speedup, bound = {}, {}
    for rate in a.rates:
        base = tp.get((rate, "ps-bsp"))
        if not base:
            continue
        c, m = base["compute_s"], base["wait_s"]
        bound[rate] = (c + m) / max(c, m)
        speedup[rate] = {mode: tp[(rate, mode)]["samples_per_s"] / base["samples_per_s"]
                         for mode in a.modes if (rate, mode) in tp}

    # The throughput table first, so an interrupted accuracy part loses nothing.
    report(a, tp, raw, {}, speedup, bound, removed, log_every, started)
    acc = {}
    if a.epochs > 0 or a.accuracy_steps > 0:
        every = a.eval_every or 60000 // (a.workers * a.batch) // 4
        length = ([f"train.max_steps={a.accuracy_steps}", "train.epochs=1000000"]
                  if a.accuracy_steps else [f"train.epochs={a.epochs}"])
        if a.accuracy_minutes:
            length.append(f"train.max_minutes={a.accuracy_minutes}")
        for rate in a.accuracy_rate:
            for mode in a.modes:
                rec = run(mode, rate, a, os.path.join(work, f"acc-{rate}-{mode}{variant}"),
                          length + [f"train.eval_every={every}", f"train.log_every={every}",
                                    f"train.eval_batches={a.eval_batches}"])
                n = acc.setdefault(rate, {})[mode] = accuracy_numbers(rec, a.target,
                                                                      a.target_loss)
                print(f"[{time.time() - started:6.0f}s] {rate:>8} quality {mode:<10}: "
                      f"loss {n['loss']:.4f} accuracy {fmt(n['accuracy'], '.4f')} after "
                      f"{n['steps']} steps, target at {fmt(n['time_to_target_s'], '.0f')} s, "
                      f"{n['sent_mb']:.4f} MB/step", flush=True)
                report(a, tp, raw, acc, speedup, bound, removed, log_every, started)



if __name__ == "__main__":
    main()
