#!/usr/bin/env python3
"""Token-file loader against what the GPT consumes, one thread (target: 50x or more).
The loader should deliver at least 50x the samples/s the GPT trains on. Interleaved in one
invocation (L P G L P G ...):

  L  loader  `caravan_bench loader`: the loader alone, when build/caravan_bench has that
             subcommand. It does not yet (subcommands: train, matmul); the output says so and
             this arm is skipped. The smallest C++ addition is proposed in bench/README.md
             ("Scripted model and token loader throughput").
  P  proxy   `caravan train` on the token files with a module that costs next to nothing (a
             scalar times the ids, loss = the module's mean squared error): one compute
             thread, the loader's one background thread. A step can go no faster than the
             loader delivers, so P's samples/s is a LOWER BOUND on the loader's rate (the
             trainer's own loop and bookkeeping are in it too).
  G  gpt     `caravan train` of the built-in GPT (configs/brown-gpt.toml's model, batch and
             optimizer) on the same token files, train.threads = 1: what the GPT consumes.

Reports medians of samples/s (and tokens/s) and P/G (and L/G); P/G >= 50 shows the target met.

    .venv/bin/python bench/token_loader.py [--repeats 3] [--tokens 8000000] [--out DIR]
        [--proxy-steps 10000] [--gpt-steps 30] [--keep-work]
    .venv/bin/python bench/token_loader.py --replot DIR/results.json

The token files are random uint16 ids below 256 (byte-level, as examples/brown_to_tokens.py
writes), data.seq_len 128, batch 32, in DIR/work/tokens (removed at the end unless
--keep-work); they were just written, so they are in the page cache, as a file read every epoch
is. Caravan's rates come from metrics.jsonl (bench/script_step.py, --engine train): P writes a
record every 200 steps and drops the first (warm-up), G every step and drops the first 5.
Writes DIR/results.json and DIR/charts.json (DIR defaults to bench/results/token-loader).
Environment as bench/script_step.py (OPENBLAS_CORETYPE, OPENBLAS_L2_SIZE removed, printed).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import charts  # charts.json for caravan report
import script_step as ss  # environment, configs, token files, caravan train runs

SELF = os.path.abspath(__file__)
VOCAB = 256
SEQ = 128
BATCH = 32
PROXY_WARMUP = 200  # also the proxy's train.log_every
GPT_WARMUP = 5
TARGET = 50.0


def cmd_script(argv):
    """script OUT.pt: the proxy module (a scalar times the ids; mean squared error)."""
    import torch

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(1))

        def forward(self, x):
            return x.to(torch.float32).unsqueeze(-1) * self.scale

        @torch.jit.export
        def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return (output.squeeze(-1) - target.to(torch.float32)).pow(2).mean()

    torch.jit.script(Probe()).save(argv[0])


def loader_mode(bench):
    """True when caravan_bench lists a `loader` subcommand."""
    if not os.path.exists(bench):
        return False
    out = subprocess.run([bench, "--help"], capture_output=True, text=True)
    return any(l.split()[:1] == ["loader"] for l in out.stdout.splitlines())


def subcommands(bench):
    if not os.path.exists(bench):
        return []
    out = subprocess.run([bench, "--help"], capture_output=True, text=True).stdout
    lines = out.split("Subcommands:", 1)[-1].splitlines()
    return [l.split()[0] for l in lines if l.startswith("  ") and l.split()]


NO_LOADER = ("build/caravan_bench has no loader mode (its subcommands: {subs}): the token-file "
             "loader cannot be timed alone without C++. Arm L skipped; arm P (caravan train "
             "with a near-free model) is a lower bound on the loader's rate. Proposed addition "
             "(bench/README.md): `caravan_bench loader --config CFG --batches N --warmup W`, "
             "benchLoader() in bench/bench_train.cpp.")


def summarize(data):
    med = {}
    for arm in ("loader", "proxy", "gpt"):
        v = [m["samples_per_s"] for m in data["raw"] if m["arm"] == arm]
        med[arm] = statistics.median(v) if v else None
    return med


def report(data):
    med = summarize(data)
    seq = data["seq_len"]
    lines = [f"token-file loader against the GPT, one thread; median of {data['repeats']} "
             "interleaved runs per arm",
             ss.environment_note(data["removed_env"], except_c=False)]
    if not data["loader_mode"]:
        lines.append(NO_LOADER.format(subs=", ".join(data["subcommands"]) or "none"))
    lines += ["", "| arm | samples/s | tokens/s | x GPT |", "|---|---|---|---|"]
    names = {"loader": "L: caravan_bench loader (loader alone)",
             "proxy": "P: caravan train, near-free model (lower bound on the loader)",
             "gpt": "G: caravan train, built-in GPT (what it consumes)"}
    for arm in ("loader", "proxy", "gpt"):
        if med[arm] is None:
            continue
        x = med[arm] / med["gpt"] if med["gpt"] else float("nan")
        lines.append(f"| {names[arm]} | {med[arm]:.1f} | {med[arm] * seq:.0f} | {x:.1f} |")
    lines.append("")
    for arm, what in (("loader", "L/G"), ("proxy", "P/G (lower bound)")):
        if med[arm] is not None and med["gpt"]:
            r = med[arm] / med["gpt"]
            lines.append(f"{what}: {r:.1f}x ({'met' if r >= TARGET else 'not shown'}: "
                         f">= {TARGET:.0f}x)")
    return "\n".join(lines)


def write_charts(data, path):
    med = summarize(data)
    arms = [a for a in ("loader", "proxy", "gpt") if med[a] is not None]
    text = report(data)
    return charts.write(
        charts.beside(path), "token-loader", "Token-file loader against what the GPT consumes",
        [charts.bar("samples", "Samples per second, one thread", arms,
                    [charts.series("samples / s", y=[med[a] for a in arms])], "samples / s",
                    log_y=True),
         charts.bar("ratio", f"Times the GPT's samples/s (target >= {TARGET:.0f})",
                    [a for a in arms if a != "gpt"],
                    [charts.series("x GPT", y=[med[a] / med["gpt"] for a in arms if a != "gpt"])],
                    "ratio")],
        note=(NO_LOADER.format(subs=", ".join(data["subcommands"]) or "none")
              if not data["loader_mode"] else None),
        command=charts.command("bench/token_loader.py", data.get("args"),
                               skip=("replot", "bench", "caravan", "out", "keep_work")),
        table=charts.markdown_table(text))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "script":
        return cmd_script(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--tokens", type=int, default=8_000_000, help="tokens in train.bin")
    p.add_argument("--proxy-steps", type=int, default=10000,
                   help=f"timed steps of P (a multiple of {PROXY_WARMUP})")
    p.add_argument("--gpt-steps", type=int, default=30)
    p.add_argument("--loader-batches", type=int, default=20000, help="arm L's timed batches")
    p.add_argument("--out", default=os.path.join(ss.ROOT, "bench", "results", "token-loader"))
    p.add_argument("--keep-work", action="store_true")
    p.add_argument("--bench", default=ss.BENCH)
    p.add_argument("--caravan", default=ss.CARAVAN)
    p.add_argument("--replot", metavar="JSON", help="run nothing: rebuild charts.json beside it")
    a = p.parse_args()
    if a.replot:
        with open(a.replot) as f:
            print("wrote", write_charts(json.load(f), a.replot))
        return
    if a.proxy_steps % PROXY_WARMUP:
        sys.exit(f"token_loader: --proxy-steps must be a multiple of {PROXY_WARMUP}")
    environ, removed = ss.environment()
    print(ss.environment_note(removed, except_c=False), flush=True)
    has_loader, subs = loader_mode(a.bench), subcommands(a.bench)
    if not has_loader:
        print(NO_LOADER.format(subs=", ".join(subs) or "none"), flush=True)
    out = os.path.abspath(a.out)
    work = os.path.join(out, "work")
    tokens = ss.write_token_files(os.path.join(work, "tokens"), a.tokens)
    probe = os.path.join(work, "probe.pt")
    subprocess.run([ss.PYTHON, SELF, "script", probe], check=True, env=environ)
    data_cfg = {"dataset": "tokens", "path": tokens, "token_dtype": "uint16", "vocab_size": VOCAB,
                "seq_len": SEQ, "batch_size": BATCH, "eval_batch_size": 64}
    gpt = ss.read_toml(os.path.join(ss.ROOT, "configs", "brown-gpt.toml"))
    gpt["data"] = dict(data_cfg)
    gpt = ss.write_toml(ss.timed_run_config(gpt, 1, GPT_WARMUP, a.gpt_steps),
                        os.path.join(work, "gpt.toml"))
    proxy = {"data": dict(data_cfg), "model": {"name": "torchscript", "path": probe,
                                               "loss": "module"},
             "optim": {"name": "sgd", "lr": 1e-6, "momentum": 0.0}}
    proxy = ss.write_toml(ss.timed_run_config(proxy, 1, PROXY_WARMUP, a.proxy_steps,
                                              log_every=PROXY_WARMUP),
                          os.path.join(work, "proxy.toml"))
    raw, n = [], 0
    for rep in range(a.repeats):
        for arm in ("loader", "proxy", "gpt"):
            if arm == "loader":
                if not has_loader:
                    continue
                m = ss.run_json([a.bench, "loader", "--config", proxy, "--batches",
                                 str(a.loader_batches), "--warmup", "100"], environ)
            else:
                n += 1
                m = ss.run_caravan_train(proxy if arm == "proxy" else gpt,
                                         os.path.join(work, f"run-{n}"),
                                         PROXY_WARMUP if arm == "proxy" else GPT_WARMUP, BATCH,
                                         environ, a.caravan)
            m = dict(m, arm=arm, repeat=rep)
            raw.append(m)
            print(f"  #{rep} {arm:<7}{m['samples_per_s']:12.1f} samples/s", file=sys.stderr,
                  flush=True)
    data = {"raw": raw, "repeats": a.repeats, "seq_len": SEQ, "batch_size": BATCH,
            "tokens": a.tokens, "loader_mode": has_loader, "subcommands": subs,
            "removed_env": removed, "args": vars(a)}
    print(report(data))
    ss.save_results(data, out, write_charts, work, a.keep_work)


if __name__ == "__main__":
    main()
