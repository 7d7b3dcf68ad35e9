#!/usr/bin/env python3
"""PyTorch ZeRO-1 peer for bench/fsdp_step.py: times data-parallel training steps of the same
model, per-worker batch, optimizer, clipping and thread count as a Caravan config with
PyTorch 2.13's DistributedDataParallel over Gloo on the CPU and
torch.distributed.optim.ZeroRedundancyOptimizer wrapping the config's optimizer (AdamW for the
GPT configs): each rank keeps the optimizer state of its part of the parameters only (ZeRO
stage 1), steps that part and broadcasts it to the others; gradients and parameters stay whole
on every rank.

    .venv/bin/python bench/peer_zero.py --config configs/brown-gpt.toml --workers 2 \
        --steps 20 --warmup 3 --threads 1 [--bucket-view] [--gradient-as-bucket-view] \
        [--overlap-with-ddp] [--compile [{model,blocks}]] [--autocast] [--port P]

Model, data and optimizer come from bench/peer_train.py (the GPT twin of Caravan's, random token
ids of Brown's vocabulary, each rank its own batches); DDP is set up as bench/peer_ddp.py does
(peer_ddp.wrap: the config's sync.bucket_mb and sync.first_bucket_mb, Caravan's and DDP's
defaults 25 and 1 MiB; no per-forward buffer broadcast). A step: forward, backward (DDP
all-reduces the gradients in buckets, overlapped with backward), clipping by the global norm
(torch.nn.utils.clip_grad_norm_ over the whole, all-reduced gradients every rank holds: the
same norm on every rank), then ZeroRedundancyOptimizer.step() (this rank's shard, then one
broadcast per parameter from its owner, or per bucket with --bucket-view). ZeRO assigns whole
parameters to ranks (sorted-greedy by size), so the shards are only roughly even: the output
gives each rank's bytes of optimizer state.

Options beyond peer_fsdp.py's (--config, --workers, --steps, --warmup, --threads, --port):
  --bucket-view              ZeroRedundancyOptimizer(parameters_as_bucket_view=True): parameters
                             packed into one flat tensor per rank, broadcast as one.
  --gradient-as-bucket-view  DDP(gradient_as_bucket_view=True): gradients are views of DDP's
                             all-reduce buckets, not a second copy (PyTorch's memory advice).
  --overlap-with-ddp         ZeroRedundancyOptimizer(overlap_with_ddp=True) with DDP's comm hook
                             ddp_zero_hook.hook_with_zero_step(allreduce_hook): the optimizer
                             step runs inside backward, bucket by bucket. Cheap to ask for, but
                             torch 2.13 refuses it on Gloo (hook_with_zero_step raises
                             "RuntimeError: Gloo backend using Overlapping DDP with ZeRO may meet
                             hangs", pytorch/pytorch#62300), so on the CPU it reports that error
                             and nothing else. Were it to run, it could not clip (the step runs
                             before all gradients exist; "clip": false in the output), the loop
                             would not call step(), and the first two steps update nothing (DDP's
                             buckets are not final until the second forward).
  --compile [model]          torch.compile (inductor, CPU) of the DDP-wrapped model, PyTorch's
                             documented way to compile DDP (dynamo's DDPOptimizer splits the
                             graph at the bucket boundaries, so the all-reduces still overlap
                             backward); --compile blocks compiles each transformer block before
                             DDP wraps the model. The compilation runs in the warmup steps.
  --autocast                 forward and loss under torch.autocast("cpu", dtype=torch.bfloat16),
                             as bench/peer_train.py --autocast: weights, gradients (and their
                             all-reduce) and optimizer state stay float32.

Rank 0 prints one JSON object, the shape of bench/peer_fsdp.py's: step time (per step the
slowest rank's, median over steps), samples/s = workers x batch / that, a per-phase breakdown
(medians over ranks and steps: forward, backward with DDP's all-reduces, optimizer = clipping +
the shard's step + the parameter broadcast), every rank's peak RSS (getrusage ru_maxrss, bytes,
start-up included), bytes of optimizer state and compiled_graphs (as peer_fsdp.py's). Where
it cannot run, it prints {"runs": false, "error": "<the exception's first line>", "rank": R,
"phase": P, ...} and exits 0 (the traceback goes to stderr).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_ddp  # noqa: E402  (gather_steps, gather_rss, wrap)
import peer_fsdp  # noqa: E402  (common_args, stronger_args, spawn, compile_blocks, ...)
import peer_train  # noqa: E402

# Columns of a rank's per-step row (gathered to rank 0).
STEP, FORWARD, BACKWARD, OPTIMIZER = range(4)


def engine(a):
    return ("pytorch-zero1" + ("-bucket-view" if a.bucket_view else "")
            + ("-grad-view" if a.gradient_as_bucket_view else "")
            + ("-overlap" if a.overlap_with_ddp else "") + ("-autocast" if a.autocast else "")
            + (f"-compile-{a.compile}" if a.compile else ""))


def fields(a):
    return {"bucket_view": a.bucket_view, "gradient_as_bucket_view": a.gradient_as_bucket_view,
            "overlap_with_ddp": a.overlap_with_ddp, "compile": a.compile,
            "autocast": a.autocast}


def train(rank, a, phase):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    peer_train.set_threads(a.threads)
    phase[0] = "init_process_group"
    dist.init_process_group("gloo", rank=rank, world_size=a.workers,
                            timeout=datetime.timedelta(seconds=120))
    phase[0] = "setup"
    cfg = peer_train.read_config(a.config)
    sync = cfg.get("sync", {})
    bucket_mb = sync.get("bucket_mb", 25.0)  # Caravan's defaults (core/config.cpp), as peer_ddp
    first_bucket_mb = sync.get("first_bucket_mb", 1.0)
    torch.manual_seed(0)  # the same initial model on every rank
    model, xs, ys, batch, clip = peer_train.build(cfg)
    model.train()
    if a.compile == "blocks":
        phase[0] = "compile"
        peer_fsdp.compile_blocks(model)
    phase[0] = "ddp"
    ddp = peer_ddp.wrap(model, bucket_mb, first_bucket_mb,
                        gradient_as_bucket_view=a.gradient_as_bucket_view)
    forward = torch.compile(ddp) if a.compile == "model" else ddp
    phase[0] = "zero_redundancy_optimizer"
    cls, kwargs = peer_train.optimizer_spec(cfg)
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=cls,
                                  parameters_as_bucket_view=a.bucket_view,
                                  overlap_with_ddp=a.overlap_with_ddp, **kwargs)
    if a.overlap_with_ddp:
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        phase[0] = "register_comm_hook"
        ddp.register_comm_hook(None, hook_with_zero_step(allreduce_hook, ddp, opt))
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    rows = torch.zeros(a.steps, 4, dtype=torch.float64)
    loss_sum, t_start = 0.0, None
    for i in range(-a.warmup, a.steps):
        if i == 0:
            dist.barrier()
            t_start = time.perf_counter()
            graphs_warmup = peer_fsdp.compiled_graphs()
        t0 = time.perf_counter()
        x, y = peer_train.draw_batch(xs, ys, batch, gen)
        opt.zero_grad()
        phase[0] = "forward"  # with --compile, the warmup's first forward compiles
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast):
            loss = peer_train.task_loss(forward(x), y)
        t1 = time.perf_counter()
        phase[0] = "backward"
        loss.backward()  # with --overlap-with-ddp, the optimizer step runs in here
        t2 = time.perf_counter()
        phase[0] = "optimizer"
        if not a.overlap_with_ddp:
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()  # this rank's shard, then the parameters broadcast from their owners
        value = loss.item()
        t3 = time.perf_counter()
        if i >= 0:
            loss_sum += value
            rows[i] = torch.tensor([t3 - t0, t1 - t0, t2 - t1, t3 - t2], dtype=torch.float64)
    wall = time.perf_counter() - t_start
    graphs_timed = peer_fsdp.compiled_graphs() - graphs_warmup
    phase[0] = "report"
    allr, _, step_median = peer_ddp.gather_steps(rows, a.workers)  # [W, steps, 4]
    rss = peer_ddp.gather_rss(a.workers)
    state = [torch.zeros(1, dtype=torch.float64) for _ in range(a.workers)]
    dist.all_gather(state, torch.tensor([float(peer_train.state_bytes(opt))],
                                        dtype=torch.float64))
    if rank == 0:
        med = lambda c: statistics.median(allr[:, :, c].flatten().tolist())  # noqa: E731
        print(json.dumps({
            "bench": "train_dist", "engine": engine(a),
            "runs": True, "config": a.config, "workers": a.workers, "threads": a.threads,
            "batch_size": batch, "steps": a.steps, "warmup": a.warmup, **fields(a),
            "clip": clip if not a.overlap_with_ddp else False,
            "step_s_median": step_median,
            "step_s_median_rank0": statistics.median(allr[0, :, STEP].tolist()),
            "step_s_mean": wall / a.steps,
            "samples_per_s": a.workers * batch / step_median,
            "compiled_graphs": {"warmup": graphs_warmup, "timed": graphs_timed},  # rank 0's
            "phases": {"forward_s": med(FORWARD), "backward_and_sync_s": med(BACKWARD),
                       "optimizer_and_broadcast_s": med(OPTIMIZER)},
            "comm": {"backend": "gloo", "bucket_mb": bucket_mb,
                     "first_bucket_mb": first_bucket_mb},
            "peak_rss_bytes": rss,
            "optimizer_state_bytes": [s.item() for s in state],
            "mean_loss": loss_sum / a.steps,
            "torch": torch.__version__,
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    peer_fsdp.common_args(p)
    p.add_argument("--bucket-view", action="store_true",
                   help="ZeroRedundancyOptimizer(parameters_as_bucket_view=True)")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP(gradient_as_bucket_view=True)")
    p.add_argument("--overlap-with-ddp", action="store_true",
                   help="ZeroRedundancyOptimizer(overlap_with_ddp=True) + hook_with_zero_step "
                        "(torch 2.13 refuses it on Gloo; reported as the error)")
    peer_fsdp.stronger_args(p, ("model", "blocks"))
    a = p.parse_args()
    peer_fsdp.spawn(train, a, engine(a), fields(a), "peer-zero-")


if __name__ == "__main__":
    main()
