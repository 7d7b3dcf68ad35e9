#!/usr/bin/env python3
"""caravan export: a PyTorch model as it is, written as a TorchScript file Caravan trains.

    caravan export FILE.py:FACTORY -o OUT.pt [--blocks auto|PATH[,PATH...]]
    (or: .venv/bin/python tools/caravan_export.py FILE.py:FACTORY -o OUT.pt ...)

FACTORY is a callable in FILE.py that returns (module, example_input): the model, built as the
user builds it (no rewrite), and one batch of its input; or (module, (example_input,
example_targets)) for a module whose forward(x, targets) returns its own loss (nanoGPT's
(logits, loss)), which Caravan then trains on. The module is traced in training mode
with torch.jit.trace, not scripted: Hugging Face models and nanoGPT under torch 2.x do not
script (torch.jit.script compiles every branch of their forward, and torch.fx's symbolic trace
stops at their data-dependent checks), while a trace records the operations one batch runs.
What a trace fixes, it fixes for good: the branches that batch took and the training flag (a
BatchNorm or dropout runs as in training, evaluation included). Caravan's loader then cuts the
traced forward into blocks at its repeated layers (src/models/graph_cut.h).

The module is called as model(x) and trained on its first output: a Tensor, the first element
of a tuple, or a Hugging Face output's logits. Given targets, it is called as model(x, targets)
and what it returns is kept (its Tensors): Caravan's loader finds the loss among them (the value
that reads the targets) and the output that loss reads. A Hugging Face model gets them as
labels=; its causal language models shift labels themselves, so with Caravan's next-token
targets their loss would be one token off: export those with an input alone. A Hugging Face model (transformers'
PreTrainedModel) is called with return_dict=False, and use_cache=False where it takes it. The
call goes through a one-attribute wrapper ("m"); the file says so (caravan/export.json,
names_prefix "m."), and Caravan exports the parameters under the module's own names, so its
model.pt loads into the user's class with load_state_dict(strict=True).

Checks before writing: parameters are float32, --blocks names submodules with children, the
traced forward gives the module's outputs bitwise on the example (training mode, both from the
same generator state; the module's buffers are put back afterwards, so the file holds the
factory's state). Exit codes: 0 written, 2 refused (one line on stderr; nothing written).

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

    factory = load_factory(args.factory)
    try:
        made = factory()
    except Exception as e:  # the user's code: said in one line
        fail(f"{args.factory}() fails: {type(e).__name__}: {e}")
    if not isinstance(made, tuple) or len(made) != 2 or not isinstance(made[0], nn.Module):
        fail(f"{args.factory} must return (module, example_input); it returned "
             f"{type(made).__name__}")
    model, example = made
    inputs = example if isinstance(example, tuple) else (example,)
    if not 1 <= len(inputs) <= 2 or not all(isinstance(t, torch.Tensor) for t in inputs):
        fail(f"{args.factory}: give the example input as one Tensor, or (input, targets) for a "
             "forward that returns its own loss")
    example = inputs[0]
    paths = [p.strip() for p in args.blocks.split(",")]
    if len(paths) > 1 and any(p in ("", "auto", "none") for p in paths):
        fail(f"--blocks {args.blocks}: give auto, none, or container paths, not a mix")
    for path in paths:
        if path in ("", "auto", "none"):
            continue
        try:
            sub = model.get_submodule(path)
        except AttributeError:
            sub = None
        if sub is None or not list(sub.children()):
            fail(f"--blocks names '{path}', which is no submodule with children of "
                 f"{type(model).__name__}; name an nn.Sequential or nn.ModuleList, or use auto")
    for name, p in model.named_parameters():
        if p.dtype != torch.float32:
            fail(f"parameter {name} is {p.dtype}; Caravan trains float32 parameters "
                 "(model.float() in the factory)")

    kwargs = {}
    # A Hugging Face model: its class came from transformers.modeling_utils, so that is loaded
    # by now. Not imported here: importing it takes ~4.5 s, twice the whole export of a small
    # module that is not one.
    hf = sys.modules.get("transformers.modeling_utils")
    if hf is not None and isinstance(model, hf.PreTrainedModel):
        kwargs["return_dict"] = False
        if "use_cache" in inspect.signature(model.forward).parameters:
            kwargs["use_cache"] = False

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

    class CalledWithTargets(nn.Module):
        """model(x, targets), its Tensors (the logits and the loss)."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, targets):
            # A Hugging Face model takes them as labels= (its second argument is a mask).
            out = self.m(x, labels=targets, **kwargs) if kwargs else self.m(x, targets)
            if isinstance(out, torch.Tensor):
                return out
            return tuple(t for t in out if isinstance(t, torch.Tensor))

    wrapper = (CalledWithTargets if len(inputs) == 2 else Called)(model).train()
    # Tracing and the check run the forward in training mode: BatchNorm's running statistics
    # move and dropout draws. The file keeps the factory's state, and the generator is left as
    # the factory left it.
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()

    def reset():
        with torch.no_grad():
            for name, b in model.named_buffers():
                b.copy_(buffers[name])
        torch.set_rng_state(rng)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python values it fixes
        try:
            traced = torch.jit.trace(wrapper, inputs, check_trace=False)
        except Exception as e:
            fail(f"torch.jit.trace of {args.factory} fails: {type(e).__name__}: "
                 f"{str(e).splitlines()[0] if str(e) else ''}")
    try:
        with torch.no_grad():
            reset()
            expected = wrapper(*inputs)
            reset()
            got = traced(*inputs)
    except Exception as e:
        fail(f"the traced forward of {args.factory} fails on the example: {type(e).__name__}: "
             f"{str(e).splitlines()[0] if str(e) else ''}")
    finally:
        reset()
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    if not expected or not all(isinstance(t, torch.Tensor) for t in expected + got):
        fail(f"{args.factory}: the model's output is not a Tensor")
    if len(got) != len(expected) or any(g.shape != e.shape or not torch.equal(g, e)
                                        for g, e in zip(got, expected)):
        fail(f"the traced forward of {args.factory} differs from the module's on the example "
             "(a branch on the data, or randomness in training mode?)")
    meta = {"names_prefix": "m.", "blocks": args.blocks, "traced_with": "torch.jit.trace",
            "torch": torch.__version__, "factory": args.factory,
            "example": {"shape": list(example.shape), "dtype": str(example.dtype)},
            "own_loss": len(inputs) == 2,
            # Buffers the module keeps out of its state_dict (rotary tables' inv_freq): the
            # file holds them, model.pt leaves them out, so it loads with strict=True.
            "non_persistent": sorted(set(n for n, _ in model.named_buffers())
                                     - set(model.state_dict().keys()))}
    try:
        traced.save(args.output, _extra_files={"caravan/export.json": json.dumps(meta)})
    except Exception as e:
        fail(f"cannot write {args.output}: {type(e).__name__}: {e}")
    parameters = sum(p.numel() for p in model.parameters())
    print(f"caravan export: wrote {args.output}: {type(model).__name__}, {parameters} "
          f"parameters, traced on input {list(example.shape)} {example.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
