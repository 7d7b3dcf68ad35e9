#!/usr/bin/env python3
"""Out-of-core weights and optimizer state with 2 data-parallel workers (issue 5): brown-gpt
sized so that weights, gradients and AdamW state alone need more than the budgets; for a sweep
of per-worker budgets, the step time of 2 workers (BSP all-reduce) with memory.weights =
offload and memory.policy = auto, against the in-core data-parallel run without a budget; one
table from one invocation.

    .venv/bin/python bench/weights_sweep.py [--width 512] [--depth 8] [--heads 8]
        [--context 64] [--batch 16] [--fractions 0.6 0.45 0.35]
        [--steps 6] [--repeats 2] [--overhead-mib 512] [--out bench/results/weights]
    .venv/bin/python bench/weights_sweep.py --replot [--out bench/results/weights]

Runs (each `caravan train --workers 2`):
  core-keep      in core, everything kept, no budget: the data-parallel baseline
  offload-keep   weights offloaded, activations kept, no budget: the cost of moving weights
  offload@B      weights offloaded, the planner places activations in what B leaves
  core-auto@B    in core under B (the planner): shows whether B needs the offload at all
Runs are interleaved (core-keep, offload-keep, then every budget's runs, then the next repeat).
Step time is the median over a run's steps (the first dropped) of the time between train
records (forward, backward, gradient exchange, the optimizer: everything), then the median over
repeats. Every budgeted run is verified inside one memory cgroup for the job (launcher and both
workers) limited to 2 x (budget + --overhead-mib); the overhead holds the LibTorch runtime,
untracked transients and the allocator's cache of freed memory, which the budgeted runs bound
with train.freed_memory_cache = --freed-cache-mib (the unbudgeted runs keep the default 1 GiB).
Needs root for the cgroup.

Written under --out: table.md (the table as printed), results.json (every run) and charts.json
(for `caravan report`, docs/report.md: step time against the budget, throughput against the
in-core run, tracked peak against the budget, and the table). --replot runs nothing: it
rebuilds OUT/charts.json from OUT/results.json.

OPENBLAS_CORETYPE is removed from the measured processes' environment; every worker is
single-threaded (train.threads = 1). optim.grad_clip = 0 in every run: clipping needs every
gradient before any update, which takes away the overlap of updates with backward. The tier is the disk (memory.swap_dir, default /var/tmp)
with direct I/O, shared by both workers.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import charts  # noqa: E402  (charts.json for caravan report)
from memory_sweep import cgroups_available, med, run_train  # noqa: E402
from train_throughput import env  # noqa: E402

MIB = 1 << 20
WORKERS = 2


def step_times(run_dir):
    """Seconds between consecutive train records (log_every = 1), the first step dropped."""
    times = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if j["kind"] == "train":
                times.append(j["time_s"])
    return [b - a for a, b in zip(times, times[1:])]


def run(args, kind, budget, environ, tmp, use_cgroup, tag):
    run_dir = os.path.join(tmp, tag)
    sets = ["train.precision=float32", "schedule.horizon=steps",  # as measured before bf16
            f"model.width={args.width}", f"model.depth={args.depth}", f"model.heads={args.heads}",
            f"data.seq_len={args.context}", f"data.batch_size={args.batch}",
            "train.threads=1", f"train.max_steps={args.steps}", "train.log_every=1",
            "train.eval_every=0", "train.eval_batches=1", "checkpoint.every=0",
            "sync.mode=allreduce", "optim.grad_clip=0",
            f"memory.profile_repeats={args.profile_repeats}",
            f"memory.swap_dir={args.swap_dir}"]
    if kind.startswith("offload"):
        sets.append("memory.weights=offload")
    if budget:
        sets += ["memory.policy=auto", f"memory.budget={budget}",
                 f"train.freed_memory_cache={args.freed_cache_mib}MiB"]
    limit = WORKERS * (budget + args.overhead_mib * MIB) if budget else 0
    r = {"kind": kind, "budget": budget,
         **run_train(sets, run_dir, environ, limit, use_cgroup,
                     f"caravan-wbench-{os.getpid()}-{tag}", ["--workers", str(WORKERS)])}
    if r["rc"] == 0:
        steps = step_times(run_dir)
        r["step_s"] = statistics.median(steps[1:] if len(steps) > 1 else steps)
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            last = [json.loads(l) for l in f if '"train"' in l][-1]
        r["last_record"] = last
    shutil.rmtree(run_dir, ignore_errors=True)
    return r


def summarize(results):
    """The table (markdown: what is printed and written to table.md) from what results.json
    holds, and its rows as dicts (kind, budget, time: median step seconds or None, peak, read,
    written, cgroup, verdict, plan), in the table's order."""
    args = argparse.Namespace(**results["args"])
    keep_need, budgets, runs = results["keep_need"], results["budgets"], results["runs"]
    removed, use_cgroup = results.get("removed_env", []), results.get("cgroup", False)

    def times(kind, bi):
        return [r["step_s"] for r in runs
                if r["kind"] == kind and r["budget_index"] == bi and r["rc"] == 0]

    core_t = med(times("core-keep", -1))
    off_t = med(times("offload-keep", -1))
    lines = [f"brown-gpt width {args.width}, depth {args.depth}, {args.heads} heads, context "
             f"{args.context}, batch {args.batch} per worker, {WORKERS} workers (BSP all-reduce, "
             f"gloo), AdamW without clipping, 1 thread each; {args.steps} steps per run, {args.repeats} repeats "
             f"interleaved. In core, keep-everything tracks {keep_need / MIB:.1f} MiB per worker "
             f"and a step takes {core_t * 1e3:.0f} ms (median of {len(times('core-keep', -1))} "
             "runs). "
             + (f"Each budgeted job ran in a memory cgroup limited to {WORKERS} x (budget + "
                f"{args.overhead_mib} MiB), with train.freed_memory_cache = "
                f"{args.freed_cache_mib} MiB." if use_cgroup else
                "NO cgroup was available: runs were not verified.")
             + (f" {', '.join(removed)} removed from the environment." if removed else ""),
             "",
             "| run | budget per worker | below in-core keep | step ms | vs in-core DP | "
             "fwd+bwd ms measured / predicted | activation plan | tracked peak MiB | "
             "weights read / written per step MiB | cgroup max MiB (job) | verdict |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]

    def row(kind, bi, budget):
        rs = [r for r in runs if r["kind"] == kind and r["budget_index"] == bi]
        ok = [r for r in rs if r["rc"] == 0]
        t = med([r["step_s"] for r in ok]) if ok else None
        killed = any(r["killed"] for r in rs)
        if killed:
            verdict = "KILLED by the cgroup"
        elif not ok:
            verdict = "does not fit: " + rs[0].get("error", "")[:100] if rs else "not run"
        elif len(ok) < len(rs):
            verdict = "failed in some repeats"
        else:
            verdict = "ok"
        plan = ok[0]["summary"]["memory_policy"] if ok else ""
        short = {"keep": "k", "recompute": "r", "swap": "s", "swap-input": "i"}
        plan = "".join(short.get(p, "?") for p in plan.split(",")) if plan else ""
        peak = max((r["summary"]["tracked_peak_bytes"] for r in ok), default=None)
        rd = med([r["last_record"].get("weights_read_bytes") for r in ok]) if ok else None
        wr = med([r["last_record"].get("weights_written_bytes") for r in ok]) if ok else None
        cg = max((r.get("cgroup_max_usage", 0) for r in rs), default=0)
        # The trainer's own check of the planner (summary.json; rank 0): forward+backward.
        fb = med([r["summary"].get("fwd_bwd_s") for r in ok]) if ok else None
        pred = med([r["summary"].get("predicted_fwd_bwd_s") for r in ok]) if ok else None
        fwd = (f"{fb * 1e3:.0f} / {pred * 1e3:.0f} ({(fb / pred - 1) * 100:+.1f}%)"
               if fb and pred else (f"{fb * 1e3:.0f} / -" if fb else "-"))
        cells = [kind, f"{budget / MIB:.1f} MiB" if budget else "none",
                 f"{keep_need / budget:.2f}x" if budget else "-",
                 f"{t * 1e3:.0f}" if t else "-",
                 f"{core_t / t:.2f}" if t and core_t else "-", fwd, plan,
                 f"{peak / MIB:.1f}" if peak else "-",
                 f"{rd / MIB:.0f} / {wr / MIB:.0f}" if rd else "-",
                 f"{cg / MIB:.0f}" if cg else "-", verdict]
        lines.append("| " + " | ".join(cells) + " |")
        rows.append({"kind": kind, "budget": budget, "time": t, "peak": peak, "read": rd,
                     "written": wr, "cgroup": cg, "verdict": verdict, "plan": plan,
                     "fwd_bwd": fb, "predicted": pred})
        return t

    rows = []
    row("core-keep", -1, 0)
    row("offload-keep", -1, 0)
    offload_t = {}
    for bi, budget in enumerate(budgets):
        offload_t[budget] = row("offload", bi, budget)
        row("core-auto", bi, budget)
    lines += ["", "Out of core against the in-core data-parallel run (throughput ratio):", ""]
    if off_t and core_t:
        lines.append(f"- no budget, activations kept: {core_t / off_t * 100:.0f}% of in-core")
    for budget, t in offload_t.items():
        lines.append(f"- {budget / MIB:.1f} MiB per worker ({keep_need / budget:.2f}x below "
                     f"in-core keep): " + (f"{core_t / t * 100:.0f}% of in-core" if t else
                                           "did not run"))
    return "\n".join(lines) + "\n", rows


def write_charts(results, out):
    """OUT/charts.json for `caravan report` (docs/report.md) from what results.json holds: the
    step time of 2 workers out of core against the budget per worker (in core and out of core
    without a budget dashed), throughput against the in-core data-parallel run, and the tracked
    peak against the budget; the table as printed."""
    table, rows = summarize(results)
    keep_need = results["keep_need"]
    get = lambda kind, budget=0: next((r for r in rows if r["kind"] == kind  # noqa: E731
                                       and r["budget"] == budget), {})
    budgets = results["budgets"]
    x = [b / MIB for b in budgets]
    ms = lambda v: v * 1e3 if v else None  # noqa: E731
    core_t, off_t = get("core-keep").get("time"), get("offload-keep").get("time")
    core_auto = [get("core-auto", b).get("time") for b in budgets]
    step = [charts.series("offload, planner", x, [ms(get("offload", b).get("time"))
                                                  for b in budgets]),
            charts.series("in core, planner" + ("" if any(core_auto) else " (does not fit)"),
                          x, [ms(t) for t in core_auto]),
            charts.series("in core, no budget", x, [ms(core_t)] * len(x), dashed=True),
            charts.series("offload, no budget", x, [ms(off_t)] * len(x), dashed=True)]
    labels = ["none, in core", "none, offload"] + [
        f"{b / MIB:.0f} MiB (1/{keep_need / b:.2f})" for b in budgets]
    picked = [get("core-keep"), get("offload-keep")] + [get("offload", b) for b in budgets]
    ratio = [core_t / r["time"] if r.get("time") and core_t else None for r in picked]
    peak = [charts.series("tracked peak", y=[r.get("peak") / MIB if r.get("peak") else None
                                             for r in picked]),
            charts.series("budget", y=[None, None] + x)]
    paragraphs = table.split("\n\n")
    bullets = [l[2:] for l in table.splitlines() if l.startswith("- ")]
    note = (paragraphs[0].strip() + " Out of core against the in-core data-parallel run: "
            + "; ".join(bullets) + ". In core, a missing point: the planner refuses the budget.")
    return charts.write(
        out, "weights", "Out-of-core weights and optimizer state, 2 workers", [
            charts.line("step-time", "Step time of 2 workers against the budget per worker",
                        "memory budget per worker (MiB)", "step ms", step),
            charts.bar("vs-in-core", "Throughput against in-core data-parallel (no budget)",
                       labels, [charts.series("in-core step time / step time", y=ratio)],
                       "in-core time / time", x_label="budget per worker"),
            charts.bar("tracked-peak", "Tracked peak per worker against the budget", labels,
                       peak, "MiB", x_label="budget per worker"),
        ], note=note, command=charts.command("bench/weights_sweep.py", results["args"]),
        table=charts.markdown_table(table))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=64, help="data.seq_len")
    ap.add_argument("--batch", type=int, default=16, help="per worker")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.6, 0.45, 0.35],
                    help="budgets as fractions of what in-core keep-everything tracks")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--profile-repeats", type=int, default=2)
    ap.add_argument("--overhead-mib", type=int, default=512)
    ap.add_argument("--freed-cache-mib", type=int, default=256,
                    help="train.freed_memory_cache of the budgeted runs (inside the overhead)")
    ap.add_argument("--swap-dir", default="/var/tmp")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "weights"))
    ap.add_argument("--replot", action="store_true",
                    help="run nothing: rebuild OUT/charts.json from OUT/results.json")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(args.out, "results.json")) as f:
            print("wrote", write_charts(json.load(f), args.out))
        return
    if not os.path.exists(CARAVAN):
        sys.exit("weights_sweep: build/caravan missing; run bash scripts/setup.sh first")
    environ, removed = env()
    use_cgroup = cgroups_available()
    tmp = tempfile.mkdtemp(prefix="caravan-weights-sweep-")
    runs = []

    def record(r, rep, bi):
        r["repeat"], r["budget_index"] = rep, bi
        runs.append(r)
        s = r.get("summary", {})
        lr = r.get("last_record", {})
        print(f"  repeat {rep} {r['kind']:<13} budget {r['budget'] / MIB:6.1f} MiB rc {r['rc']} "
              f"step {r.get('step_s', float('nan')) * 1e3:.0f} ms "
              f"tracked {s.get('tracked_peak_bytes', 0) / MIB:.1f} MiB "
              f"cgroup {r.get('cgroup_max_usage', 0) / MIB:.0f} MiB "
              f"weights read {lr.get('weights_read_bytes', 0) / MIB:.0f} MiB/step "
              f"{r.get('error', '')}", flush=True)

    try:
        first = run(args, "core-keep", 0, environ, tmp, use_cgroup, "probe")
        if first["rc"] != 0:
            sys.exit(f"weights_sweep: in-core run failed: {first.get('error')}")
        keep_need = first["summary"]["tracked_peak_bytes"]
        budgets = [int(keep_need * f) for f in args.fractions]
        print(f"in-core keep-everything tracks {keep_need / MIB:.1f} MiB per worker; budgets "
              f"(MiB): {', '.join(f'{b / MIB:.1f}' for b in budgets)}", flush=True)
        for rep in range(args.repeats):
            record(run(args, "core-keep", 0, environ, tmp, use_cgroup, f"r{rep}-core"), rep, -1)
            record(run(args, "offload-keep", 0, environ, tmp, use_cgroup, f"r{rep}-off"), rep, -1)
            for bi, budget in enumerate(budgets):
                record(run(args, "offload", budget, environ, tmp, use_cgroup, f"r{rep}-b{bi}-off"),
                       rep, bi)
                if rep == 0:  # in core under a budget: a deterministic refusal, or a run
                    record(run(args, "core-auto", budget, environ, tmp, use_cgroup,
                               f"r{rep}-b{bi}-core"), rep, bi)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    results = {"keep_need": keep_need, "budgets": budgets, "runs": runs,
               "overhead_mib": args.overhead_mib, "cgroup": use_cgroup,
               "removed_env": removed, "args": vars(args)}
    table, _ = summarize(results)
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
