#!/usr/bin/env python3
"""How a pipeline's stages compute on namespace hosts that share this machine's cores (issue 50).

    env -u OPENBLAS_CORETYPE .venv/bin/python bench/pipeline_contention.py [CASE RATE LAYOUTS REPEATS]
    (default: brown-gpt 1gbit "allreduce+pipeline(4x4),allreduce+pipeline(4x16),allreduce" 1)

Runs layouts of bench/layout_search.py's search (their keys from its layout-RATE.json under
bench/results/layout-50) on 4 namespace hosts, each held to 0.5 cores by a cgroup, for 40 steps,
and prints per run: samples/s, rank 0's compute and wait per step (bench/network_sweep.py's
count), and each host's cgroup cpu.stat at the run's end (periods, throttled periods, throttled
time): whether the quota or the cores' sharing slows each stage. Compare the compute with the
profile's (`caravan simulate -o`'s workload.json, one full core). Run directories under
/tmp/pipeline-contention. Needs root (exit 77 otherwise).
"""
import glob
import json
import os
import shutil
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from layout_search import CASES, COMMON, HOSTS, ROOT, slug  # noqa: E402
from network_sweep import throughput_numbers, train_on_hosts  # noqa: E402


def cgroup_stats(stats, stop):
    """Every half second until `stop`: each namespace host's cpu.stat (cgroup v2 or v1)."""
    while not stop.is_set():
        for f in glob.glob("/sys/fs/cgroup/cv*h*/cpu.stat") + \
                glob.glob("/sys/fs/cgroup/cpu/cv*h*/cpu.stat"):
            try:
                with open(f) as fh:
                    stats[os.path.basename(os.path.dirname(f))] = dict(
                        line.split() for line in fh)
            except (OSError, ValueError):
                pass
        time.sleep(0.5)


def main():
    case = sys.argv[1] if len(sys.argv) > 1 else "brown-gpt"
    rate = sys.argv[2] if len(sys.argv) > 2 else "1gbit"
    names = (sys.argv[3] if len(sys.argv) > 3 else
             "allreduce+pipeline(4x4),allreduce+pipeline(4x16),allreduce").split(",")
    repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    with open(os.path.join(ROOT, "bench", "results", "layout-50", case,
                           f"layout-{rate}.json")) as f:
        layouts = {x["name"]: x for x in json.load(f)["layouts"]}
    config, extra = CASES[case]
    for r in range(repeats):
        for name in names:
            lay = layouts[name]
            sets = COMMON + extra + lay["keys"] + ["train.max_steps=40", "train.log_every=5"]
            run_dir = f"/tmp/pipeline-contention/{case}-{rate}-{slug(name)}-r{r}"
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(os.path.dirname(run_dir), exist_ok=True)
            stats, stop = {}, threading.Event()
            sampler = threading.Thread(target=cgroup_stats, args=(stats, stop), daemon=True)
            sampler.start()
            records = train_on_hosts(HOSTS, rate, 1800, config, sets, run_dir, name, 0.5)
            stop.set()
            sampler.join()
            n = throughput_numbers(records)
            print(f"{name}: {n['samples_per_s']:.1f} samples/s, rank 0 compute "
                  f"{n['compute_s']:.3f} s and wait {n['wait_s']:.3f} s per step (predicted "
                  f"{lay['predicted_samples_per_s']:.1f} samples/s by the search then)")
            for host, d in sorted(stats.items()):
                throttled = int(d.get("throttled_usec", 0)) / 1e6 or \
                    int(d.get("throttled_time", 0)) / 1e9
                print(f"  {host}: {d['nr_throttled']} of {d['nr_periods']} periods throttled, "
                      f"{throttled:.2f} s")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
