#!/usr/bin/env python3
"""PyTorch pipeline-parallel peer for bench/pipeline_peer.py: times training steps of Caravan's
built-in GPT cut into K contiguous stages, one per process, with PyTorch's own pipelining
(torch.distributed.pipelining: PipelineStage and ScheduleGPipe / Schedule1F1B) over Gloo, in
Python PyTorch (the project's .venv, torch 2.13).

    .venv/bin/python bench/peer_pipeline.py [--config configs/brown-gpt.toml] [--stages 2]
        [--microbatches 4] [--schedule gpipe|1f1b] [--partition even|3,...] [--steps 20]
        [--warmup 3] [--threads 1] [--port P]

Model: tests/python/reference_models.py's GPT (the twin of Caravan's, same blocks: embed,
layer0..depth-1, head) with the config's width, depth, heads and seq_len, vocabulary 86 (Brown's,
as bench/peer_train.py). Every rank builds the whole model from seed 0 and keeps its stage's
blocks, an nn.Sequential handed to PipelineStage directly (no tracing: pipeline()'s split is not
needed for a model that is already a sequence of blocks). The cut is Caravan's
parallel.partition: `even` (Caravan's rule, src/pipeline/partition.cpp: blocks / K per stage,
the first blocks % K stages one more) or the blocks at which stages 1..K-1 start ("3,6,9").

A step: the batch (data.batch_size, random token ids drawn on every rank from the same
generator, so stage 0's inputs and the last stage's targets belong together) split into M
micro-batches by the schedule; cross-entropy per micro-batch, gradients scaled by 1/M (the
schedule's scale_grads, as Caravan counts each micro-batch's loss 1/M); clipping by the global
norm over all stages (one all-reduce of the squared norms, as Caravan's optim.grad_clip in a
pipeline); the config's optimizer (AdamW for brown-gpt) on each stage's own parameters.
Workers: torch.multiprocessing.spawn on 127.0.0.1 (GLOO_SOCKET_IFNAME=lo), each on
--threads threads (peer_train.set_threads: torch's pool and OpenBLAS's).

Rank 0 prints one JSON object: per step the slowest stage's time, its median over the timed
steps (and the mean), samples/s = batch / median, per-stage medians.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_ddp  # noqa: E402  (free_port, gather_steps)
import peer_train  # noqa: E402


def even_cut(blocks, stages):
    """Caravan's even partition (evenPartition in src/pipeline/partition.cpp): boundaries."""
    if not 1 <= stages <= blocks:
        raise ValueError(f"{stages} stages but the model has {blocks} blocks")
    per, extra = divmod(blocks, stages)
    b = [0]
    for s in range(stages):
        b.append(b[-1] + per + (s < extra))
    return b


def boundaries(partition, blocks, stages):
    if partition == "even":
        return even_cut(blocks, stages)
    b = [0] + [int(v) for v in partition.split(",")] + [blocks]
    if len(b) != stages + 1 or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"--partition {partition}: give {stages - 1} increasing block indices "
                         f"between 1 and {blocks - 1}")
    return b


def clip_global(params, clip, group=None):
    """Scale the gradients so that their norm over every stage is at most clip (as
    torch.nn.utils.clip_grad_norm_ on the whole model); returns the norm."""
    grads = [p.grad for p in params if p.grad is not None]
    sq = torch.zeros(1, dtype=torch.float64)
    if grads:
        sq += torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()
    dist.all_reduce(sq, group=group)
    norm = sq.sqrt().item()
    coef = clip / (norm + 1e-6)
    if coef < 1.0 and grads:
        torch._foreach_mul_(grads, coef)
    return norm


def worker(rank, a, port):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    peer_train.set_threads(a.threads)
    dist.init_process_group("gloo", rank=rank, world_size=a.stages)
    cfg = peer_train.read_config(a.config)
    data, model_cfg = cfg.get("data", {}), cfg.get("model", {})
    batch, seq = data.get("batch_size", 64), data.get("seq_len", 128)
    if batch % a.microbatches:
        raise ValueError(f"batch {batch} is not a multiple of {a.microbatches} micro-batches")
    torch.manual_seed(0)  # every rank the same whole model, then its own blocks
    model = peer_train.reference_models.build(
        "gpt", model_cfg.get("width", 0), model_cfg.get("depth", 0), model_cfg.get("heads", 0),
        model_cfg.get("dropout", 0.0), vocab=peer_train.BROWN_VOCAB, seq=seq)
    blocks = list(model.named_children())
    cut = boundaries(a.partition, len(blocks), a.stages)
    mine = blocks[cut[rank]:cut[rank + 1]]
    submod = torch.nn.Sequential()
    for name, block in mine:
        submod.add_module(name, block)
    del model, blocks
    submod.train()
    stage = PipelineStage(submod, rank, a.stages, torch.device("cpu"))
    schedule_class = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[a.schedule]
    schedule = schedule_class(stage, a.microbatches, loss_fn=peer_train.task_loss)
    params = list(submod.parameters())
    opt = peer_train.make_optimizer(cfg, params)
    clip = cfg.get("optim", {}).get("grad_clip", 0.0)
    tokens = torch.randint(0, peer_train.BROWN_VOCAB, (4096, seq + 1))
    xs, ys = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    gen = torch.Generator().manual_seed(1000)  # the same batches on every stage
    first, last = rank == 0, rank == a.stages - 1

    rows = torch.zeros(a.steps, 2, dtype=torch.float64)  # step seconds, loss (last stage)
    t_start = None
    for i in range(-a.warmup, a.steps):
        if i == 0:
            dist.barrier()
            t_start = time.perf_counter()
        t0 = time.perf_counter()
        x, y = peer_train.draw_batch(xs, ys, batch, gen)
        opt.zero_grad()
        losses = [] if last else None
        kwargs = {"target": y, "losses": losses, "return_outputs": False} if last else {}
        if first:
            schedule.step(x, **kwargs)
        else:
            schedule.step(**kwargs)
        if clip > 0:
            clip_global(params, clip)
        opt.step()
        loss = torch.stack(losses).mean().item() if last else 0.0
        t1 = time.perf_counter()
        if i >= 0:
            rows[i, 0], rows[i, 1] = t1 - t0, loss
    wall = time.perf_counter() - t_start

    allr, _, step_median = peer_ddp.gather_steps(rows, a.stages)  # [K, steps, 2]
    if rank == 0:
        print(json.dumps({
            "bench": "pipeline", "engine": "pytorch-pipelining", "config": a.config,
            "stages": a.stages, "microbatches": a.microbatches, "schedule": a.schedule,
            "partition": cut, "threads": a.threads, "batch_size": batch,
            "steps": a.steps, "warmup": a.warmup,
            "step_s_median": step_median,
            "step_s_mean": wall / a.steps,
            "step_s_median_per_stage": [statistics.median(allr[s, :, 0].tolist())
                                        for s in range(a.stages)],
            "samples_per_s": batch / step_median,
            "samples_per_s_mean": batch * a.steps / wall,
            "mean_loss": allr[-1, :, 1].mean().item(),
            "torch": torch.__version__,
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="configs/brown-gpt.toml")
    p.add_argument("--stages", type=int, default=2, help="K: stage processes on this machine")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", choices=["gpipe", "1f1b"], default="1f1b")
    p.add_argument("--partition", default="even",
                   help="even (Caravan's rule) or the blocks where stages 1..K-1 start: 3,6,9")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")
    a = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(a, a.port or peer_ddp.free_port()), nprocs=a.stages, join=True)


if __name__ == "__main__":
    main()
