#!/usr/bin/env python3
"""Training beyond the memory budget (issue 5): brown-gpt sized so that keep-everything needs
several times the smallest budget; for a sweep of budgets, forward+backward time per step with
the planner (memory.policy = auto), all-recompute, all-swap and all-swap-input, against
keep-everything without a budget; predicted vs measured; one table from one invocation.

    .venv/bin/python bench/memory_sweep.py [--depth 12] [--context 128] [--heads 4] [--batch 32]
        [--tier-mbps 50] [--tier-dtype float32|bf16|both]
        [--fractions 0.5 0.33 0.25 0.2]
        [--steps 6] [--repeats 2] [--overhead-mib 512] [--out bench/results/memory]
    .venv/bin/python bench/memory_sweep.py --replot [--out bench/results/memory]

Runs are interleaved (keep, then every mode at each budget, then the next repeat) and each
number is the median over repeats of a run's median forward+backward time (its first step
dropped). Every budgeted run is verified inside a memory cgroup limited to the budget plus
--overhead-mib (the LibTorch runtime, the dataset, transient tensors the tracker does not
count: block outputs, gradients, temporaries): a run the kernel kills is reported as killed.
A mode whose tracked peak does not fit the budget stops with caravan's own error; it is
reported as "does not fit". Needs root for the cgroup (cgroup v1 memory controller or v2);
without one the runs are not verified and the table says so.

Written under --out: table.md (the table as printed), results.json (every run) and charts.json
(for `caravan report`, docs/report.md: time per step against the budget per policy, throughput
against keep-everything, tracked peak against the budget, and the table). --replot runs
nothing: it rebuilds OUT/charts.json from OUT/results.json (a results.json from before the
sweep's settings were stored in it is read with this command line's --depth etc.).

OPENBLAS_CORETYPE is removed from the measured processes' environment; every run is
single-threaded (train.threads = 1), leaving the other core to the tier's I/O threads and the
data loader. The tier is the disk (memory.swap_dir, default /var/tmp) with direct I/O.
--tier-dtype bf16 stores swapped activations as bf16 in every budgeted run (memory.tier_dtype);
both runs the planner, swap and swap-input once each way, interleaved ("swap@bf16" in the
table), and compares each planner with the single policies stored its way (and recompute).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts  # noqa: E402  (charts.json for caravan report)
from train_throughput import env  # noqa: E402  (the benchmark environment, shared)

MODES = ["auto", "recompute", "swap", "swap-input"]
BF16 = "@bf16"  # a mode's suffix: its swaps stored as bf16 (--tier-dtype both)


def modes_of(args):
    """The modes a sweep runs, as named in its table: MODES, and with --tier-dtype both the
    tier-using ones again with BF16."""
    if getattr(args, "tier_dtype", "float32") != "both":
        return list(MODES)
    return MODES + [m + BF16 for m in MODES if m != "recompute"]
MIB = 1 << 20


def remove_cgroup(path):
    """rmdir a cgroup, retrying while its processes are still leaving it."""
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


class Cgroup:
    """A memory cgroup (v1 or v2) for one process tree; None where neither is writable."""

    def __init__(self, name, limit):
        self.v1 = os.path.isdir("/sys/fs/cgroup/memory")
        base = "/sys/fs/cgroup/memory" if self.v1 else "/sys/fs/cgroup"
        self.path = os.path.join(base, name)
        os.mkdir(self.path)
        if limit:
            self.write("memory.limit_in_bytes" if self.v1 else "memory.max", str(limit))
            if self.v1 and os.path.exists(os.path.join(self.path, "memory.memsw.limit_in_bytes")):
                self.write("memory.memsw.limit_in_bytes", str(limit))  # no escape into swap

    def write(self, name, value):
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def read(self, name):
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def enter(self):  # in the child, before exec
        self.write("cgroup.procs", str(os.getpid()))

    def max_usage(self):
        return int(self.read("memory.max_usage_in_bytes" if self.v1 else "memory.peak"))

    def oom_kills(self):
        text = self.read("memory.oom_control" if self.v1 else "memory.events")
        for line in text.splitlines():
            k, _, v = line.partition(" ")
            if k == "oom_kill":
                return int(v)
        return 0

    def remove(self):
        remove_cgroup(self.path)


class TierThrottle:
    """A cgroup-v1 blkio cgroup that throttles reads and writes on the device holding
    `directory` to `bps` bytes per second (direct I/O, as the file tier does, is throttled;
    buffered writes would escape it). None where /sys/fs/cgroup/blkio is missing."""

    def __init__(self, name, directory, bps):
        self.device = TierThrottle.disk_of(directory)
        self.path = os.path.join("/sys/fs/cgroup/blkio", name)
        os.mkdir(self.path)
        try:
            for kind in ("read", "write"):
                with open(os.path.join(self.path, f"blkio.throttle.{kind}_bps_device"), "w") as f:
                    f.write(f"{self.device} {int(bps)}")
        except OSError:
            self.remove()
            raise

    @staticmethod
    def disk_of(directory):
        """MAJ:MIN of the disk holding `directory` (blkio throttles whole disks: a partition's
        rule goes on its disk); None when it is on no block device (tmpfs, overlay, btrfs
        subvolumes)."""
        st = os.stat(directory)
        device = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
        sysdev = os.path.realpath(f"/sys/dev/block/{device}")
        if not os.path.exists(sysdev):
            return None
        if os.path.exists(os.path.join(sysdev, "partition")):
            with open(os.path.join(os.path.dirname(sysdev), "dev")) as f:
                device = f.read().strip()
        return device

    def enter(self):  # in the child, before exec
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def remove(self):
        remove_cgroup(self.path)


# Bytes per second the tier's device is throttled to in every run (--tier-mbps; 0: not).
TIER_BPS = 0
TIER_DIR = "/var/tmp"


def cgroups_available():
    """A memory cgroup can be made and limited here (v1, or v2 with the memory controller)."""
    try:
        c = Cgroup(f"caravan-probe-{os.getpid()}", 1 << 30)
        c.remove()
        return True
    except OSError:
        return False


def run_train(sets, run_dir, environ, limit, use_cgroup, name, extra_args=()):
    """`caravan train` of configs/brown-gpt.toml with --set `sets` into `run_dir`, inside a memory cgroup limited to `limit` bytes (0: no limit) when
    `use_cgroup`. Returns a record: rc, wall_s, the cgroup's peak and OOM kills, killed, and
    the run's summary.json (rc 0) or its error (the first "caravan:" line of stderr, else the
    last line). The run directory stays for the caller to read and remove."""
    cmd = [CARAVAN, "train", "-c", os.path.join(ROOT, "configs", "brown-gpt.toml"), "--run-dir",
           run_dir, "-q", *extra_args]
    for s in sets:
        cmd += ["--set", s]
    cgroup = Cgroup(name, limit) if use_cgroup else None
    try:
        throttle = TierThrottle(name, TIER_DIR, TIER_BPS) if TIER_BPS else None
    except OSError:
        if cgroup:
            cgroup.remove()
        raise

    def enter():
        if cgroup:
            cgroup.enter()
        if throttle:
            throttle.enter()

    t0 = time.time()
    try:
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True,
                               timeout=1800, preexec_fn=enter)
        except subprocess.TimeoutExpired:
            sys.exit(f"{os.path.basename(sys.argv[0])}: {' '.join(cmd)} ran past 30 minutes")
        r = {"rc": p.returncode, "wall_s": time.time() - t0}
        if cgroup:
            r["cgroup_max_usage"] = cgroup.max_usage()
            r["oom_kills"] = cgroup.oom_kills()
    finally:
        if cgroup:
            cgroup.remove()
        if throttle:
            throttle.remove()
    r["killed"] = p.returncode in (-9, 137) or r.get("oom_kills", 0) > 0
    if p.returncode == 0:
        with open(os.path.join(run_dir, "summary.json")) as f:
            r["summary"] = json.load(f)
    else:
        lines = [l for l in p.stderr.strip().splitlines() if l.strip()]
        r["error"] = next((l for l in lines if "caravan:" in l),
                          lines[-1] if lines else "(no output)")
    return r


def run(args, mode, budget, environ, tmp, use_cgroup, tag):
    run_dir = os.path.join(tmp, tag)
    sets = ["train.precision=float32", "schedule.horizon=steps",  # as measured before bf16
            f"model.depth={args.depth}", f"model.heads={args.heads}",
            f"data.seq_len={args.context}", f"data.batch_size={args.batch}",
            "train.threads=1", f"train.max_steps={args.steps}",
            "train.log_every=1", "train.eval_batches=1", "checkpoint.every=0",
            f"memory.profile_repeats={args.profile_repeats}", f"memory.swap_dir={args.swap_dir}"]
    if mode != "keep":
        policy = mode.removesuffix(BF16)
        sets += [f"memory.policy={policy}", f"memory.budget={budget}"]
        if mode.endswith(BF16) or getattr(args, "tier_dtype", "float32") == "bf16":
            sets.append("memory.tier_dtype=bf16")
    limit = budget + args.overhead_mib * MIB if mode != "keep" else 0
    r = {"mode": mode, "budget": budget,
         **run_train(sets, run_dir, environ, limit, use_cgroup,
                     f"caravan-bench-{os.getpid()}-{tag}")}
    shutil.rmtree(run_dir, ignore_errors=True)
    return r


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(results):
    """The table (markdown: what is printed and written to table.md) and the numbers behind it,
    from what results.json holds: (table, keep-everything's median fwd+bwd seconds, {budget:
    {"modes": {mode: {time, pred, peak, cgroup, verdict, plan}}, "best_single": (mode, s)}}).
    Per budget and mode, medians over repeats; a mode's time is None unless every repeat ran."""
    args = argparse.Namespace(**results["args"])
    keep_need, budgets, runs = results["keep_need"], results["budgets"], results["runs"]
    removed, use_cgroup = results.get("removed_env", []), results.get("cgroup", False)
    keep_times = [r["summary"]["fwd_bwd_s"] for r in runs if r["mode"] == "keep" and r["rc"] == 0]
    keep_t = med(keep_times)
    lines = []
    lines.append(f"brown-gpt depth {args.depth} (width 128, {args.heads} heads, context "
                 f"{args.context}, batch {args.batch}, 1 thread), "
                 f"{args.steps} steps per run, {args.repeats} repeats interleaved; "
                 f"keep-everything tracks {keep_need / MIB:.1f} MiB and takes "
                 f"{keep_t * 1e3:.0f} ms forward+backward (median of {len(keep_times)} runs). "
                 + ("Each budgeted run ran in a memory cgroup limited to budget + "
                    f"{results['overhead_mib']} MiB." if use_cgroup else
                    "NO cgroup was available: runs were not verified.")
                 + (f" {', '.join(removed)} removed from the environment." if removed else "")
                 + (f" The tier's device was throttled to {args.tier_mbps:g} MB/s for reads and "
                    "writes (cgroup-v1 blkio) in every run." if getattr(args, "tier_mbps", 0)
                    else "")
                 + {"bf16": " Swapped activations were stored as bf16 (memory.tier_dtype) in "
                            "every budgeted run.",
                    "both": f" Modes ending {BF16} stored swapped activations as bf16 "
                            "(memory.tier_dtype)."}.get(getattr(args, "tier_dtype", "float32"),
                                                        ""))
    lines.append("")
    lines.append("| budget | keep needs | mode | plan | fwd+bwd ms | vs keep | predicted ms | "
                 "error | tracked peak MiB | cgroup max MiB | verdict |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
    summary = {}
    for bi, budget in enumerate(budgets):
        per_mode = {}
        for mode in modes_of(args):
            rs = [r for r in runs if r["budget_index"] == bi and r["mode"] == mode]
            ok = [r for r in rs if r["rc"] == 0]
            killed = any(r["killed"] for r in rs)
            t = med([r["summary"]["fwd_bwd_s"] for r in ok])
            pred = med([r["summary"].get("predicted_fwd_bwd_s") for r in ok])
            peak = max((r["summary"]["tracked_peak_bytes"] for r in ok), default=None)
            cg = max((r.get("cgroup_max_usage", 0) for r in rs), default=0)
            if killed:
                verdict = "KILLED by the cgroup"
            elif not ok:
                verdict = "does not fit: " + rs[0].get("error", "")[:80]
            elif len(ok) < len(rs):
                verdict = "failed in some repeats"
            else:
                verdict = "ok"
            plan = ok[0]["summary"]["memory_policy"] if ok else ""
            planner = mode.removesuffix(BF16) == "auto"
            if not planner and plan:
                plan = mode  # uniform
            short = {"keep": "k", "recompute": "r", "swap": "s", "swap-input": "i"}
            if planner and plan:
                plan = "".join(short[p] for p in plan.split(","))
            per_mode[mode] = {"time": t if len(ok) == len(rs) and not killed else None,
                              "pred": pred, "peak": peak, "cgroup": cg, "verdict": verdict,
                              "plan": plan}
            cells = [f"{budget / MIB:.1f} MiB", f"{keep_need / budget:.1f}x", mode, plan,
                     f"{t * 1e3:.0f}" if t else "-", f"{keep_t / t:.2f}" if t else "-",
                     f"{pred * 1e3:.0f}" if pred else "-",
                     f"{(pred / t - 1) * 100:+.1f}%" if t and pred else "",
                     f"{peak / MIB:.1f}" if peak else "-", f"{cg / MIB:.0f}" if cg else "-",
                     verdict]
            lines.append("| " + " | ".join(cells) + " |")
        # Each planner against the single policies stored its way (recompute stores nothing).
        best = {}
        for planner in (m for m in per_mode if m.removesuffix(BF16) == "auto"):
            suffix = planner[len("auto"):]
            singles = {m: v["time"] for m, v in per_mode.items() if v["time"] and
                       m.removesuffix(BF16) != "auto" and
                       ((m.endswith(suffix) or m == "recompute") if suffix else
                        not m.endswith(BF16))}
            best[planner] = min(singles.items(), key=lambda kv: kv[1]) if singles else None
        summary[budget] = {"modes": per_mode, "best_single": best["auto"], "best_single_by": best}
    lines.append("")
    lines.append("Planner against the best single policy that fits (forward+backward time):")
    lines.append("")
    for budget, s in summary.items():
        for planner, b in s["best_single_by"].items():
            a = s["modes"][planner]["time"]
            vs = f"{b[1] / a:.2f}x the best single policy ({b[0]})" if a and b else \
                ("no single policy fits" if a else "the planner's run failed")
            lines.append(f"- {budget / MIB:.1f} MiB ({keep_need / budget:.1f}x below keep): "
                         f"{'planner' if planner == 'auto' else planner} "
                         + (f"{keep_t / a * 100:.0f}% of keep's throughput, " if a else "") + vs)
    return "\n".join(lines) + "\n", keep_t, summary


def write_charts(results, out, known_args=True):
    """OUT/charts.json for `caravan report` (docs/report.md) from what results.json holds:
    forward+backward time against the budget per policy (keep-everything, which has no
    budget, and the planner's prediction dashed), throughput against keep-everything, and the
    tracked peak against the budget; the table as printed. known_args: results["args"] are
    the sweep's own (not filled in from a --replot command line for an older results.json)."""
    table, keep_t, summary = summarize(results)
    args = argparse.Namespace(**results["args"])
    keep_need = results["keep_need"]
    budgets = list(summary)
    x = [b / MIB for b in budgets]
    ms = lambda v: v * 1e3 if v else None  # noqa: E731
    step = [charts.series(mode, x, [ms(summary[b]["modes"][mode]["time"]) for b in budgets])
            for mode in modes_of(args)]
    for planner in (m for m in modes_of(args) if m.removesuffix(BF16) == "auto"):
        step.append(charts.series(f"{planner}, predicted", x,
                                  [ms(summary[b]["modes"][planner]["pred"]) for b in budgets],
                                  dashed=True))
    step.append(charts.series("keep (no budget)", x, [ms(keep_t)] * len(x), dashed=True))
    labels = [f"{b / MIB:.0f} MiB (1/{keep_need / b:.1f})" for b in budgets]
    speed = [charts.series(mode, y=[keep_t / t if t and keep_t else None for t in
                                    (summary[b]["modes"][mode]["time"] for b in budgets)])
             for mode in modes_of(args)]
    peak = [charts.series("budget", y=x)] + [
        charts.series(mode, y=[summary[b]["modes"][mode]["peak"] / MIB
                               if summary[b]["modes"][mode]["peak"] else None for b in budgets])
        for mode in modes_of(args)]
    paragraphs = table.split("\n\n")
    bullets = [l[2:] for l in table.splitlines() if l.startswith("- ")]
    note = (paragraphs[0].strip() + " Planner against the best single policy that fits: "
            + "; ".join(bullets) + ". A missing point: the policy does not fit that budget."
            + ("" if known_args else " (results.json does not record the sweep's settings: "
               "model size, steps and repeats above are this --replot command line's.)"))
    return charts.write(
        out, "memory", "Training beyond the memory budget: planner against single policies", [
            charts.line("step-time", "Forward+backward time per step against the budget",
                        "memory budget (MiB)", "fwd+bwd ms", step),
            charts.bar("vs-keep", "Throughput against keep-everything (no budget)", labels,
                       speed, "keep time / time", x_label="budget (fraction of keep's memory)"),
            charts.bar("tracked-peak", "Tracked peak against the budget", labels, peak,
                       "MiB", x_label="budget (fraction of keep's memory)"),
        ], note=note, command=charts.command("bench/memory_sweep.py", results["args"])
        if known_args else None,
        table=charts.markdown_table(table))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--depth", type=int, default=12)
    ap.add_argument("--context", type=int, default=128, help="data.seq_len")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.33, 0.25, 0.2],
                    help="budgets as fractions of what keep-everything tracks")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-repeats", type=int, default=2)
    ap.add_argument("--overhead-mib", type=int, default=512)
    ap.add_argument("--swap-dir", default="/var/tmp")
    ap.add_argument("--tier-mbps", type=float, default=0,
                    help="throttle the swap directory's device to this many MB/s (10^6 bytes) "
                         "for reads and writes in every run (cgroup-v1 blkio; 0: not)")
    ap.add_argument("--tier-dtype", choices=["float32", "bf16", "both"], default="float32",
                    help="memory.tier_dtype of the budgeted runs; both: the planner, swap and "
                         "swap-input each way")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "memory"))
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: rebuild OUT/charts.json from OUT/results.json")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(args.out, "results.json")) as f:
            results = json.load(f)
        stored = "args" in results  # results.json has them since charts.json was added
        results.setdefault("args", vars(args))
        print("wrote", write_charts(results, args.out, known_args=stored))
        return
    if not os.path.exists(CARAVAN):
        sys.exit("memory_sweep: build/caravan missing; run bash scripts/setup.sh first")
    environ, removed = env()
    use_cgroup = cgroups_available()
    global TIER_BPS, TIER_DIR
    TIER_BPS, TIER_DIR = int(args.tier_mbps * 1e6), args.swap_dir
    if TIER_BPS and not os.path.isdir("/sys/fs/cgroup/blkio"):
        sys.exit("memory_sweep: --tier-mbps needs the cgroup-v1 blkio controller "
                 "(/sys/fs/cgroup/blkio)")
    if TIER_BPS and TierThrottle.disk_of(TIER_DIR) is None:
        sys.exit(f"memory_sweep: --tier-mbps: {TIER_DIR} is on no block device to throttle; "
                 "give --swap-dir on a disk")
    tmp = tempfile.mkdtemp(prefix="caravan-memory-sweep-")
    runs = []
    try:
        # The keep-everything size decides the budgets: one keep run first.
        first = run(args, "keep", 0, environ, tmp, use_cgroup, "probe")
        if first["rc"] != 0:
            sys.exit(f"memory_sweep: keep run failed: {first.get('error')}")
        keep_need = first["summary"]["tracked_peak_bytes"]
        budgets = [int(keep_need * f) for f in args.fractions]
        print(f"keep-everything tracks {keep_need / MIB:.1f} MiB; budgets (MiB): "
              f"{', '.join(f'{b / MIB:.1f}' for b in budgets)}", flush=True)
        for rep in range(args.repeats):
            for bi, budget in enumerate(budgets):
                # keep (no budget) next to each budget's runs: A B A B ...
                for mode in ["keep"] + modes_of(args):
                    tag = f"r{rep}-b{bi}-{mode}"
                    r = run(args, mode, budget, environ, tmp, use_cgroup, tag)
                    r["repeat"], r["budget_index"] = rep, bi
                    runs.append(r)
                    s = r.get("summary", {})
                    print(f"  repeat {rep} budget {budget / MIB:.1f} MiB {mode:<10} rc {r['rc']} "
                          f"fwd+bwd {s.get('fwd_bwd_s', float('nan')) * 1e3:.0f} ms "
                          f"pred {s.get('predicted_fwd_bwd_s', float('nan')) * 1e3:.0f} ms "
                          f"tracked {s.get('tracked_peak_bytes', 0) / MIB:.1f} MiB "
                          f"cgroup {r.get('cgroup_max_usage', 0) / MIB:.0f} MiB "
                          f"{r.get('error', '')}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results = {"keep_need": keep_need, "budgets": budgets, "runs": runs,
               "overhead_mib": args.overhead_mib, "cgroup": use_cgroup,
               "removed_env": removed, "args": vars(args)}
    table, _, _ = summarize(results)
    print()
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("wrote", write_charts(results, args.out))


if __name__ == "__main__":
    main()
