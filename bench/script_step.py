#!/usr/bin/env python3
"""Training throughput of a scripted model against the built-in one and PyTorch eager.
For each config and thread count the runs are interleaved in one invocation
(A B C C' A B C C' ...):

  A  caravan   Caravan trains its built-in model (model.name = cnn, gpt, ...).
  B  script    Caravan trains the scripted twin of that model: model.name = torchscript,
               model.path = a file this script writes with .venv/bin/python:
               torch.jit.script(reference_models.build(...)).save(...). Same blocks, parameter
               names and sizes (tests/python/reference_models.py, the module
               tests/python/script_models.py scripts gpt.pt from).
  C  pytorch-tuned  Python PyTorch eager (the un-scripted nn.Module from the same definition),
               with GLIBC_TUNABLES=glibc.malloc.trim_threshold=268435456:
               glibc.malloc.mmap_threshold=33554432 (the allocator setting Caravan's first fix
               used, bench/README.md, issue 3). The target comparison.
  C' pytorch   the same, with glibc's default allocator (GLIBC_TUNABLES unset).

Every arm: the config's batch, optimizer and clipping, the same thread count (train.threads /
torch.set_num_threads), warm-up steps excluded. Reports the median samples/s of each arm over
the repeats and B/A (target >= 0.95), B/C (target >= 1.0) and B/C'.

    .venv/bin/python bench/script_step.py [--repeats 3] [--threads 1 2]
        [--cases fmnist-cnn brown-gpt [tokens-gpt | PATH.toml ...]] [--steps N] [--warmup N]
        [--engine auto|bench|train] [--out DIR] [--keep-work]
    .venv/bin/python bench/script_step.py --replot DIR/results.json

Cases: fmnist-cnn (configs/fmnist-cnn.toml, 300 timed steps), brown-gpt (configs/brown-gpt.toml,
60), tokens-gpt (brown-gpt's model and optimizer on random byte-level token files this script
writes, data.dataset = tokens, vocab 256, 60), or any config of a built-in model on
fashion-mnist, brown or tokens data (100). Warm-up: 10 steps.

How Caravan is timed (--engine):
  bench  build/caravan_bench train --config CFG --steps N --warmup W --threads T (what
         bench/train_throughput.py runs; it builds the model from the config, so it takes
         model.name = torchscript like any other).
  train  build/caravan train with train.log_every = 1; each train record of metrics.jsonl
         (docs/metrics.md) has the step's samples_per_s over its window (loader wait, step,
         bookkeeping; evaluations and checkpoints left out). Records of the warm-up steps are
         dropped; the run's rate is the timed samples over the sum of the timed windows.
  auto   (default) bench when a one-step caravan_bench run of the first case works for both
         Caravan arms, else train; the output says which and why.
The PyTorch peer times each whole step (drawing the batch by indexing preloaded tensors,
forward, loss, backward, clipping, optimizer step) with time.perf_counter.

OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (and OMP_/OPENBLAS_/MKL_NUM_THREADS, GLIBC_TUNABLES)
are removed from every measured process's environment; the output says which were set.

Writes DIR/results.json (every measurement) and DIR/charts.json (for `caravan report`,
docs/report.md); DIR defaults to bench/results/script. The scripted modules, derived configs
and token files go to DIR/work, removed at the end unless --keep-work.
Internal subcommands (run by the driver): `script CONFIG OUT.pt`, `peer --config CFG ...`.
"""
import argparse
import copy
import json
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
import tomllib

import charts  # charts.json for caravan report

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BENCH = os.path.join(ROOT, "build", "caravan_bench")
CARAVAN = os.path.join(ROOT, "build", "caravan")
PYTHON = sys.executable  # the Python running this (.venv/bin/python), with the project's torch
SELF = os.path.abspath(__file__)
TUNABLES = "glibc.malloc.trim_threshold=268435456:glibc.malloc.mmap_threshold=33554432"
BROWN_VOCAB = 86  # what Caravan's Brown loader reports (85 characters + unknown)
TOKEN_VOCAB = 256  # tokens-gpt: byte-level ids, as examples/brown_to_tokens.py writes
# name -> (config, timed steps, data overrides); "tokens" is filled in with the work directory
CASES = {
    "fmnist-cnn": ("configs/fmnist-cnn.toml", 300, None),
    "brown-gpt": ("configs/brown-gpt.toml", 60, None),
    "tokens-gpt": ("configs/brown-gpt.toml", 60, "tokens"),
}
DEFAULT_CASES = ["fmnist-cnn", "brown-gpt"]
ARMS = [  # (key, column heading, description)
    ("caravan", "A builtin/s", "A: Caravan, built-in model"),
    ("script", "B script/s", "B: Caravan, scripted twin (model.name = torchscript)"),
    ("pytorch-tuned", "C tuned/s", "C: PyTorch eager, GLIBC_TUNABLES set"),
    ("pytorch", "C' untuned/s", "C': PyTorch eager, default malloc"),
]
RUN_TIMEOUT = 1800


# ---- environment, configs, token files (token_loader.py uses these too) -----------------------

def environment():
    """(environment for the measured processes, names removed that were set)."""
    e = dict(os.environ)
    removed = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "GLIBC_TUNABLES")
               if e.pop(k, None) is not None]
    for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        e.pop(k, None)
    return e, removed


def environment_note(removed, except_c=True):
    return ("unset in every measured process's environment: OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE, "
            f"GLIBC_TUNABLES{' (except arm C)' if except_c else ''}, OMP/OPENBLAS/MKL_NUM_THREADS"
            f"; of the first three, set in this shell: {', '.join(removed) or 'none'}")


def read_toml(path):
    with open(path, "rb") as f:
        return tomllib.load(f)


def _toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ValueError(f"cannot write {v!r} as TOML")


def write_toml(cfg, path):
    """Writes a config of [section] tables of scalar keys (all Caravan's configs are)."""
    lines = []
    for section, table in cfg.items():
        if not isinstance(table, dict):
            raise ValueError(f"top-level key {section} is not a table")
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def write_token_files(directory, train_tokens, val_tokens=200_000, seed=0):
    """train.bin and val.bin of uniform random uint16 ids below 256 (data.token_dtype = uint16,
    data.vocab_size = 256). Standard library only."""
    os.makedirs(directory, exist_ok=True)
    rng = random.Random(seed)
    for name, n in (("train.bin", train_tokens), ("val.bin", val_tokens)):
        buf = bytearray(2 * n)  # little-endian uint16: low byte the id, high byte 0
        buf[0::2] = rng.randbytes(n)
        with open(os.path.join(directory, name), "wb") as f:
            f.write(buf)
    return directory


def timed_run_config(cfg, threads, warmup, steps, log_every=1):
    """The config for one timed `caravan train`: max_steps, a train record every log_every steps,
    the thread count, no evaluation or checkpoint before the end (one batch evaluated then)."""
    cfg = copy.deepcopy(cfg)
    train = cfg.setdefault("train", {})
    for k in ("epochs", "max_minutes"):
        train.pop(k, None)
    # float32 against PyTorch's float32; a step horizon, as max_minutes is gone.
    train.update({"max_steps": warmup + steps, "log_every": log_every, "threads": threads,
                  "eval_every": warmup + steps, "eval_batches": 1, "precision": "float32"})
    cfg.setdefault("schedule", {})["horizon"] = "steps"
    cfg["checkpoint"] = {"every": 0, "keep": 1}
    return cfg


def read_train_run(run_dir):
    """(the train records of RUN_DIR/metrics.jsonl, RUN_DIR/summary.json)."""
    records = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            j = json.loads(line)
            if j.get("kind") == "train":
                records.append(j)
    with open(os.path.join(run_dir, "summary.json")) as f:
        return records, json.load(f)


def timed_samples(records, warmup, batch):
    """Over the train records after step `warmup`: (samples, seconds, each record's rate, each
    record's compute_s, steps)."""
    samples = seconds = 0.0
    rates, compute, prev, timed_steps = [], [], 0, 0
    for r in records:
        n = r["step"] - prev
        prev = r["step"]
        if r["step"] <= warmup:
            continue
        s = n * batch * r.get("workers", 1)
        samples += s
        seconds += s / r["samples_per_s"]
        rates.append(r["samples_per_s"])
        compute.append(r["compute_s"])
        timed_steps += n
    return samples, seconds, rates, compute, timed_steps


def run_caravan_train(config_path, run_dir, warmup, batch, environ, caravan=CARAVAN):
    """Runs `caravan train -q` and reads metrics.jsonl: the rate of the train records after the
    warm-up (timed samples over the sum of their windows), the median record's rate, the median
    compute_s, and the number of blocks (summary.json's memory_policy). Removes run_dir."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [caravan, "train", "-q", "--config", config_path, "--run-dir", run_dir]
    out = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    if out.returncode != 0:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {' '.join(cmd)} failed "
                 f"(exit {out.returncode}):\n{out.stderr}")
    records, summary = read_train_run(run_dir)
    shutil.rmtree(run_dir, ignore_errors=True)
    samples, seconds, rates, compute, timed_steps = timed_samples(records, warmup, batch)
    if seconds <= 0:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {run_dir}: no train record after "
                 f"step {warmup}")
    return {"samples_per_s": samples / seconds, "record_samples_per_s_median":
            statistics.median(rates), "compute_s_median": statistics.median(compute),
            "timed_steps": timed_steps, "seconds": seconds,
            "blocks": len(summary.get("memory_policy", "").split(",")),
            "train_summary_samples_per_s": summary.get("samples_per_s")}


def run_json(cmd, environ):
    out = subprocess.run(cmd, cwd=ROOT, env=environ, capture_output=True, text=True,
                         timeout=RUN_TIMEOUT)
    if out.returncode != 0:
        sys.exit(f"{os.path.basename(sys.argv[0])}: {' '.join(cmd)} failed "
                 f"(exit {out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def show(path):
    """A path relative to the repository when inside it, else absolute."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


def first_error_line(text):
    lines = [l for l in text.strip().splitlines() if l.strip()]
    return lines[-1] if lines else "(no message)"


# ---- the model's Python definition (run under .venv/bin/python with torch) --------------------

def twin(cfg):
    """The nn.Module Caravan builds for this config (tests/python/reference_models.py), from the
    current torch seed."""
    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    import reference_models
    data, model = cfg.get("data", {}), cfg.get("model", {})
    name = model.get("name", "cnn")
    dataset = data.get("dataset", "fashion-mnist")
    sizes = (model.get("width", 0), model.get("depth", 0), model.get("heads", 0),
             model.get("dropout", 0.0))
    if dataset == "fashion-mnist":
        return reference_models.build(name, *sizes)
    if dataset in ("brown", "tokens"):
        vocab = BROWN_VOCAB if dataset == "brown" else data["vocab_size"]
        return reference_models.build(name, *sizes, vocab=vocab, seq=data.get("seq_len", 128))
    raise SystemExit(f"script_step: data.dataset = {dataset} is not supported (fashion-mnist, "
                     "brown, tokens)")


def cmd_script(argv):
    """script CONFIG OUT.pt: torch.jit.script(twin(config)).save(OUT.pt), seed 0."""
    import torch
    config, out = argv
    torch.manual_seed(0)
    module = twin(read_toml(config))
    torch.jit.script(module).save(out)
    print(json.dumps({"scripted": out, "parameters": sum(p.numel() for p in module.parameters()),
                      "children": [n for n, _ in module.named_children()],
                      "torch": torch.__version__}))


def cmd_peer(argv):
    """peer --config CFG --steps N --warmup W --threads T: PyTorch eager training steps of
    twin(CFG) with its batch, optimizer and clipping (bench/peer_train.py's helpers); one JSON
    line. Data: Fashion-MNIST preloaded, or random token ids of the vocabulary."""
    import torch
    sys.path.insert(0, os.path.dirname(SELF))
    import peer_train
    p = argparse.ArgumentParser(prog="script_step.py peer")
    p.add_argument("--config", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    peer_train.set_threads(a.threads)
    cfg = read_toml(a.config)
    data = cfg.get("data", {})
    batch = data.get("batch_size", 64)
    torch.manual_seed(0)
    model = twin(cfg)
    if data.get("dataset", "fashion-mnist") == "fashion-mnist":
        xs, ys = peer_train.load_fmnist(data.get("path") or "/usr/share/datasets/fashion-mnist")
    else:
        vocab = BROWN_VOCAB if data["dataset"] == "brown" else data["vocab_size"]
        seq = data.get("seq_len", 128)
        tokens = torch.randint(0, vocab, (4096, seq + 1))
        xs, ys = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    clip = cfg.get("optim", {}).get("grad_clip", 0.0)
    model.train()
    opt = peer_train.make_optimizer(cfg, model.parameters())

    step = peer_train.make_step(model, opt, xs, ys, batch, clip)

    for _ in range(a.warmup):
        step()
    faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    cpu0 = peer_train.cpu_seconds()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0
    cpu = peer_train.cpu_seconds() - cpu0
    s = sum(times)
    print(json.dumps({"bench": "script_step-peer", "config": a.config, "threads": a.threads,
                      "batch_size": batch, "steps": a.steps, "seconds": s,
                      "samples_per_s": a.steps * batch / s,
                      "step_s_median": statistics.median(times),
                      "minor_faults_per_step": faults / a.steps,
                      "cpu_s_per_s": cpu / s,
                      "glibc_tunables": os.environ.get("GLIBC_TUNABLES"),
                      "torch": torch.__version__}))


# ---- the driver ----------------------------------------------------------------------------------

def case_configs(case, work):
    """(base config dict, timed steps, short name) of a case name or a config path."""
    if case in CASES:
        path, steps, data = CASES[case]
        cfg = read_toml(os.path.join(ROOT, path))
        if data == "tokens":
            cfg["data"] = {"dataset": "tokens", "path": os.path.join(work, "tokens"),
                           "token_dtype": "uint16", "vocab_size": TOKEN_VOCAB,
                           "seq_len": cfg["data"].get("seq_len", 128),
                           "batch_size": cfg["data"].get("batch_size", 32),
                           "eval_batch_size": cfg["data"].get("eval_batch_size", 64)}
        return cfg, steps, case
    cfg = read_toml(case if os.path.isabs(case) else os.path.join(ROOT, case))
    return cfg, 100, os.path.basename(case).removesuffix(".toml")


def script_config(cfg, pt):
    """cfg with its model replaced by the scripted file (the model.* size keys have no meaning
    for model.name = torchscript: Caravan refuses them)."""
    cfg = copy.deepcopy(cfg)
    cfg["model"] = {"name": "torchscript", "path": pt}
    return cfg


class Caravan:
    """Times one Caravan run of a config with the chosen engine."""

    def __init__(self, engine, bench, caravan, work):
        self.engine, self.bench, self.caravan, self.work = engine, bench, caravan, work
        self.count = 0

    def run(self, config_path, threads, warmup, steps, batch, environ):
        if self.engine == "bench":
            r = run_json([self.bench, "train", "--config", config_path, "--steps", str(steps),
                          "--warmup", str(warmup), "--threads", str(threads)], environ)
            return {"samples_per_s": r["samples_per_s"], "raw": r}
        self.count += 1
        return run_caravan_train(config_path, os.path.join(self.work, f"run-{self.count}"),
                                 warmup, batch, environ, self.caravan)


def choose_engine(requested, bench, configs, environ):
    """(engine, why): caravan_bench when it runs both Caravan configs for one step."""
    if requested == "train":
        return "train", "--engine train"
    if not os.path.exists(bench):
        if requested == "bench":
            sys.exit(f"script_step: {bench} missing")
        return "train", f"{bench} missing"
    for path in configs:
        out = subprocess.run([bench, "train", "--config", path, "--steps", "1", "--warmup", "0",
                              "--threads", "1"], cwd=ROOT, env=environ, capture_output=True,
                             text=True, timeout=RUN_TIMEOUT)
        if out.returncode != 0:
            why = (f"`caravan_bench train --config {show(path)} --steps 1` "
                   f"failed (exit {out.returncode}): {first_error_line(out.stderr)}")
            if requested == "bench":
                sys.exit(f"script_step: {why}")
            return "train", why
    return "bench", "caravan_bench train runs both the built-in and the scripted config"


def save_results(data, out, write_charts, work, keep_work):
    """DIR/results.json and (write_charts) its charts.json; the work directory removed unless
    --keep-work. Shared with token_loader.py."""
    path = os.path.join(out, "results.json")
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
    print("wrote", path, "and", write_charts(data, path))
    if not keep_work:
        shutil.rmtree(work, ignore_errors=True)


def ratio(a, b):
    return a / b if b else float("nan")


def summarize(data):
    """Rows [case, threads, A, B, C, C', B/A, B/C, B/C'] (medians) from the raw measurements."""
    rows = []
    for key in dict.fromkeys((m["case"], m["threads"]) for m in data["raw"]):
        med = {}
        for arm, _, _ in ARMS:
            v = [m["samples_per_s"] for m in data["raw"]
                 if (m["case"], m["threads"]) == key and m["arm"] == arm]
            med[arm] = statistics.median(v) if v else float("nan")
        a, b, c, cu = (med[k] for k, _, _ in ARMS)
        rows.append([key[0], key[1], a, b, c, cu, ratio(b, a), ratio(b, c), ratio(b, cu)])
    return rows


def report(data):
    rows = summarize(data)
    lines = [f"scripted twin against built-in model, one worker; median of {data['repeats']} "
             f"interleaved runs per arm ({', '.join(k for k, _, _ in ARMS)})",
             f"Caravan timed with: {data['engine']} ({data['engine_why']})",
             environment_note(data["removed_env"]),
             f"C: GLIBC_TUNABLES={TUNABLES}; C': GLIBC_TUNABLES unset",
             "", "| case | threads | " + " | ".join(h for _, h, _ in ARMS) +
             " | B/A | B/C | B/C' |", "|---|---|---|---|---|---|---|---|---|"]
    for case, t, a, b, c, cu, ba, bc, bcu in rows:
        lines.append(f"| {case} | {t} | {a:.1f} | {b:.1f} | {c:.1f} | {cu:.1f} | {ba:.3f} | "
                     f"{bc:.3f} | {bcu:.3f} |")
    lines.append("")
    for case, t, a, b, c, cu, ba, bc, bcu in rows:
        lines.append(f"{case}, {t} thread{'s' if t != 1 else ''}: B/A {ba:.3f} "
                     f"({'met' if ba >= 0.95 else 'MISSED'}: >= 0.95), B/C {bc:.3f} "
                     f"({'met' if bc >= 1.0 else 'MISSED'}: >= 1.0), B/C' {bcu:.3f}")
    for case, t, *_ in rows:
        faults = {arm: [m["minor_faults_per_step"] for m in data["raw"] if m["case"] == case
                        and m["threads"] == t and m["arm"] == arm and "minor_faults_per_step" in m]
                  for arm in ("pytorch-tuned", "pytorch")}
        if all(faults.values()):
            lines.append(f"{case}, {t} thread{'s' if t != 1 else ''}: PyTorch minor page faults "
                         f"per step (median): C {statistics.median(faults['pytorch-tuned']):.0f}, "
                         f"C' {statistics.median(faults['pytorch']):.0f}")
    blocks = {}
    for m in data["raw"]:
        if "blocks" in m:
            blocks.setdefault((m["case"], m["arm"]), set()).add(m["blocks"])
    for case in dict.fromkeys(m["case"] for m in data["raw"]):
        a, b = blocks.get((case, "caravan")), blocks.get((case, "script"))
        if a and b and a != b:
            lines.append(f"WARNING {case}: the scripted twin trained as {sorted(b)} block(s), the "
                         f"built-in model as {sorted(a)}")
    return "\n".join(lines), rows


def write_charts(data, path):
    rows = summarize(data)
    labels = [f"{r[0]}, {r[1]} thread{'s' if r[1] != 1 else ''}" for r in rows]
    out = [charts.bar("samples", "Training samples per second (one worker)", labels,
                      [charts.series(d, y=[r[2 + i] for r in rows])
                       for i, (_, _, d) in enumerate(ARMS)], "samples / s",
                      x_label="case, threads"),
           charts.bar("ratio", "Scripted twin (B) against the built-in model (A) and PyTorch "
                      "eager (C tuned, C' default malloc)", labels,
                      [charts.series("B/A (target >= 0.95)", y=[r[6] for r in rows]),
                       charts.series("B/C (target >= 1.0)", y=[r[7] for r in rows]),
                       charts.series("B/C'", y=[r[8] for r in rows])], "ratio",
                      x_label="case, threads")]
    text, _ = report(data)
    note = (f"Interleaved runs A B C C', medians of {data['repeats']}. Caravan timed with "
            f"{data['engine']}. {environment_note(data['removed_env'])}. C: GLIBC_TUNABLES="
            f"{TUNABLES}.")
    return charts.write(charts.beside(path), "script-step",
                        "Scripted model (TorchScript) against the built-in model and PyTorch",
                        out, note=note,
                        command=charts.command("bench/script_step.py", data.get("args"),
                                               skip=("replot", "bench", "caravan", "out",
                                                     "keep_work")),
                        table=charts.markdown_table(text))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "script":
        return cmd_script(sys.argv[2:])
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        return cmd_peer(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--cases", nargs="+", default=DEFAULT_CASES,
                   help=f"{', '.join(CASES)} or config paths (default: "
                        f"{' '.join(DEFAULT_CASES)})")
    p.add_argument("--steps", type=int, help="timed steps for every case (default: per case)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--engine", choices=["auto", "bench", "train"], default="auto")
    p.add_argument("--token-file-tokens", type=int, default=4_000_000,
                   help="tokens-gpt: tokens in train.bin")
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "script"))
    p.add_argument("--keep-work", action="store_true")
    p.add_argument("--bench", default=BENCH)
    p.add_argument("--caravan", default=CARAVAN)
    p.add_argument("--replot", metavar="JSON", help="run nothing: rebuild charts.json beside it")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            print("wrote", write_charts(json.load(f), a.replot))
        return
    if not os.path.exists(a.caravan):
        sys.exit(f"script_step: {a.caravan} missing; build it with bash scripts/setup.sh")
    environ, removed = environment()
    tuned = dict(environ, GLIBC_TUNABLES=TUNABLES)
    print(environment_note(removed), flush=True)
    out = os.path.abspath(a.out)
    work = os.path.join(out, "work")
    os.makedirs(work, exist_ok=True)

    # Per case: the built-in config, the scripted file and its config, per thread count.
    cases = []
    for case in a.cases:
        cfg, steps, name = case_configs(case, work)
        steps = a.steps or steps
        if cfg.get("data", {}).get("dataset") == "tokens" and case in CASES:
            write_token_files(cfg["data"]["path"], a.token_file_tokens)
        base = os.path.join(work, name)
        pt = base + ".pt"
        write_toml(cfg, base + "-model.toml")  # what the twin and the peer are built from
        s = run_json([PYTHON, SELF, "script", base + "-model.toml", pt], environ)
        print(f"{name}: scripted {s['parameters']} parameters, children {s['children']} -> "
              f"{show(pt)}", flush=True)
        per_thread = {}
        for t in a.threads:
            builtin = write_toml(timed_run_config(cfg, t, a.warmup, steps),
                                 f"{base}-builtin-t{t}.toml")
            scripted = write_toml(timed_run_config(script_config(cfg, pt), t, a.warmup, steps),
                                  f"{base}-script-t{t}.toml")
            per_thread[t] = (builtin, scripted)
        cases.append((name, cfg, steps, base + "-model.toml", per_thread))

    engine, why = choose_engine(a.engine, a.bench, cases[0][4][a.threads[0]], environ)
    print(f"Caravan timed with: {engine} ({why})", flush=True)
    caravan = Caravan(engine, a.bench, a.caravan, work)

    raw = []
    for name, cfg, steps, model_cfg, per_thread in cases:
        batch = cfg.get("data", {}).get("batch_size", 64)
        for t in a.threads:
            builtin, scripted = per_thread[t]
            for rep in range(a.repeats):  # interleaved: A B C C' A B C C' ...
                for arm, _, _ in ARMS:
                    if arm in ("caravan", "script"):
                        m = caravan.run(builtin if arm == "caravan" else scripted, t, a.warmup,
                                        steps, batch, environ)
                    else:
                        m = run_json([PYTHON, SELF, "peer", "--config", model_cfg, "--steps",
                                      str(steps), "--warmup", str(a.warmup), "--threads", str(t)],
                                     tuned if arm == "pytorch-tuned" else environ)
                    m = dict(m, case=name, threads=t, arm=arm, repeat=rep, steps=steps)
                    raw.append(m)
                    print(f"  {name} t={t} #{rep} {arm:<14}{m['samples_per_s']:10.1f} samples/s",
                          file=sys.stderr, flush=True)

    data = {"raw": raw, "repeats": a.repeats, "engine": engine, "engine_why": why,
            "removed_env": removed, "tunables": TUNABLES, "args": vars(a)}
    text, rows = report(data)
    data["rows"] = rows
    print(text)
    save_results(data, out, write_charts, work, a.keep_work)


if __name__ == "__main__":
    main()
