#!/usr/bin/env python3
"""PyTorch FSDP2 peer for bench/fsdp_step.py: times data-parallel training steps of the same
model, per-worker batch, optimizer, clipping and thread count as a Caravan config with
PyTorch 2.13's fully sharded data parallelism (torch.distributed.fsdp.fully_shard, "FSDP2")
over Gloo on the CPU, optionally with its CPUOffloadPolicy, and reports each rank's peak
resident set.

    .venv/bin/python bench/peer_fsdp.py --config configs/brown-gpt.toml --workers 2 \
        --steps 20 --warmup 3 --threads 1 [--offload] [--reshard-after-forward {true,false}] \
        [--compile [{blocks,model}]] [--autocast] [--mp-bf16] [--port P]

Model, data and optimizer come from bench/peer_train.py (the GPT twin of Caravan's, random token
ids of Brown's vocabulary, each rank its own batches). Every transformer block is
fully_shard'ed, then the root (the embedding and head stay in the root's group), on a 1-D
DeviceMesh over the CPU ranks. --reshard-after-forward (the same value on the blocks and the
root): true, FSDP2's default, frees each block's gathered parameters after its forward and
all-gathers them again in backward (FULL_SHARD, ZeRO-3-like: parameters, gradients and
optimizer state sharded); false keeps them from forward to backward (FSDP1's SHARD_GRAD_OP,
ZeRO-2-like: gradients and optimizer state sharded, parameters whole while a step runs; engine
"pytorch-fsdp2-grad-op"). --offload adds CPUOffloadPolicy(pin_memory=False): pinned memory
needs an accelerator, and on a CPU-only machine parameters and gradients are on the CPU
already, so offloading is mostly a no-op (it is tried because it is FSDP2's memory option).
Clipping: torch.nn.utils.clip_grad_norm_ over the sharded (DTensor) gradients, the global norm.

The peer's stronger forms (PyTorch's own advice for speed; bench/fsdp_step.py's -compile and
-bf16 arms):
  --compile [blocks]  torch.compile (inductor, CPU) of each transformer block, swapped in before
                      fully_shard, so that FSDP2's hooks run on the compiled blocks: what
                      PyTorch's reference trainer (torchtitan's apply_compile, then apply_fsdp)
                      does, compiling one block's graph for the repeated structure; the
                      embedding and head stay eager.
  --compile model     torch.compile of the whole module after fully_shard (the alternative
                      torchtitan names).
                      Either way the compilation runs in the warmup steps, not timed.
  --autocast          forward and loss under torch.autocast("cpu", dtype=torch.bfloat16), as
                      bench/peer_train.py --autocast: weights, gathers, gradients and
                      optimizer state stay float32; the products run in bf16.
  --mp-bf16           FSDP2's own mixed precision, MixedPrecisionPolicy(param_dtype=bfloat16,
                      reduce_dtype=float32) on every fully_shard (the root's output cast back
                      to float32 for the loss): the sharded parameters and optimizer state stay
                      float32, each block is all-gathered and computed in bf16 (half the gather
                      bytes), its gradients reduce-scattered in float32.

Rank 0 prints one JSON object, the shape of bench/peer_ddp.py's: step time (per step the
slowest rank's, median over steps), samples/s = workers x batch / that, every rank's peak RSS
(getrusage ru_maxrss, bytes), every rank's bytes of optimizer state (its local shards) and
compiled_graphs: how many graphs torch.compile captured on rank 0 in the warmup and in the timed
steps (the second 0 unless a recompilation was timed; both 0 without --compile).
FSDP2 may not run on the CPU with Gloo at all: then the script prints {"runs": false, "error":
"<the exception's first line>", ...} (with the phase it failed in and the rank) and exits 0,
since that is the result; the traceback goes to stderr. spawn() and common_args() are shared
with bench/peer_zero.py.
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_ddp  # noqa: E402  (free_port, gather_steps)
import peer_train  # noqa: E402


def engine(a):
    return ("pytorch-fsdp2" + ("" if a.reshard_after_forward else "-grad-op")
            + ("-offload" if a.offload else "") + ("-mp-bf16" if a.mp_bf16 else "")
            + ("-autocast" if a.autocast else "")
            + (f"-compile-{a.compile}" if a.compile else ""))


def block_names(model):
    """The names of a reference model's transformer blocks (its children b1_layer0, ...)."""
    return [n for n, _ in model.named_children() if "_layer" in n]


def compile_blocks(model):
    """Replaces each transformer block of model by its torch.compile'd module, in its place (the
    children's order is the forward's): what --compile blocks does before wrapping."""
    for n in block_names(model):
        setattr(model, n, torch.compile(getattr(model, n)))


def compiled_graphs():
    """How many graphs torch.compile (dynamo) has captured in this process so far: taken before
    and after the timed steps, to show that none was compiled while timing."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def fields(a):
    return {"offload": a.offload, "reshard_after_forward": a.reshard_after_forward,
            "compile": a.compile, "autocast": a.autocast, "mp_bf16": a.mp_bf16}


def first_line(e):
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def train(rank, a, phase):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                        fully_shard)

    peer_train.set_threads(a.threads)
    phase[0] = "init_process_group"
    dist.init_process_group("gloo", rank=rank, world_size=a.workers,
                            timeout=datetime.timedelta(seconds=120))
    phase[0] = "setup"
    cfg = peer_train.read_config(a.config)
    torch.manual_seed(0)  # the same initial model on every rank
    model, xs, ys, batch, clip = peer_train.build(cfg)
    model.train()
    names = block_names(model)
    if a.compile == "blocks":  # each block compiled, then sharded (torchtitan's order)
        phase[0] = "compile"
        compile_blocks(model)
    phase[0] = "fully_shard"
    mesh = init_device_mesh("cpu", (a.workers,))
    policy = CPUOffloadPolicy(pin_memory=False) if a.offload else OffloadPolicy()
    mp = MixedPrecisionPolicy()  # FSDP2's default: compute in the parameters' float32
    root_mp = mp
    if a.mp_bf16:
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root_mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                       output_dtype=torch.float32)  # float32 logits
    reshard = a.reshard_after_forward
    for n in names:
        fully_shard(getattr(model, n), mesh=mesh, reshard_after_forward=reshard,
                    offload_policy=policy, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy,
                mp_policy=root_mp)
    opt = peer_train.make_optimizer(cfg, model.parameters())
    forward = model
    if a.compile == "model":  # the whole sharded module compiled
        phase[0] = "compile"
        forward = torch.compile(model)
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own batches

    rows = torch.zeros(a.steps, 1, dtype=torch.float64)
    loss_sum, t_start = 0.0, None
    for i in range(-a.warmup, a.steps):
        if i == 0:
            dist.barrier()
            t_start = time.perf_counter()
            graphs_warmup = compiled_graphs()
        t0 = time.perf_counter()
        x, y = peer_train.draw_batch(xs, ys, batch, gen)
        opt.zero_grad()
        phase[0] = "forward"  # with --compile, the warmup's first forward compiles
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.autocast):
            loss = peer_train.task_loss(forward(x), y)
        phase[0] = "backward"
        loss.backward()
        phase[0] = "optimizer"
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        value = loss.item()
        if i >= 0:
            loss_sum += value
            rows[i, 0] = time.perf_counter() - t0
    wall = time.perf_counter() - t_start
    graphs_timed = compiled_graphs() - graphs_warmup
    phase[0] = "report"
    allr, _, step_median = peer_ddp.gather_steps(rows, a.workers)  # [W, steps, 1]
    rss = peer_ddp.gather_rss(a.workers)
    state = [torch.zeros(1, dtype=torch.float64) for _ in range(a.workers)]
    dist.all_gather(state, torch.tensor([float(peer_train.state_bytes(opt))],
                                        dtype=torch.float64))
    if rank == 0:
        print(json.dumps({
            "bench": "train_dist", "engine": engine(a),
            "runs": True, "config": a.config, "workers": a.workers, "threads": a.threads,
            "batch_size": batch, "steps": a.steps, "warmup": a.warmup, **fields(a),
            "step_s_median": step_median,
            "step_s_median_rank0": statistics.median(allr[0, :, 0].tolist()),
            "step_s_mean": wall / a.steps,
            "samples_per_s": a.workers * batch / step_median,
            "compiled_graphs": {"warmup": graphs_warmup, "timed": graphs_timed},  # rank 0's
            "peak_rss_bytes": rss,
            "optimizer_state_bytes": [s.item() for s in state],
            "mean_loss": loss_sum / a.steps,
            "torch": torch.__version__,
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def worker(rank, train_fn, a, port, errors):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    phase = ["start"]
    try:
        train_fn(rank, a, phase)
    except Exception as e:
        traceback.print_exc()
        with open(os.path.join(errors, f"rank{rank}"), "w") as f:
            json.dump({"rank": rank, "phase": phase[0], "error": first_line(e)}, f)
        sys.stderr.flush()
        os._exit(1)  # no cleanup that could block on the other ranks


def common_args(p):
    """The arguments every sharded peer takes (this one and bench/peer_zero.py)."""
    p.add_argument("--config", required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--port", type=int, default=0, help="rendezvous port (0: a free one)")


def stronger_args(p, choices):
    """--compile [CHOICE] and --autocast, the stronger forms every sharded peer offers (this one
    and bench/peer_zero.py); --compile alone means choices[0], the peer's documented way."""
    p.add_argument("--compile", nargs="?", const=choices[0], choices=choices,
                   help="torch.compile (inductor, CPU): each transformer block before wrapping "
                        "(blocks) or the whole wrapped model (model); default " + choices[0]
                        + "; compiled in the warmup steps, not timed")
    p.add_argument("--autocast", action="store_true",
                   help='forward and loss under torch.autocast("cpu", dtype=torch.bfloat16)')


def spawn(train_fn, a, engine_name, fields, prefix):
    """Runs train_fn(rank, a, phase) on a.workers spawned ranks (phase: a one-item list the rank
    keeps naming what it is doing). Where a rank fails, prints {"runs": false, "error": ...} with
    the earliest failing rank's error and phase, plus `fields`, and returns normally."""
    port = a.port or peer_ddp.free_port()
    with tempfile.TemporaryDirectory(prefix=prefix) as errors:
        try:
            mp.spawn(worker, args=(train_fn, a, port, errors), nprocs=a.workers, join=True)
        except Exception as e:  # a rank failed (or was killed): report the first rank's error
            # The earliest error is the cause; a later one may be a rank seeing its peer go.
            found = sorted((os.path.join(errors, n) for n in os.listdir(errors)),
                           key=lambda f: os.stat(f).st_mtime_ns)
            if found:
                with open(found[0]) as f:
                    report = json.load(f)
            else:
                report = {"rank": None, "phase": None, "error": first_line(e)}
            print(json.dumps({"bench": "train_dist", "engine": engine_name,
                              "runs": False, **report, "config": a.config,
                              "workers": a.workers, **fields,
                              "torch": torch.__version__}), flush=True)


def main():
    p = argparse.ArgumentParser()
    common_args(p)
    p.add_argument("--offload", action="store_true", help="fully_shard's CPUOffloadPolicy")
    p.add_argument("--reshard-after-forward", choices=("true", "false"), default="true",
                   help="fully_shard's reshard_after_forward: true = FULL_SHARD (ZeRO-3-like, "
                        "the default), false = SHARD_GRAD_OP (ZeRO-2-like)")
    stronger_args(p, ("blocks", "model"))
    p.add_argument("--mp-bf16", action="store_true",
                   help="MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): "
                        "gathers and computes each block in bf16")
    a = p.parse_args()
    a.reshard_after_forward = a.reshard_after_forward == "true"
    spawn(train, a, engine(a), fields(a), "peer-fsdp-")


if __name__ == "__main__":
    main()
