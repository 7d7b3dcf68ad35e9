#!/usr/bin/env python3
"""caravan export: a PyTorch model as it is, written as a TorchScript file Caravan trains.

    caravan export FILE.py:FACTORY -o OUT.pt [--blocks auto|PATH[,PATH...]]
    (or: .venv/bin/python tools/caravan_export.py FILE.py:FACTORY -o OUT.pt ...)

FACTORY is a callable in FILE.py that returns (module, example_input): the model, built as the
user builds it (no rewrite), and one batch of its input. The module is traced in training mode
with torch.jit.trace, not scripted: Hugging Face models and nanoGPT under torch 2.x do not
script (torch.jit.script compiles every branch of their forward, and torch.fx's symbolic trace
stops at their data-dependent checks), while a trace records the operations one batch runs.
What a trace fixes, it fixes for good: the branches that batch took and the training flag (a
BatchNorm or dropout runs as in training, evaluation included). Caravan's loader then cuts the
traced forward into blocks at its repeated layers (src/models/graph_cut.h).

The module is called as model(x) and trained on its first output: a Tensor, the first element
of a tuple, or a Hugging Face output's logits. A Hugging Face model (transformers'
PreTrainedModel) is called with return_dict=False, and use_cache=False where it takes it. The
call goes through a one-attribute wrapper ("m"); the file says so (caravan/export.json,
names_prefix "m."), and Caravan exports the parameters under the module's own names, so its
model.pt loads into the user's class with load_state_dict(strict=True).

Checks before writing: parameters are float32, the traced forward gives the module's output
bitwise on the example (training mode, both from the same generator state; the module's buffers
are put back afterwards, so the file holds the factory's state). Exit codes: 0 written, 2 bad input (one line
on stderr).
"""
import argparse
import importlib.util
import inspect
import json
import os
import sys
import warnings


def fail(message):
    print(f"caravan export: error: {message}", file=sys.stderr)
    sys.exit(2)


def load_factory(spec):
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        fail(f"{spec}: give FILE.py:FACTORY (a callable in FILE.py returning (module, input))")
    if not os.path.isfile(path):
        fail(f"{path} does not exist or is not a file")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    module_spec = importlib.util.spec_from_file_location("caravan_export_user", path)
    user = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(user)
    except Exception as e:  # the user's file: any error is theirs, said in one line
        fail(f"{path} fails on import: {type(e).__name__}: {e}")
    factory = getattr(user, name, None)
    if not callable(factory):
        fail(f"{path} has no callable {name}")
    return factory


def main(argv):
    parser = argparse.ArgumentParser(prog="caravan export", description=__doc__.split("\n")[0])
    parser.add_argument("factory", help="FILE.py:FACTORY, returning (module, example_input)")
    parser.add_argument("-o", "--output", required=True, help="the TorchScript file to write")
    parser.add_argument("--blocks", default="auto",
                        help="the containers whose items are the blocks (default: auto)")
    args = parser.parse_args(argv)

    # Hugging Face's notes at model construction (a config's defaults) are not the export's.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import torch.nn as nn

    made = load_factory(args.factory)()
    if not isinstance(made, tuple) or len(made) != 2 or not isinstance(made[0], nn.Module):
        fail(f"{args.factory} must return (module, example_input); it returned "
             f"{type(made).__name__}")
    model, example = made
    if not isinstance(example, torch.Tensor):
        fail(f"{args.factory}: the example input is {type(example).__name__}; give one Tensor")
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            fail(f"parameter {name} is {p.dtype}; Caravan trains float32 parameters "
                 "(model.float() in the factory)")

    kwargs = {}
    try:
        from transformers import PreTrainedModel  # optional: only for Hugging Face models
        if isinstance(model, PreTrainedModel):
            kwargs["return_dict"] = False
            if "use_cache" in inspect.signature(model.forward).parameters:
                kwargs["use_cache"] = False
    except ImportError:
        pass

    class Called(nn.Module):
        """model(x, **kwargs), its first output."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            out = self.m(x, **kwargs)
            while isinstance(out, (tuple, list)):
                out = out[0]
            if hasattr(out, "logits"):
                out = out.logits
            return out

    wrapper = Called(model).train()
    # Tracing and the check run the forward in training mode: BatchNorm's running statistics
    # move and dropout draws. The file keeps the factory's state, and the generator is left as
    # the factory left it.
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python values it fixes
        try:
            traced = torch.jit.trace(wrapper, (example,), check_trace=False)
        except Exception as e:
            fail(f"torch.jit.trace of {args.factory} fails: {type(e).__name__}: "
                 f"{str(e).splitlines()[0] if str(e) else ''}")
    with torch.no_grad():
        torch.set_rng_state(rng)
        expected = wrapper(example)
        torch.set_rng_state(rng)
        got = traced(example)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    torch.set_rng_state(rng)
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor):
        fail(f"{args.factory}: the model's first output is not a Tensor")
    if got.shape != expected.shape or not torch.equal(got, expected):
        fail(f"the traced forward of {args.factory} differs from the module's on the example "
             "(a branch on the data, or randomness in training mode?)")
    meta = {"names_prefix": "m.", "blocks": args.blocks, "traced_with": "torch.jit.trace",
            "torch": torch.__version__, "factory": args.factory,
            "example": {"shape": list(example.shape), "dtype": str(example.dtype)}}
    traced.save(args.output, _extra_files={"caravan/export.json": json.dumps(meta)})
    parameters = sum(p.numel() for p in model.parameters())
    print(f"caravan export: wrote {args.output}: {type(model).__name__}, {parameters} "
          f"parameters, traced on input {list(example.shape)} {example.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
