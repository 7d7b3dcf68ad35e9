#!/usr/bin/env python3
"""Pipeline parallelism against PyTorch's own: Caravan (`caravan train --workers K` with
parallel.pipeline_stages = K) and PyTorch 2.13's torch.distributed.pipelining
(bench/peer_pipeline.py: PipelineStage, ScheduleGPipe / Schedule1F1B over Gloo) training the
same GPT cut at the same blocks, with the same batch, micro-batches, schedule, optimizer,
clipping and threads per stage, measured in the same invocation with the runs interleaved
(A A' B A A' B ...). Reports each arm's median samples/s over the repeats and the ratio
Caravan / PyTorch in samples/s (>= 1.0: Caravan at least as fast).

    .venv/bin/python bench/pipeline_peer.py [--config configs/brown-gpt.toml] [--stages 2]
        [--micro 4] [--schedules 1f1b gpipe] [--partition even] [--repeats 3] [--steps 20]
        [--warmup 3] [--threads 1] [--caravan-backend gloo auto] [--json OUT]

Caravan's arms, one per --caravan-backend: `gloo` moves activations and gradients over TCP
loopback as the peer does (Gloo is the only CPU backend torch.distributed.pipelining has);
`auto` is Caravan's default, which on one host is its shared-memory transport (dist.backend,
docs/config.md). Caravan runs the config with train.precision = float32 (the peer trains in
float32; brown-gpt ships bf16), no evaluation or checkpoint inside the run, train.log_every = 1:
its step time is batch / samples_per_s of each metrics.jsonl train record after the warm-up
(rank 0's window, which ends after the stages' norm and loss reduction), and per step it
also gathers every stage's compute and wait for the record (a cost the peer does not pay).
The peer's step time is per step the slowest stage's. Each arm: median over steps, then median
over repeats; samples/s = batch / that. Caravan's bubble (mean over stages of wait / (compute +
wait), bench/pipeline_bubble.py) is printed alongside. The cut: --partition for both (Caravan's
parallel.partition; `even` is its equal-block-count rule, which the peer reproduces).

Every process runs on this machine; OMP_NUM_THREADS and OPENBLAS_NUM_THREADS are --threads for
both engines, OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE removed (the output says whether they were
set). On a machine with fewer cores than K x threads the stages share cores (the output prints
the core count).
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile

from ddp_step import environment, free_port, last_json, loadavg

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
CARAVAN = os.path.join(ROOT, "build", "caravan")
PEER = os.path.join(ROOT, "bench", "peer_pipeline.py")
RUN_TIMEOUT = 600


def run_group(cmd, environ):
    """Run cmd in its own process group (its workers go with it on a timeout or interrupt);
    (returncode, stdout, stderr)."""
    p = subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        out, err = "", "timed out"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    return p.returncode, out, err


def run_caravan(a, k, m, schedule, backend, environ, work):
    run_dir = tempfile.mkdtemp(dir=work)
    sets = ["train.precision=float32", f"parallel.pipeline_stages={k}",
            f"parallel.micro_batches={m}", f"parallel.schedule={schedule}",
            f"parallel.partition={a.partition}", f"dist.backend={backend}",
            f"train.threads={a.threads}", f"train.max_steps={a.warmup + a.steps}",
            "train.log_every=1", "train.eval_every=0", "train.eval_batches=1",
            "checkpoint.every=0", "fault.timeout=120"]
    cmd = [CARAVAN, "train", "-q", "--workers", str(k), "--config", a.config,
           "--run-dir", run_dir, "--set"] + sets
    rc, _, err = run_group(cmd, environ)
    if rc != 0:
        sys.exit(f"pipeline_peer: {' '.join(cmd)} failed ({rc}):\n{err.strip()}")
    records = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("kind") == "train" and r["step"] > a.warmup:
                records.append(r)
    shutil.rmtree(run_dir)
    if not records:
        sys.exit(f"pipeline_peer: caravan wrote no train record after step {a.warmup}")
    batch = a.batch_size
    steps = [batch / r["samples_per_s"] for r in records]  # one pipeline: D = 1
    compute = [statistics.mean(r["rank_compute_s"][s] for r in records) for s in range(k)]
    wait = [statistics.mean(r["rank_sync_wait_s"][s] for r in records) for s in range(k)]
    median = statistics.median(steps)
    return {"engine": f"caravan-{backend}", "step_s_median": median,
            "step_s_mean": statistics.mean(steps), "samples_per_s": batch / median,
            "bubble": statistics.mean(w / (c + w) for c, w in zip(compute, wait)),
            "compute_s": compute, "wait_s": wait, "records": len(records)}


def run_pytorch(a, k, m, schedule, environ):
    cmd = [sys.executable, PEER, "--config", a.config, "--stages", str(k), "--microbatches",
           str(m), "--schedule", schedule, "--partition", a.partition, "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--threads", str(a.threads), "--port", str(free_port())]
    rc, out, err = run_group(cmd, environ)
    if rc != 0:
        sys.exit(f"pipeline_peer: {' '.join(cmd)} failed ({rc}):\n{err.strip()}")
    return last_json(out, "peer_pipeline.py")


def batch_size(config):
    import tomllib
    with open(os.path.join(ROOT, config), "rb") as f:
        return tomllib.load(f).get("data", {}).get("batch_size", 64)


def main():
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/brown-gpt.toml")
    ap.add_argument("--stages", type=int, nargs="+", default=[2])
    ap.add_argument("--micro", type=int, nargs="+", default=[4])
    ap.add_argument("--schedules", nargs="+", choices=["gpipe", "1f1b"], default=["1f1b", "gpipe"])
    ap.add_argument("--partition", default="even",
                    help="parallel.partition for both: even, or the blocks where stages start")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="compute threads per stage")
    ap.add_argument("--caravan-backend", nargs="+", default=["gloo", "auto"],
                    help="one Caravan arm per dist.backend (gloo: the peer's transport; auto: "
                         "Caravan's default, shared memory on one host)")
    ap.add_argument("--json", help="write every measurement here")
    a = ap.parse_args()
    if not os.path.exists(CARAVAN):
        sys.exit(f"pipeline_peer: {CARAVAN} missing; run bash scripts/setup.sh first")
    a.batch_size = batch_size(a.config)
    environ, removed = environment(a.threads)
    cores = os.cpu_count()
    print(f"pipeline_peer: {cores} cores; load average before: {loadavg()}; removed from the "
          f"environment: {', '.join(removed) or 'nothing (not set)'}", flush=True)
    work = tempfile.mkdtemp(prefix="pipeline-peer-")
    rows, torch_version = [], None
    try:
        for k in a.stages:
            for m in a.micro:
                for schedule in a.schedules:
                    runs = {f"caravan-{b}": [] for b in a.caravan_backend}
                    runs["pytorch"] = []
                    for rep in range(a.repeats):  # interleaved: caravan arms, pytorch, ...
                        line = []
                        for b in a.caravan_backend:
                            r = run_caravan(a, k, m, schedule, b, environ, work)
                            runs[r["engine"]].append(r)
                            line.append(f"{r['engine']} {r['samples_per_s']:.1f} "
                                        f"(bubble {r['bubble']:.3f})")
                        q = run_pytorch(a, k, m, schedule, environ)
                        torch_version = q["torch"]
                        runs["pytorch"].append(q)
                        line.append(f"pytorch {q['samples_per_s']:.1f}")
                        print(f"  K={k} M={m} {schedule} #{rep + 1}: " + ", ".join(line)
                              + f" samples/s; load {loadavg()}", flush=True)
                    med = {e: statistics.median(r["step_s_median"] for r in rs)
                           for e, rs in runs.items()}
                    sps = {e: a.batch_size / s for e, s in med.items()}
                    rows.append({
                        "stages": k, "micro_batches": m, "schedule": schedule,
                        "samples_per_s": sps, "step_s_median": med,
                        "ratio": {e: sps[e] / sps["pytorch"] for e in sps if e != "pytorch"},
                        "caravan_bubble": {e: statistics.median(r["bubble"] for r in rs)
                                           for e, rs in runs.items() if e != "pytorch"},
                        "runs": runs})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    arms = [f"caravan-{b}" for b in a.caravan_backend]
    print(f"\npipeline training, {a.config}, batch {a.batch_size}, partition {a.partition}, "
          f"{a.threads} thread(s) per stage, {cores} cores, torch {torch_version}; median of "
          f"{a.repeats} interleaved runs of {a.steps} steps after {a.warmup}")
    head = "| K | M | schedule | " + " | ".join(f"{e} samples/s" for e in arms) + \
        " | pytorch samples/s | " + " | ".join(f"ratio {e}/pytorch" for e in arms) + \
        " | " + " | ".join(f"bubble {e}" for e in arms) + " |"
    print(head)
    print("|" + "---|" * head.count(" | ") + "---|")
    for r in rows:
        print(f"| {r['stages']} | {r['micro_batches']} | {r['schedule']} | "
              + " | ".join(f"{r['samples_per_s'][e]:.1f}" for e in arms)
              + f" | {r['samples_per_s']['pytorch']:.1f} | "
              + " | ".join(f"{r['ratio'][e]:.3f}" for e in arms) + " | "
              + " | ".join(f"{r['caravan_bubble'][e]:.3f}" for e in arms) + " |")
    print("ratio = Caravan / PyTorch samples/s (>= 1.0: Caravan at least as fast); bubble = "
          "Caravan's mean over stages of wait / (compute + wait)")
    print(f"load average after: {loadavg()}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"bench": "pipeline_peer", "args": vars(a), "cores": cores,
                       "removed_env": removed, "torch": torch_version, "rows": rows}, f,
                      indent=1)
        print("wrote", a.json)


if __name__ == "__main__":
    main()
