#!/usr/bin/env python3
"""Time to quality: validation loss against training time of finished runs, side by side (the
bf16 run of configs/brown-gpt.toml against its float32 twin, issue 20). Reads each run's
metrics.jsonl (eval records: time_s, step, loss on train.eval_batches batches) and, when
given, the full-validation result of `caravan eval --run-dir RUN` (its JSON line).

    # the runs (one core each; here both at once, one per core):
    build/caravan train --config configs/brown-gpt.toml --run-dir runs/ttq-bf16
    build/caravan train --config configs/brown-gpt.toml --set train.precision=float32 \\
        --run-dir runs/ttq-f32
    build/caravan eval --run-dir runs/ttq-bf16 > runs/ttq-bf16/eval.json   (and the same for f32)
    .venv/bin/python bench/time_to_quality.py --runs bf16=runs/ttq-bf16 float32=runs/ttq-f32 \\
        --out bench/results/speed/ttq

Writes OUT/results.json and OUT/charts.json (for `caravan report`).
"""
import argparse
import json
import os

import charts


def read_run(path):
    evals, summary, full = [], {}, None
    with open(os.path.join(path, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if j.get("kind") == "eval":
                evals.append({"time_s": j["time_s"], "step": j["step"], "loss": j["loss"]})
    s = os.path.join(path, "summary.json")
    if os.path.exists(s):
        with open(s) as f:
            summary = json.load(f)
    e = os.path.join(path, "eval.json")
    if os.path.exists(e):
        with open(e) as f:
            full = json.loads(f.read().strip().splitlines()[-1])
    return {"evals": evals, "summary": summary, "full_validation": full}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--runs", nargs="+", required=True, help="NAME=RUN_DIR ...")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    runs = {}
    for spec in a.runs:
        name, path = spec.split("=", 1)
        runs[name] = read_run(path)
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for name, r in runs.items():
        s, full = r["summary"], r["full_validation"]
        rows.append([name, s.get("steps"), f"{s.get('train_seconds', 0):.0f}",
                     f"{s.get('samples_per_s', 0):.1f}", f"{s.get('eval_loss', 0):.4f}",
                     f"{full['loss']:.4f}" if full else "-"])
        print(f"{name}: {s.get('steps')} steps in {s.get('train_seconds', 0):.0f} s "
              f"({s.get('samples_per_s', 0):.1f} samples/s); last eval {s.get('eval_loss', 0):.4f}"
              f"; full validation {full['loss']:.4f}" if full else "")
        for e in r["evals"]:
            print(f"  {e['time_s']:8.1f} s  step {e['step']:6d}  loss {e['loss']:.4f}")
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump({"runs": runs, "args": vars(a)}, f, indent=1)
    charts.write(a.out, "time-to-quality", "Validation loss against training time", [
        charts.line("curve", "Validation loss (train.eval_batches batches) against training time",
                    "training seconds", "nats / char",
                    [charts.series(n, [e["time_s"] for e in r["evals"]],
                                   [e["loss"] for e in r["evals"]]) for n, r in runs.items()])],
        note="Each run on one core (train.threads = 1); the last points are the end of "
             "train.max_minutes. Full validation: caravan eval on the final checkpoint.",
        command=charts.command("bench/time_to_quality.py", vars(a)),
        table=charts.table(["run", "steps", "seconds", "samples/s", "last eval", "full val"],
                           rows))


if __name__ == "__main__":
    main()
