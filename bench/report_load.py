"""How long a large `caravan report` page takes to open in headless Chromium.

Trains N real runs of STEPS steps each (the Fashion-MNIST MLP, a train record every step, an
evaluation every 500; a third of them on 2 workers so the per-rank columns are there too),
writes one report of all of them, and opens it REPEATS times in Debian's Chromium through
report/browser_check.mjs, which also checks that every chart drew. Prints the median and
every time; writes OUT/results.json and OUT/charts.json (render: caravan report OUT).

    .venv/bin/python bench/report_load.py [--runs 10] [--steps 10000] [--repeats 5]
        [--runs-dir /tmp/caravan-report-load] [--out bench/results/report]

Runs already complete in --runs-dir are reused. The issue's bar: 10 runs of 10,000 steps
open in under 3 s.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import charts  # noqa: E402


def train(caravan, run_dir, i, steps):
    if os.path.exists(os.path.join(run_dir, "model.pt")):
        return "reused"
    workers = 2 if i % 3 == 0 else 1
    lrs = [0.01, 0.02, 0.05, 0.1, 0.05]  # ([4]: 0.2 diverged with momentum 0.9)
    cmd = [caravan, "train", "-c", os.path.join(ROOT, "configs", "fmnist-mlp.toml"),
           "--run-dir", run_dir, "--quiet",
           "--set", f"train.max_steps={steps}", "--set", "train.log_every=1",
           "--set", "train.eval_every=500", "--set", "train.eval_batches=10",
           "--set", "train.threads=1", "--set", f"optim.lr={lrs[i % len(lrs)]}",
           "--set", f"optim.momentum={0.9 if i % 2 == 0 else 0.5}",
           "--set", "checkpoint.every=0"]
    if workers > 1:
        cmd[2:2] = ["--workers", str(workers)]
    subprocess.run(cmd, check=True)
    return f"trained ({workers} worker{'s' if workers > 1 else ''})"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10)
    p.add_argument("--steps", type=int, default=10000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--runs-dir", default="/tmp/caravan-report-load")
    p.add_argument("--caravan", default=os.path.join(ROOT, "build", "caravan"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "report"))
    a = p.parse_args()
    os.makedirs(a.runs_dir, exist_ok=True)
    os.makedirs(a.out, exist_ok=True)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
    runs = []
    for i in range(a.runs):
        d = os.path.join(a.runs_dir, f"run-{i:02d}")
        t = time.time()
        how = train(a.caravan, d, i, a.steps)
        print(f"{d}: {how} in {time.time() - t:.0f} s", flush=True)
        runs.append(d)
    page = os.path.join(a.runs_dir, "report.html")
    t = time.time()
    subprocess.run([a.caravan, "report", *runs, "-o", page], check=True, env=env)
    build_s = time.time() - t
    size = os.path.getsize(page)
    check = os.path.join(ROOT, "report", "browser_check.mjs")
    opens = []
    for k in range(a.repeats):
        out = subprocess.run(["node", check, page, "--runs", str(a.runs)],
                             capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        if not r.get("ok"):
            sys.exit(f"report_load: the page did not draw: {r.get('problems')}")
        opens.append(r)
        print(f"open {k + 1}: {r['loadMs']} ms (page clock {r['readyMs']} ms, charts "
              f"{r['renderMs']} ms, {r['charts']} charts)", flush=True)
    load = [r["loadMs"] for r in opens]
    med = statistics.median(load)
    print(f"{a.runs} runs x {a.steps} steps: page {size / 1e6:.1f} MB written in {build_s:.1f} s; "
          f"opens in {med:.0f} ms (median of {a.repeats}; min {min(load)}, max {max(load)})")
    results = {"runs": a.runs, "steps": a.steps, "page_bytes": size, "report_s": build_s,
               "opens": opens, "median_load_ms": med,
               "command": ".venv/bin/python bench/report_load.py " + " ".join(sys.argv[1:])}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    write_charts(a.out, results)


def write_charts(out, results):
    opens = results["opens"]
    charts.write(
        out, "report", f"Opening a report of {results['runs']} runs x {results['steps']} steps",
        [charts.bar("open-time", "Time to open the page, each attempt",
                    [str(i + 1) for i in range(len(opens))],
                    [charts.series("navigation to every chart drawn", y=[r["loadMs"] for r in opens]),
                     charts.series("drawing the charts (report.js)", y=[r["renderMs"] for r in opens])],
                    "milliseconds")],
        note=(f"A page of {results['page_bytes'] / 1e6:.1f} MB; median {results['median_load_ms']:.0f} ms "
              "in headless Chromium on the 2-core development machine (bar: 3000 ms)."),
        command=results["command"],
        table=charts.table(["attempt", "load ms", "page clock ms", "charts ms", "charts"],
                           [[i + 1, r["loadMs"], r["readyMs"], r["renderMs"], r["charts"]]
                            for i, r in enumerate(opens)]))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--replot":
        with open(os.path.join(sys.argv[2], "results.json")) as f:
            write_charts(sys.argv[2], json.load(f))
    else:
        main()
