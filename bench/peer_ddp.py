#!/usr/bin/env python3
"""PyTorch DDP peer for bench/ddp_step.py: times data-parallel training steps of the same model,
per-worker batch, optimizer, clipping, thread count and gradient bucket caps as a Caravan config,
in Python PyTorch (the project's .venv, torch 2.13) with DistributedDataParallel over Gloo.

    .venv/bin/python bench/peer_ddp.py --config configs/fmnist-cnn.toml --workers 2 \
        --steps 40 --warmup 5 --threads 1 [--port P] [--bucket-mb M] [--first-bucket-mb M]

Workers are started with torch.multiprocessing.spawn (Debian's torchrun, torch 1.13, did not
run on Python 3.11) and rendezvous on 127.0.0.1. Model, data and optimizer come from
bench/peer_train.py (the single-worker peer). DDP settings: bucket_cap_mb = sync.bucket_mb and
the first bucket cap (dist._DEFAULT_FIRST_BUCKET_BYTES) = sync.first_bucket_mb: Caravan's
defaults, 25 and 1 MiB, which are also DDP's own. (The caps are the same; DDP closes a bucket
after the tensor that reaches the cap, Caravan before the tensor that would exceed it, so the
layouts can differ: bench/README.md.) broadcast_buffers=False, and non-floating buffers (the
GPT's bool mask) left out of DDP's initial broadcast: Caravan broadcasts floating buffers once
at the start, not every forward, and neither model here has a buffer that changes.

Rank 0 prints one JSON object: the step time (per step the slowest rank's, median over steps,
as caravan_bench does), a per-phase breakdown (DDP's backward includes waiting for its bucket
all-reduces), CPU seconds and minor page faults per step, and every rank's peak RSS (getrusage
ru_maxrss, bytes, start-up included; bench/fsdp_step.py --peers ddp reads it).
"""
import argparse
import json
import os
import resource
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_train  # noqa: E402

# Columns of a rank's per-step row (gathered to rank 0).
STEP, LOADER, FORWARD, BACKWARD, OPTIMIZER = range(5)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gather_steps(rows, world):
    """Every rank's per-step rows ([steps, C], column 0 the step's seconds) gathered on every
    rank: returns them stacked ([world, steps, C]), per step the slowest rank's seconds, and
    their median, the step time each distributed peer reports (as Caravan's drivers do)."""
    gathered = [torch.zeros_like(rows) for _ in range(world)]
    dist.all_gather(gathered, rows)
    allr = torch.stack(gathered)
    step_max = allr[:, :, STEP].max(dim=0).values.tolist()
    return allr, step_max, statistics.median(step_max)


def gather_rss(world):
    """Every rank's peak resident set (getrusage ru_maxrss, bytes; start-up included), gathered
    on every rank: the memory each distributed peer reports per rank."""
    mine = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0],
                        dtype=torch.float64)
    gathered = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    return [r.item() for r in gathered]


def wrap(model, bucket_mb, first_bucket_mb, **kwargs):
    """model in DDP as this peer runs it (bench/peer_zero.py too): the bucket caps (MiB), no
    per-forward buffer broadcast, non-floating buffers left out; kwargs go to DDP."""
    dist._DEFAULT_FIRST_BUCKET_BYTES = int(first_bucket_mb * 1024 * 1024)
    # Like Caravan, leave non-floating buffers (the GPT's bool attention mask) out of the
    # initial broadcast; Gloo cannot broadcast bool ("Invalid scalar type").
    DDP._set_params_and_buffers_to_ignore_for_model(
        model, [n for n, b in model.named_buffers() if not b.is_floating_point()])
    return DDP(model, bucket_cap_mb=bucket_mb, broadcast_buffers=False, **kwargs)


def worker(rank, a, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    peer_train.set_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.workers)
    cfg = peer_train.read_config(a.config)
    sync = cfg.get("sync", {})
    bucket_mb = a.bucket_mb or sync.get("bucket_mb", 25.0)  # Caravan's defaults (core/config.cpp)
    first_bucket_mb = a.first_bucket_mb or sync.get("first_bucket_mb", 1.0)
    torch.manual_seed(0)  # the same initial model on every rank (DDP broadcasts rank 0's anyway)
    model, xs, ys, batch, clip = peer_train.build(cfg)
    model.train()
    layout = None
    if a.channels_last and xs.dim() == 4:  # as peer_train.py --channels-last
        model = model.to(memory_format=torch.channels_last)
        layout = peer_train.channels_last
    ddp = wrap(model, bucket_mb, first_bucket_mb)
    opt = peer_train.make_optimizer(cfg, model.parameters())
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    rows = torch.zeros(a.steps, 5, dtype=torch.float64)
    loss_sum = 0.0
    t_start = None
    for i in range(-a.warmup, a.steps):
        if i == 0:
            dist.barrier()
            t_start = time.perf_counter()
            cpu_start = time.process_time()
            thread_cpu_start = time.thread_time()
            faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        x, y = peer_train.draw_batch(xs, ys, batch, gen)
        if layout is not None:
            x = layout(x)
        t1 = time.perf_counter()
        opt.zero_grad()
        loss = peer_train.task_loss(ddp(x), y)
        t2 = time.perf_counter()
        loss.backward()  # returns once DDP's buckets are all-reduced and written to .grad
        t3 = time.perf_counter()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        value = loss.item()
        t4 = time.perf_counter()
        if i < 0:
            continue
        loss_sum += value
        rows[i] = torch.tensor([t4 - t0, t1 - t0, t2 - t1, t3 - t2, t4 - t3], dtype=torch.float64)
    wall = time.perf_counter() - t_start
    # CPU seconds per step summed over ranks: all threads of every worker, and the main
    # threads alone (they run forward, backward with DDP's hooks, and the optimizer); minor page
    # faults likewise.
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start
    cpu = torch.tensor([(time.process_time() - cpu_start) / a.steps,
                        (time.thread_time() - thread_cpu_start) / a.steps, faults / a.steps],
                       dtype=torch.float64)
    dist.all_reduce(cpu)

    allr, step_max, step_median = gather_steps(rows, a.workers)  # [W, steps, 5]
    rss = gather_rss(a.workers)
    if rank == 0:
        med = lambda c: statistics.median(allr[:, :, c].flatten().tolist())  # noqa: E731
        print(json.dumps({
            "bench": "train_dist", "engine": "pytorch-ddp", "config": a.config,
            "workers": a.workers, "threads": a.threads, "batch_size": batch, "steps": a.steps,
            "channels_last": layout is not None,
            "warmup": a.warmup,
            "step_s_median": step_median,
            "step_s_median_rank0": statistics.median(allr[0, :, STEP].tolist()),
            "step_s_mean": wall / a.steps,
            "cpu_s_per_step": cpu[0].item(),
            "trainer_thread_cpu_s_per_step": cpu[1].item(),
            "minor_faults_per_step": cpu[2].item(),
            "samples_per_s": a.workers * batch / step_median,
            "phases": {"loader_s": med(LOADER), "forward_s": med(FORWARD),
                       "backward_and_sync_s": med(BACKWARD), "optimizer_s": med(OPTIMIZER)},
            "comm": {"backend": "gloo", "bucket_mb": bucket_mb, "first_bucket_mb": first_bucket_mb},
            "step_s_max_over_ranks": step_max,
            "peak_rss_bytes": rss,
            "mean_loss": loss_sum / a.steps,
            "torch": torch.__version__,
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--channels-last", action="store_true",
                   help="convolutions in channels-last layout, as Caravan's (peer_train.py)")
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    p.add_argument("--bucket-mb", type=float, help="override the config's sync.bucket_mb")
    p.add_argument("--first-bucket-mb", type=float,
                   help="override the config's sync.first_bucket_mb")
    a = p.parse_args()
    port = a.port or free_port()
    mp.spawn(worker, args=(a, port), nprocs=a.workers, join=True)


if __name__ == "__main__":
    main()
