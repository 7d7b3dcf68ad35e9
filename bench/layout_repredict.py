#!/usr/bin/env python3
"""The layout search's predictions, made again with this build, against the runs measured before.

    env -u OPENBLAS_CORETYPE .venv/bin/python bench/layout_repredict.py OUT [CASE ...]

For each case of bench/layout_search.py whose runs are in bench/results/layout-50 (fmnist-cnn,
brown-gpt) or bench/results/layout-50-gpt512 and -gpt512-100mbit (gpt-512x16): profiles the case again on this host
(`caravan simulate -o OUT/CASE/profile`, kept: a second call reuses it), writes layout_search.py's
cluster file for each rate measured, runs `caravan plan --cluster` (layout_search.predictions)
and prints, per case and rate, Kendall tau-b between the
new predictions and the measured medians (and the old predictions'), the layout the search now
chooses with its measured samples/s over the best's, and every layout's old and new prediction.
Nothing is run on the namespace hosts: a layout whose keys changed (its partition or policies)
is marked, since its measured runs used the old keys. For a model change, before new runs.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layout_search import ROOT, kendall_tau, predictions  # noqa: E402

RESULTS = {"fmnist-cnn": ["layout-50"], "brown-gpt": ["layout-50"],
           "gpt-512x16": ["layout-50-gpt512", "layout-50-gpt512-100mbit"]}


def main():
    out = sys.argv[1]
    for case, results in [(c, r) for c in sys.argv[2:] or list(RESULTS) for r in RESULTS[c]]:
        path = os.path.join(ROOT, "bench", "results", results, "results.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            res = json.load(f)
        # layout_search.py's own profile (once per case), cluster file and search, under OUT.
        a = argparse.Namespace(out=out, cpus=res["cpus"], memory_gib=5.0)
        for key, r in res["cases"].items():
            if r["case"] != case:
                continue
            new = predictions(a, case, r["rate"])
            before = {x["name"]: x for x in r["layouts"]}
            rows = []
            for lay in new["layouts"]:
                old = before.get(lay["name"])
                if not old or not old["measured"]:
                    continue
                rows.append((lay["name"], old["predicted_samples_per_s"],
                             lay["predicted_samples_per_s"], statistics.median(old["measured"]),
                             old["keys"] != lay["keys"]))
            best = max(rows, key=lambda x: x[3])
            chosen = next(x for x in rows if x[0] == new["chosen"]["name"])
            tau_old = kendall_tau([x[1] for x in rows], [x[3] for x in rows])
            tau_new = kendall_tau([x[2] for x in rows], [x[3] for x in rows])
            print(f"== {key}: tau {tau_old:.2f} -> {tau_new:.2f}; chosen {chosen[0]}: "
                  f"{chosen[3] / best[3]:.3f} of the best measured ({best[0]})")
            for x in sorted(rows, key=lambda x: -x[3]):
                print(f"   {x[0]:34s} predicted {x[1]:8.1f} -> {x[2]:8.1f}  measured {x[3]:8.1f}"
                      + ("  (keys changed: measured with the old ones)" if x[4] else ""))


if __name__ == "__main__":
    main()
