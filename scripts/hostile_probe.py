#!/usr/bin/env python3
"""Hostile-input probe for the caravan binary: runs a few hundred commands that a careless or
unlucky user could type, each in its own temporary directory under a hard timeout, and reports
how each one ended.

    .venv/bin/python scripts/hostile_probe.py [--caravan build/caravan] [--only CLASS[,CLASS]]
                                              [--list] [--case ID_OR_PREFIX] [--strict] [--keep]
                                              [--json FILE]

For every case it records the exit code; whether it timed out (hang: the whole process tree is
killed), was killed by a signal (crash), printed "internal error", whether a failure's stderr is
one line starting "caravan: error:", and whether the files the case names (an existing run
directory, a source file, /dev/null by its stat type, the user's file given as an output) are
byte for byte and type for type as they were (data loss). A case declares its expectation (an
exit code, a set of them, "nonzero", or "any") and the runner reports mismatches.

Classes: output (files a command writes), model (TorchScript models), store (rendezvous stores,
restarts, duplicate ranks), data (data tokenize / data inspect / hostile data files), backend
(dist.backend, errors found only in workers), misc (issue 51's list).

It is a probe, not a test gate: it exits 0 however the cases end (1 with --strict when any case
lost data, hung, crashed or printed an internal error; 3 when the runner itself broke).
The probe uses Python's standard library only; the Python running it also writes the models,
so run it with the project's .venv/bin/python (torch 2.13, made by scripts/setup.sh). Every
process runs with OMP_NUM_THREADS=1 and train.threads = 1.

Adding a case: write a function `def fn(ctx)` that prepares files with ctx's helpers, registers
what must be preserved (ctx.preserve) and extra message checks (ctx.check), and returns the argv
to run (or runs a sequence itself and returns ctx.run(...)'s result); register it with
add(ID, CLASS, EXPECT, fn, timeout=..., desc=...).
"""
import argparse
import ctypes
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import zlib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_PYTHON = sys.executable  # writes the models: run the probe with .venv/bin/python
DEFAULT_TIMEOUT = 60.0
SETUP_FAILED_RC = 199  # a namespace wrapper's mount failed: the case could not be set up

# Environment variables that would make caravan a rank of some other job.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "CARAVAN_LAUNCHER", "CARAVAN_JOB_TOKEN", "CARAVAN_CHROMIUM")


# ------------------------------------------------------------------------------------------
# processes


def _set_subreaper():
    """Orphaned grandchildren (workers whose launcher was killed) become our children, so every
    process a case started can be found and ended."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:  # noqa: BLE001 - best effort; without it strays are still searched
        pass


def _proc_table():
    """{pid: (ppid, state)} of every process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                data = f.read().decode("latin-1")
        except OSError:
            continue
        rest = data[data.rfind(")") + 2:].split()
        if len(rest) < 2:
            continue
        table[int(name)] = (int(rest[1]), rest[0])
    return table


def descendants(root, live_only=True):
    table = _proc_table()
    children = {}
    for pid, (ppid, state) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            if not live_only or table[c][1] != "Z":
                out.append(c)
            todo.append(c)
    return out


def children_of(pid):
    return [p for p, (pp, st) in _proc_table().items() if pp == pid and st != "Z"]


def proc_environ(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    env = {}
    for item in raw.split(b"\0"):
        if b"=" in item:
            k, v = item.split(b"=", 1)
            env[k.decode("latin-1")] = v.decode("latin-1")
    return env


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def kill_tree(root_pid):
    """SIGKILL a process, its group and every descendant."""
    pids = descendants(root_pid)
    try:
        os.killpg(root_pid, signal.SIGKILL)
    except OSError:
        pass
    for p in [root_pid] + pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def kill_strays(grace=0.0):
    """Ends every live descendant of this runner (after `grace` seconds for them to end by
    themselves); returns how many there were."""
    deadline = time.time() + grace
    while True:
        reap()
        strays = descendants(os.getpid())
        if not strays or time.time() >= deadline:
            break
        time.sleep(0.1)
    for p in strays:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    t = time.time()
    while strays and time.time() - t < 3:
        reap()
        if not descendants(os.getpid()):
            break
        time.sleep(0.05)
    reap()
    return len(strays)


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Result:
    def __init__(self, rc=None, sig=None, timed_out=False, out="", err="", secs=0.0,
                 setup_failed=None):
        self.rc, self.sig, self.timed_out = rc, sig, timed_out
        self.out, self.err, self.secs = out, err, secs
        self.setup_failed = setup_failed

    @property
    def code_text(self):
        if self.setup_failed:
            return "setup"
        if self.timed_out:
            return "hang"
        if self.sig is not None:
            return f"sig{self.sig}"
        return str(self.rc)


# ------------------------------------------------------------------------------------------
# preservation: what a path is, to compare before and after


def _describe(path):
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ("absent",)
    except OSError as e:
        return ("unreadable", e.errno)
    m = st.st_mode
    if stat.S_ISLNK(m):
        return ("symlink", os.readlink(path))
    if stat.S_ISREG(m):
        h = hashlib.sha256()
        try:
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            return ("file-unreadable", e.errno)
        return ("file", st.st_size, h.hexdigest())
    if stat.S_ISDIR(m):
        return ("dir",)
    if stat.S_ISFIFO(m):
        return ("fifo",)
    if stat.S_ISCHR(m):
        return ("chardev", os.major(st.st_rdev), os.minor(st.st_rdev))
    if stat.S_ISBLK(m):
        return ("blockdev", os.major(st.st_rdev), os.minor(st.st_rdev))
    if stat.S_ISSOCK(m):
        return ("socket",)
    return ("other", m)


def snapshot(path):
    """{path: description} of `path` and, for a directory (not followed through links), of
    everything under it."""
    out = {path: _describe(path)}
    if out[path] == ("dir",):
        for dirpath, dirnames, filenames in os.walk(path):
            for n in dirnames + filenames:
                p = os.path.join(dirpath, n)
                out[p] = _describe(p)
    return out


def compare(before):
    """What changed: a list of 'PATH: was X, now Y' (new entries inside directories are not
    counted; an absent path that now exists is)."""
    changes = []
    for p, was in before.items():
        now = _describe(p)
        if now != was:
            def short(d):
                if d[0] == "file":
                    return f"file of {d[1]} bytes"
                return " ".join(str(x) for x in d)
            changes.append(f"{p}: was {short(was)}, now {short(now)}")
    return changes


DEV_NULL_RDEV = None


def check_dev_null():
    """/dev/null must stay the character device 1:3 for every later case (and the machine):
    when a case replaced it, put the device back and say so."""
    try:
        st = os.lstat("/dev/null")
        if stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (1, 3):
            return None
        what = " ".join(str(x) for x in _describe("/dev/null"))
    except FileNotFoundError:
        what = "absent"
    try:
        if os.path.lexists("/dev/null"):
            if os.path.isdir("/dev/null") and not os.path.islink("/dev/null"):
                shutil.rmtree("/dev/null")
            else:
                os.remove("/dev/null")
        os.mknod("/dev/null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        os.chmod("/dev/null", 0o666)
    except OSError as e:
        return f"/dev/null became {what} and could not be restored: {e}"
    return f"/dev/null became {what} (restored)"


# ------------------------------------------------------------------------------------------
# fixtures shared by cases (made once, on first use, copied into each case's directory)

BASE_CONFIG = """# hostile_probe.py: a tiny run on synthetic images
[data]
dataset = "synthetic"
synthetic_size = 64
batch_size = 8
eval_batch_size = 64

[model]
name = "mlp"

[train]
max_steps = 3
threads = 1
log_every = 1
eval_batches = 1

[checkpoint]
every = 0

[memory]
swap_dir = "{swap}"
"""

CLUSTER = """[cluster]
hosts = 4
link_mbit = 1000
cores_per_host = 2
memory_gib = 8
"""

# A bench result `caravan report` reads (format caravan-bench-1).
BENCH_JSON = json.dumps({
    "format": "caravan-bench-1", "name": "probe", "title": "probe bench",
    "charts": [{"id": "t", "title": "throughput", "type": "line", "x_label": "workers",
                "y_label": "samples/s", "log_x": False, "log_y": False,
                "series": [{"name": "a", "x": [1, 2], "y": [1.0, 2.0]}]}]}, indent=1) + "\n"

MODELS_SCRIPT = r'''
import os, sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from typing import Dict, List, Tuple

out = sys.argv[1]
torch.manual_seed(0)
failed = []


def save(name, make):
    try:
        make().save(os.path.join(out, name + ".pt"))
    except Exception as e:  # noqa
        failed.append("%s: %s" % (name, str(e).splitlines()[0] if str(e) else type(e).__name__))


def S(m):
    return lambda: torch.jit.script(m)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()
        self.fc1 = nn.Linear(784, 32)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flat(x))))


class Children(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.flat = nn.Flatten()
        self.head = nn.Linear(4 * 14 * 14, 10)

    def forward(self, x):
        return self.head(self.flat(self.features(x)))


class Layers(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))

    def forward(self, x):
        return self.layers(x)


class LayersScaled(Layers):
    def forward(self, x):
        return self.layers(x) * 2.0


class HeadLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()
        self.head = nn.Linear(784, 10)

    def forward(self, x):
        return self.head(self.flat(x))


class NoParams(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :10]


class OneLinear(nn.Module):
    """One Linear of a flattened image; the mistakes below change only its forward."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(784, 10)

    def forward(self, x):
        return self.l(x.flatten(1))


class Int64Out(OneLinear):
    def forward(self, x):
        return self.l(x.flatten(1)).long()


class Float64Out(OneLinear):
    def forward(self, x):
        return self.l(x.flatten(1)).double()


class TupleOut(OneLinear):
    def forward(self, x) -> Tuple[torch.Tensor, torch.Tensor]:
        y = self.l(x.flatten(1))
        return y, y


class DictOut(OneLinear):
    def forward(self, x) -> Dict[str, torch.Tensor]:
        return {"logits": self.l(x.flatten(1))}


class ListOut(OneLinear):
    def forward(self, x) -> List[torch.Tensor]:
        return [self.l(x.flatten(1))]


class ScalarOut(OneLinear):
    def forward(self, x):
        return self.l(x.flatten(1)).sum()


class NanOut(OneLinear):
    def forward(self, x):
        return self.l(x.flatten(1)) * float("nan")


class Raises(OneLinear):
    def forward(self, x):
        y = self.l(x.flatten(1))
        if bool(y.numel() > 0):
            raise RuntimeError("probe: this forward always fails")
        return y


class TwoInputs(OneLinear):
    def forward(self, x, y):
        return self.l(x.flatten(1)) + self.l(y.flatten(1))


class LossOk(Mlp):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)


class LossVector(Mlp):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target, reduction="none")


class LossOneArg(Mlp):
    @torch.jit.export
    def loss(self, output: torch.Tensor) -> torch.Tensor:
        return output.sum()


class LossString(Mlp):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> str:
        return "not a loss"


class LossInt(Mlp):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> int:
        return 1


class LossConstant(Mlp):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.tensor(1.0)


class LossRaises(Mlp):
    @torch.jit.export
    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if bool(output.numel() > 0):
            raise RuntimeError("probe: this loss always fails")
        return output.sum()


class DropoutBetween(Mlp):
    def forward(self, x):
        return self.fc2(F.dropout(self.act(self.fc1(self.flat(x))), 0.5, self.training))


class NotSequential(Mlp):
    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flat(x)))) * 0.5


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.flat = nn.Flatten()
        self.a = nn.Linear(784, 10)
        self.b = self.a

    def forward(self, x):
        return self.b(self.flat(x))


def seq(*mods):
    return nn.Sequential(*mods)


save("flatten_first", S(seq(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))))
save("paramfree_middle", S(seq(nn.Linear(28, 8), nn.Tanh(), nn.Identity(), nn.Flatten(),
                               nn.Linear(224, 10))))
save("paramfree_last", S(seq(nn.Flatten(), nn.Linear(784, 10), nn.Identity())))
save("children_flat_middle", S(Children()))
save("named_mlp", S(Mlp()))
save("traced_mlp", lambda: torch.jit.trace(Mlp(), torch.randn(2, 1, 28, 28)))
save("traced_sequential", lambda: torch.jit.trace(seq(nn.Flatten(), nn.Linear(784, 10)),
                                                  torch.randn(2, 1, 28, 28)))
save("layers", S(Layers()))
save("layers_scaled", S(LayersScaled()))
save("head_linear", S(HeadLinear()))
save("batchnorm_first", S(seq(nn.BatchNorm2d(1), nn.Flatten(), nn.Linear(784, 10))))
save("dropout_between", S(DropoutBetween()))
save("not_sequential", S(NotSequential()))


def fn(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1)[:, :10]


save("function", lambda: torch.jit.script(fn))
save("no_params", S(NoParams()))
save("empty_sequential", S(nn.Sequential()))
save("int64_out", S(Int64Out()))
save("float64_out", S(Float64Out()))
save("tuple_out", S(TupleOut()))
save("dict_out", S(DictOut()))
save("list_out", S(ListOut()))
save("scalar_out", S(ScalarOut()))
save("five_classes", S(seq(nn.Flatten(), nn.Linear(784, 5))))
save("wrong_width", S(seq(nn.Flatten(), nn.Linear(100, 10))))
save("nan_out", S(NanOut()))
nanw = seq(nn.Flatten(), nn.Linear(784, 10))
with torch.no_grad():
    nanw[1].weight.fill_(float("nan"))
save("nan_weights", S(nanw))
save("raises", S(Raises()))
save("two_inputs", S(TwoInputs()))
save("loss_ok", S(LossOk()))
save("loss_vector", S(LossVector()))
save("loss_one_arg", S(LossOneArg()))
save("loss_string", S(LossString()))
save("loss_int", S(LossInt()))
save("loss_constant", S(LossConstant()))
save("loss_raises", S(LossRaises()))
save("double", S(seq(nn.Flatten(), nn.Linear(784, 10)).double()))
save("half", S(seq(nn.Flatten(), nn.Linear(784, 10)).half()))
frozen = seq(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))
frozen[1].weight.requires_grad_(False)
frozen[1].bias.requires_grad_(False)
save("frozen_first", S(frozen))
allfrozen = seq(nn.Flatten(), nn.Linear(784, 10))
for p in allfrozen.parameters():
    p.requires_grad_(False)
save("all_frozen", S(allfrozen))
save("tied", S(Tied()))
try:
    torch.save(Mlp().state_dict(), os.path.join(out, "state_dict.pt"))
    torch.save(Mlp(), os.path.join(out, "pickled_module.pt"))
except Exception as e:  # noqa
    failed.append("torch.save: %s" % e)
for f in failed:
    print("model not written: " + f, file=sys.stderr)
'''


class Fixtures:
    """Things made once per probe run and copied into the cases' directories."""

    def __init__(self, probe):
        self.probe = probe
        self.root = os.path.join(probe.root, "_fixtures")
        os.makedirs(self.root, exist_ok=True)
        self._done = {}

    def _once(self, name, make):
        if name not in self._done:
            try:
                self._done[name] = (make(), None)
            except SetupError as e:
                self._done[name] = (None, str(e))
        value, error = self._done[name]
        if error:
            raise SetupError(f"fixture {name}: {error}")
        return value

    def _caravan(self, args, cwd, timeout=120):
        r = self.probe.run_plain([self.probe.caravan] + args, cwd, timeout)
        if r.timed_out or r.rc != 0:
            raise SetupError(f"caravan {' '.join(args[:2])} ended {r.code_text}: "
                             f"{last_line(r.err)}")
        return r

    def config(self):
        def make():
            path = os.path.join(self.root, "c.toml")
            with open(path, "w") as f:
                f.write(BASE_CONFIG.format(swap=self.root))
            return path
        return self._once("config", make)

    def run(self):
        """A finished run: config.toml, metrics.jsonl, checkpoints/step-2 and step-4, model.pt."""
        def make():
            d = os.path.join(self.root, "run")
            self._caravan(["train", "--config", self.config(), "--run-dir", d, "-q",
                           "--set", "train.max_steps=4", "--set", "checkpoint.every=2"], self.root)
            if not glob_ckpts(d):
                raise SetupError("the fixture run wrote no checkpoint")
            return d
        return self._once("run", make)

    def models(self):
        def make():
            d = os.path.join(self.root, "models")
            os.makedirs(d, exist_ok=True)
            if not os.path.exists(TORCH_PYTHON):
                raise SetupError(f"{TORCH_PYTHON} is missing (scripts/setup.sh installs it)")
            script = os.path.join(self.root, "make_models.py")
            with open(script, "w") as f:
                f.write(MODELS_SCRIPT)
            env = dict(os.environ, OMP_NUM_THREADS="1")
            p = subprocess.run([TORCH_PYTHON, script, d], capture_output=True, text=True,
                               timeout=300, env=env)
            if p.returncode != 0:
                raise SetupError(f"writing the models failed: {last_line(p.stderr)}")
            if p.stderr.strip():
                self.probe.note(p.stderr.strip())
            return d
        return self._once("models", make)

    def model(self, name):
        path = os.path.join(self.models(), name + ".pt")
        if not os.path.exists(path):
            raise SetupError(f"model {name}.pt was not written (see the models' notes)")
        return path

    def spm_model(self):
        """A SentencePiece model (tokenizer.model) trained by caravan data tokenize."""
        def make():
            d = os.path.join(self.root, "spm")
            text = os.path.join(self.root, "spm-input.txt")
            with open(text, "w") as f:
                f.write(english_text(3000, seed=7))
            self._caravan(["data", "tokenize", "--input", text, "--out", d, "--vocab-size", "100"],
                          self.root)
            return os.path.join(d, "tokenizer.model")
        return self._once("spm", make)

    def workload(self, model="cnn"):
        """The workload.json of `caravan simulate -o` for the base config with model.name."""
        def make():
            d = os.path.join(self.root, f"sim-{model}")
            cluster = os.path.join(self.root, "cluster.toml")
            with open(cluster, "w") as f:
                f.write(CLUSTER)
            self._caravan(["simulate", "-c", self.config(), "--set", f"model.name={model}",
                           "--cluster", cluster, "--workers", "2", "--steps", "5", "-o", d],
                          self.root)
            return os.path.join(d, "workload.json")
        return self._once(f"workload-{model}", make)


class SetupError(Exception):
    pass


def glob_ckpts(run_dir):
    d = os.path.join(run_dir, "checkpoints")
    try:
        return sorted(os.path.join(d, n) for n in os.listdir(d)
                      if re.fullmatch(r"step-\d+\.ckpt", n))
    except OSError:
        return []


def last_line(text):
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


WORDS = ("the of and to a in that is was he for it with as his on be at by i this had not are "
         "but from or have an they which one you were her all she there would their we him been "
         "has when who will more no if out so said what up its about into than them can only "
         "other new some could time these two may then do first any my now such like our over "
         "man me even most made after also did many before must through back years where much "
         "your way well down should because each just those people how too little state good "
         "very make world still own see men work long get here between both life being under "
         "never day same another know while last might us great old year off come since against "
         "go came right used take three").split()


def english_text(lines, seed=1):
    """Deterministic pseudo-English, `lines` lines."""
    x = seed * 2654435761 % (1 << 32) or 1
    out = []
    for _ in range(lines):
        n = 5 + x % 9
        words = []
        for _ in range(n):
            x = (x * 1103515245 + 12345) % (1 << 31)
            words.append(WORDS[(x >> 8) % len(WORDS)])
        out.append(" ".join(words).capitalize() + ".")
    return "\n".join(out) + "\n"


def npy(descr, shape, payload, fortran=False, header=None, version=(1, 0), magic=b"\x93NUMPY"):
    """A .npy file's bytes (NumPy's format, written by hand)."""
    if header is None:
        shape_text = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        header = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (
            descr, "True" if fortran else "False", shape_text)
    hb = header.encode("latin-1")
    length_size = 2 if version[0] == 1 else 4
    total = len(magic) + 2 + length_size + len(hb) + 1
    hb += b" " * ((64 - total % 64) % 64) + b"\n"
    length = struct.pack("<H" if length_size == 2 else "<I", len(hb))
    return magic + bytes(version) + length + hb + payload


def idx(dims, payload, dtype_code=8):
    header = bytes([0, 0, dtype_code, len(dims)])
    return header + b"".join(struct.pack(">I", d) for d in dims) + payload


def gz(data):
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    return c.compress(data) + c.flush()


# ------------------------------------------------------------------------------------------
# a case's context


class Ctx:
    def __init__(self, probe, case, directory):
        self.probe, self.case, self.dir = probe, case, directory
        self.fx = probe.fixtures
        self.caravan = probe.caravan
        self.env = {}
        self.ns = []          # shell commands run in a private mount namespace before caravan
        self.before = {}
        self.checks = []      # callables(result) -> problem text or None
        self.bg = []

    # paths and files
    def p(self, *rel):
        return os.path.join(self.dir, *rel)

    def write(self, rel, data, mode=None):
        path = self.p(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb" if isinstance(data, bytes) else "w") as f:
            f.write(data)
        if mode is not None:
            os.chmod(path, mode)
        return path

    def mkdir(self, rel, files=None):
        path = self.p(rel)
        os.makedirs(path, exist_ok=True)
        for name, data in (files or {}).items():
            self.write(os.path.join(rel, name), data)
        return path

    def fifo(self, rel):
        path = self.p(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkfifo(path)
        return path

    def symlink(self, target, rel):
        path = self.p(rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.symlink(target, path)
        return path

    def config(self, rel="c.toml", text=None):
        return self.write(rel, text if text is not None else BASE_CONFIG.format(swap=self.dir))

    def cluster(self, rel="cluster.toml", text=CLUSTER):
        return self.write(rel, text)

    def run_copy(self, rel="run"):
        dst = self.p(rel)
        shutil.copytree(self.fx.run(), dst, symlinks=True)
        return dst

    def model(self, name, rel=None):
        dst = self.p(rel or (name + ".pt"))
        shutil.copyfile(self.fx.model(name), dst)
        return dst

    def readonly(self, rel):
        """A directory the command sees read-only (a read-only bind mount in a private mount
        namespace: as root, permission bits would not stop it)."""
        path = self.mkdir(rel)
        q = shlex.quote(path)
        self.ns.append(f"mount --bind {q} {q} && mount -o remount,bind,ro {q}")
        return path

    # expectations
    def preserve(self, *paths):
        for path in paths:
            self.before.update(snapshot(path))

    def check(self, fn):
        self.checks.append(fn)

    def must_not_say(self, pattern, why):
        rx = re.compile(pattern, re.I)
        self.check(lambda r: f"{why} (says {rx.search(r.err).group(0)!r})"
                   if rx.search(r.err) else None)

    def must_say(self, pattern, why, when_failed=True):
        rx = re.compile(pattern, re.I)

        def fn(r):
            if when_failed and r.rc == 0:
                return None
            return None if rx.search(r.err + r.out) else why
        self.check(fn)

    # running
    def _env(self, extra=None):
        env = {k: v for k, v in os.environ.items()
               if k not in LAUNCHER_VARS and not k.startswith(("OMPI_", "SLURM_", "PMI"))}
        env.update(OMP_NUM_THREADS="1", TMPDIR=self.dir)
        env.update(self.env)
        env.update(extra or {})
        return env

    def _wrap(self, argv):
        if not self.ns:
            return argv
        script = " && ".join(self.ns)
        script = (f"{{ {script}; }} || {{ echo 'probe: namespace setup failed' >&2; "
                  f"exit {SETUP_FAILED_RC}; }}; exec \"$@\"")
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"] + list(argv)

    def spawn(self, argv, env=None, name=None):
        """Starts a background command (its own session); ended by the runner after the case."""
        name = name or f"bg{len(self.bg)}"
        io = self.p("_io")
        os.makedirs(io, exist_ok=True)
        out = open(os.path.join(io, name + ".out"), "wb")
        err = open(os.path.join(io, name + ".err"), "wb")
        p = subprocess.Popen(self._wrap(argv), cwd=self.dir, env=self._env(env), stdout=out,
                             stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()
        err.close()
        p.probe_name = name
        self.bg.append(p)
        return p

    def read_io(self, p):
        def rd(ext):
            try:
                with open(self.p("_io", p.probe_name + ext), "rb") as f:
                    return f.read().decode("utf-8", "replace")
            except OSError:
                return ""
        return rd(".out"), rd(".err")

    def wait(self, p, timeout):
        t0 = time.time()
        timed_out = False
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_tree(p.pid)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        out, err = self.read_io(p)
        rc, sig = p.returncode, None
        if rc is not None and rc < 0:
            rc, sig = None, -rc
        if rc == SETUP_FAILED_RC and "probe: namespace setup failed" in err:
            return Result(setup_failed="namespace: " + last_line(err))
        return Result(rc, sig, timed_out, out, err, time.time() - t0)

    def run(self, argv, timeout=None, env=None, name=None):
        p = self.spawn(argv, env, name or f"cmd{len(self.bg)}")
        return self.wait(p, timeout or self.case.timeout)

    def wait_for(self, predicate, timeout, proc=None):
        """Polls `predicate` every 50 ms; False after `timeout` s or when `proc` ended."""
        t0 = time.time()
        while time.time() - t0 < timeout:
            try:
                if predicate():
                    return True
            except OSError:
                pass
            if proc is not None and proc.poll() is not None:
                return bool(predicate())
            time.sleep(0.05)
        return False

    def cleanup(self):
        for p in self.bg:
            if p.poll() is None:
                kill_tree(p.pid)
        for p in self.bg:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    # caravan command lines
    def train(self, *sets, cfg=None, run="run", extra=(), quiet=True):
        argv = [self.caravan, "train", "--config", cfg or self.config()]
        if run is not None:
            argv += ["--run-dir", run if os.path.isabs(run) else self.p(run)]
        if quiet:
            argv.append("-q")
        for s in sets:
            argv += ["--set", s]
        return argv + list(extra)


def metrics_lines(run_dir):
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return sum(1 for ln in f if ln.strip())
    except OSError:
        return 0


# ------------------------------------------------------------------------------------------
# cases

CASES = []


class Case:
    def __init__(self, cid, cls, expect, fn, timeout, desc):
        self.id, self.cls, self.expect, self.fn = cid, cls, expect, fn
        self.timeout, self.desc = timeout, desc


def add(cid, cls, expect, fn, timeout=DEFAULT_TIMEOUT, desc=""):
    CASES.append(Case(cid, cls, expect, fn, timeout, desc))


def expect_text(e):
    if isinstance(e, tuple):
        return "|".join(str(x) for x in e)
    return str(e)


def expectation_met(expect, rc):
    if expect == "any":
        return True
    if expect == "nonzero":
        return rc != 0
    if isinstance(expect, tuple):
        return rc in expect
    return rc == expect


# ---- output targets ----------------------------------------------------------------------

USER_TEXT = "the user's own file: must survive\n"


def make_target(ctx, kind):
    """Prepares an output target of `kind` in the case's directory; registers what must be
    preserved; returns the path to pass."""
    if kind == "devnull":
        ctx.preserve("/dev/null")
        return "/dev/null"
    if kind == "fifo":
        path = ctx.fifo("out.fifo")
        ctx.preserve(path)
        return path
    if kind == "symlink-file":
        target = ctx.write("user.txt", USER_TEXT)
        link = ctx.symlink(target, "link-to-file")
        ctx.preserve(link, target)
        return link
    if kind == "symlink-dir":
        d = ctx.mkdir("userdir", {"keep.txt": USER_TEXT})
        link = ctx.symlink(d, "link-to-dir")
        ctx.preserve(link, d)
        return link
    if kind == "dir":
        d = ctx.mkdir("userdir", {"keep.txt": USER_TEXT})
        ctx.preserve(d)
        return d
    if kind == "file":
        path = ctx.write("user.txt", USER_TEXT)
        ctx.preserve(path)
        return path
    if kind.startswith("run-"):
        run = ctx.run_copy("target-run")
        ctx.preserve(run)
        what = kind[4:]
        if what == "dir":
            return run
        if what == "config":
            return os.path.join(run, "config.toml")
        if what == "metrics":
            return os.path.join(run, "metrics.jsonl")
        if what == "ckpt":
            return glob_ckpts(run)[-1]
        if what == "model":
            return os.path.join(run, "model.pt")
        if what == "checkpoints":
            return os.path.join(run, "checkpoints")
        raise ValueError(kind)
    if kind == "readonly":
        d = ctx.readonly("rodir")
        ctx.preserve(d)
        return os.path.join(d, "out")
    if kind == "missing-parent":
        ctx.preserve(ctx.p("nope"))
        return ctx.p("nope", "sub", "out")
    if kind == "missing-parent-ok":
        return ctx.p("nope", "sub", "out")
    if kind == "fresh":
        return ctx.p("fresh-out")
    raise ValueError(kind)


COMMON_TARGETS = ["devnull", "fifo", "symlink-file", "symlink-dir", "dir", "run-config",
                  "run-metrics", "run-ckpt", "run-model", "run-dir", "readonly", "missing-parent"]


def register_output_cases():
    # caravan report RUN -o X
    def report_o(kind):
        def fn(ctx):
            run = ctx.run_copy("run")
            ctx.preserve(run)
            out = make_target(ctx, kind)
            return [ctx.caravan, "report", run, "-o", out]
        return fn

    for kind in COMMON_TARGETS + ["run-checkpoints"]:
        add(f"out-report-{kind}", "output", "nonzero", report_o(kind),
            desc=f"caravan report RUN -o <{kind}>")

    def report_self_metrics(ctx):
        run = ctx.run_copy("run")
        ctx.preserve(run)
        return [ctx.caravan, "report", run, "-o", os.path.join(run, "metrics.jsonl")]
    add("out-report-source-metrics", "output", "nonzero", report_self_metrics,
        desc="caravan report RUN -o RUN/metrics.jsonl (its own input)")

    def report_bench_source(ctx):
        run = ctx.run_copy("run")
        bench = ctx.write("bench/charts.json", BENCH_JSON)
        ctx.preserve(run, bench)
        return [ctx.caravan, "report", run, bench, "-o", bench]
    add("out-report-source-bench", "output", "nonzero", report_bench_source,
        desc="caravan report RUN bench/charts.json -o bench/charts.json")

    def report_second_run(ctx):
        run = ctx.run_copy("run")
        run2 = ctx.run_copy("run2")
        ctx.preserve(run, run2)
        return [ctx.caravan, "report", run, run2, "-o", os.path.join(run2, "config.toml")]
    add("out-report-source-run2-config", "output", "nonzero", report_second_run,
        desc="caravan report RUN RUN2 -o RUN2/config.toml")

    def report_fresh(ctx):
        run = ctx.run_copy("run")
        ctx.preserve(run)
        return [ctx.caravan, "report", run, "-o", ctx.p("report.html")]
    add("out-report-fresh", "output", 0, report_fresh, desc="caravan report RUN -o new file")

    def report_in_run_html(ctx):
        run = ctx.run_copy("run")
        ctx.preserve(run)
        return [ctx.caravan, "report", run, "-o", os.path.join(run, "report.html")]
    add("out-report-run-html", "output", 0, report_in_run_html,
        desc="caravan report RUN -o RUN/report.html (allowed)")

    # caravan report --png DIR
    def report_png(kind):
        def fn(ctx):
            run = ctx.run_copy("run")
            ctx.preserve(run)
            out = make_target(ctx, kind)
            return [ctx.caravan, "report", run, "--png", out]
        return fn

    png_targets = ["devnull", "fifo", "symlink-file", "file", "run-config", "run-metrics",
                   "run-ckpt", "run-model", "run-dir", "readonly"]
    for kind in png_targets:
        add(f"out-png-{kind}", "output", "nonzero", report_png(kind), timeout=90,
            desc=f"caravan report RUN --png <{kind}>")
    add("out-png-symlink-dir", "output", "any", report_png("symlink-dir"), timeout=90,
        desc="caravan report RUN --png <link to a user's directory> (user's file kept)")
    add("out-png-missing-parent", "output", "any", report_png("missing-parent-ok"), timeout=90,
        desc="caravan report RUN --png <missing/parent/dir>")
    add("out-png-fresh", "output", 0, report_png("fresh"), timeout=90,
        desc="caravan report RUN --png new-dir")

    # caravan simulate ... -o DIR
    def simulate_o(kind):
        def fn(ctx):
            cfg, cluster = ctx.config(), ctx.cluster()
            ctx.preserve(cfg, cluster)
            if kind == "source-config":
                out = cfg
            elif kind == "source-cluster":
                out = cluster
            elif kind == "user-predictions":
                out = ctx.mkdir("mine", {"predictions.jsonl": USER_TEXT, "charts.json": USER_TEXT})
                ctx.preserve(out)
            else:
                out = make_target(ctx, kind)
            return [ctx.caravan, "simulate", "-c", cfg, "--cluster", cluster, "--workers", "2",
                    "--steps", "5", "-o", out]
        return fn

    sim_targets = ["devnull", "fifo", "symlink-file", "file", "run-config", "run-metrics",
                   "run-ckpt", "run-model", "run-dir", "readonly", "source-config",
                   "source-cluster", "user-predictions"]
    for kind in sim_targets:
        add(f"out-simulate-{kind}", "output", "nonzero", simulate_o(kind),
            desc=f"caravan simulate ... -o <{kind}>")
    add("out-simulate-symlink-dir", "output", "any", simulate_o("symlink-dir"),
        desc="caravan simulate -o <link to a user's directory> (user's file kept)")
    add("out-simulate-missing-parent", "output", "any", simulate_o("missing-parent-ok"),
        desc="caravan simulate -o <missing/parent/dir>")
    add("out-simulate-fresh", "output", 0, simulate_o("fresh"), desc="caravan simulate -o new dir")

    def simulate_workload_dir(ctx):
        cfg, cluster = ctx.config(), ctx.cluster()
        wdir = ctx.mkdir("w")
        shutil.copyfile(ctx.fx.workload("mlp"), os.path.join(wdir, "workload.json"))
        ctx.preserve(cfg, cluster, os.path.join(wdir, "workload.json"))
        return [ctx.caravan, "simulate", "-c", cfg, "--cluster", cluster, "--workers", "2",
                "--steps", "5", "--workload", os.path.join(wdir, "workload.json"), "-o", wdir]
    add("out-simulate-source-workload-dir", "output", "any", simulate_workload_dir,
        desc="caravan simulate --workload W/workload.json -o W (its input kept)")

    # caravan calibrate -o FILE (measures 256 MiB of disk each: few cases)
    def calibrate_o(kind):
        def fn(ctx):
            swap = ctx.mkdir("swap")
            if kind == "swap-dir":
                out = swap
                ctx.preserve(swap)
            else:
                out = make_target(ctx, kind)
            return [ctx.caravan, "calibrate", "--hosts", "2", "--link-mbit", "1000",
                    "--swap-dir", swap, "-o", out]
        return fn

    for kind in ["devnull", "fifo", "symlink-file", "dir", "run-config", "swap-dir", "readonly",
                 "missing-parent"]:
        add(f"out-calibrate-{kind}", "output", "nonzero", calibrate_o(kind), timeout=90,
            desc=f"caravan calibrate -o <{kind}>")
    add("out-calibrate-fresh", "output", 0, calibrate_o("fresh"), timeout=90,
        desc="caravan calibrate -o new file")

    # caravan data tokenize --input F --out DIR
    def tokenize_out(kind):
        def fn(ctx):
            text = ctx.write("in.txt", english_text(200))
            ctx.preserve(text)
            extra = ["--model", "bytes"]
            inputs = [text]
            if kind == "source-input":
                out = text
            elif kind == "input-named-train-bin":
                d = ctx.mkdir("d")
                inputs = [ctx.write("d/train.bin", english_text(200, seed=3))]
                ctx.preserve(inputs[0])
                out = d
            elif kind == "model-in-out":
                d = ctx.mkdir("d")
                m = os.path.join(d, "tokenizer.model")
                shutil.copyfile(ctx.fx.spm_model(), m)
                ctx.preserve(m)
                extra = ["--model", m]
                out = d
            elif kind == "dir-with-train-bin":
                out = ctx.mkdir("d", {"train.bin": USER_TEXT})
                ctx.preserve(out)
            elif kind == "dir-with-tokens-json":
                out = ctx.mkdir("d", {"tokens.json": USER_TEXT})
                ctx.preserve(out)
            elif kind == "symlink-dir-train-bin":
                d = ctx.mkdir("userdir", {"train.bin": USER_TEXT})
                out = ctx.symlink(d, "link-to-dir")
                ctx.preserve(out, d)
            elif kind == "dir-unrelated":
                out = ctx.mkdir("d", {"notes.txt": USER_TEXT})
                ctx.preserve(out)
            else:
                out = make_target(ctx, kind)
            argv = [ctx.caravan, "data", "tokenize"]
            for i in inputs:
                argv += ["--input", i]
            return argv + ["--out", out] + extra
        return fn

    tok_nonzero = ["devnull", "fifo", "symlink-file", "run-config", "run-ckpt", "run-model",
                   "run-dir", "readonly", "source-input", "input-named-train-bin",
                   "model-in-out", "dir-with-train-bin", "dir-with-tokens-json",
                   "symlink-dir-train-bin"]
    for kind in tok_nonzero:
        add(f"out-tokenize-{kind}", "output", "nonzero", tokenize_out(kind),
            desc=f"caravan data tokenize --out <{kind}>")
    add("out-tokenize-dir-unrelated", "output", 0, tokenize_out("dir-unrelated"),
        desc="caravan data tokenize --out <dir holding the user's notes.txt> (kept)")
    add("out-tokenize-missing-parent", "output", "any", tokenize_out("missing-parent-ok"),
        desc="caravan data tokenize --out <missing/parent/dir>")
    add("out-tokenize-fresh", "output", 0, tokenize_out("fresh"),
        desc="caravan data tokenize --out new dir")

    # caravan train --run-dir X
    def train_rundir(kind, workers=False):
        def fn(ctx):
            cfg = ctx.config()
            ctx.preserve(cfg)
            if kind == "source-config":
                out = cfg
            elif kind == "config-parent":
                out = ctx.dir  # the directory that holds c.toml (and nothing of a run)
            elif kind == "symlink-dir-empty":
                d = ctx.mkdir("emptydir")
                out = ctx.symlink(d, "link-to-empty")
                ctx.preserve(out)
            else:
                out = make_target(ctx, kind)
            extra = ["--workers", "2"] if workers else []
            return ctx.train(cfg=cfg, run=out, extra=extra)
        return fn

    for kind in ["devnull", "fifo", "symlink-file", "symlink-dir", "file", "dir", "run-config",
                 "run-metrics", "run-ckpt", "run-model", "run-dir", "readonly", "source-config",
                 "config-parent"]:
        add(f"out-train-{kind}", "output", "nonzero", train_rundir(kind),
            desc=f"caravan train --run-dir <{kind}>")
    add("out-train-symlink-dir-empty", "output", "any", train_rundir("symlink-dir-empty"),
        desc="caravan train --run-dir <link to an empty directory>")
    add("out-train-missing-parent", "output", 0, train_rundir("missing-parent-ok"),
        desc="caravan train --run-dir missing/parent/run (made, as runs/ is)")
    add("out-train-fresh", "output", 0, train_rundir("fresh"), desc="caravan train --run-dir new")
    for kind in ["devnull", "fifo", "file", "dir", "run-dir", "run-model"]:
        add(f"out-train-w2-{kind}", "output", "nonzero", train_rundir(kind, workers=True),
            timeout=90, desc=f"caravan train --workers 2 --run-dir <{kind}>")


# ---- TorchScript models ------------------------------------------------------------------


def register_model_cases():
    def ts(name, sets=(), extra=(), names_module=True, path_override=None):
        def fn(ctx):
            if path_override is not None:
                path = path_override(ctx)
            else:
                path = ctx.model(name)
            ctx.preserve(path)
            if names_module:
                base = re.escape(os.path.basename(path))
                ctx.must_say(base, "the message does not name the model file "
                             + os.path.basename(path))
            return ctx.train("model.name=torchscript", f"model.path={path}", *sets, extra=extra)
        return fn

    valid = [
        ("flatten_first", (), "nn.Sequential starting with nn.Flatten"),
        ("paramfree_middle", (), "nn.Sequential with parameter-free blocks in the middle"),
        ("paramfree_last", (), "nn.Sequential ending with nn.Identity"),
        ("children_flat_middle", (), "named children features/flat/head"),
        ("named_mlp", (), "named children, Flatten first"),
        ("traced_mlp", (), "torch.jit.trace'd MLP"),
        ("traced_sequential", (), "torch.jit.trace'd nn.Sequential"),
        ("layers", ("model.blocks=layers",), "model.blocks = layers"),
        ("batchnorm_first", (), "BatchNorm2d first"),
        ("dropout_between", (), "dropout between children (one block)"),
        ("not_sequential", (), "forward is not its children (one block)"),
        ("loss_ok", ("model.loss=module",), "a scripted loss method"),
        ("frozen_first", (), "first Linear frozen (requires_grad False)"),
    ]
    for name, sets, desc in valid:
        add(f"model-train-{name}", "model", 0, ts(name, sets, names_module=False),
            desc=f"trains: {desc}")

    for name, sets, desc in [
        ("flatten_first", ("memory.policy=recompute",), "recompute"),
        ("flatten_first", ("memory.policy=swap",), "swap to disk"),
        ("flatten_first", ("memory.policy=swap-input",), "swap-input"),
        ("flatten_first", ("memory.weights=offload",), "out-of-core weights"),
        ("flatten_first", ("memory.policy=auto", "memory.budget=64MiB"), "auto under a budget"),
        ("flatten_first", ("train.precision=bf16",), "bf16"),
        ("flatten_first", ("parallel.micro_batches=2",), "gradient accumulation"),
        ("paramfree_middle", ("memory.policy=recompute",), "recompute"),
        ("paramfree_middle", ("memory.weights=offload",), "out-of-core weights"),
        ("traced_mlp", ("memory.policy=swap",), "swap"),
    ]:
        tag = sets[0].split("=")[1].replace(",", "")
        add(f"model-train-{name}-{tag}", "model", 0, ts(name, sets, names_module=False),
            desc=f"trains: {name} with {desc}")
    add("model-train-flatten_first-w2", "model", 0,
        ts("flatten_first", (), ["--workers", "2"], names_module=False), timeout=90,
        desc="trains: flatten_first on 2 workers")
    add("model-train-flatten_first-pipeline", "model", 0,
        ts("flatten_first", ("parallel.pipeline_stages=2",), ["--workers", "2"],
           names_module=False), timeout=90,
        desc="trains: flatten_first as a 2-stage pipeline (parameter-free first block)")
    add("model-train-paramfree_middle-pipeline", "model", 0,
        ts("paramfree_middle", ("parallel.pipeline_stages=2",), ["--workers", "2"],
           names_module=False), timeout=90,
        desc="trains: paramfree_middle as a 2-stage pipeline")

    def plan(name, sets=()):
        def fn(ctx):
            path = ctx.model(name)
            argv = [ctx.caravan, "plan", "-c", ctx.config(), "--set", "model.name=torchscript",
                    "--set", f"model.path={path}"]
            for s in sets:
                argv += ["--set", s]
            return argv
        return fn

    def simulate(name):
        def fn(ctx):
            path = ctx.model(name)
            return [ctx.caravan, "simulate", "-c", ctx.config(), "--set", "model.name=torchscript",
                    "--set", f"model.path={path}", "--cluster", ctx.cluster(), "--workers", "2",
                    "--steps", "5"]
        return fn

    for name in ["flatten_first", "paramfree_middle", "traced_mlp", "named_mlp"]:
        add(f"model-plan-{name}", "model", 0, plan(name), desc=f"caravan plan on {name}")
        add(f"model-plan-budget-{name}", "model", 0,
            plan(name, ("memory.budget=64MiB", "memory.policy=auto")),
            desc=f"caravan plan under a budget on {name}")
        add(f"model-simulate-{name}", "model", 0, simulate(name),
            desc=f"caravan simulate on {name}")
    add("model-simulate-recommend-flatten_first", "model", 0,
        lambda ctx: simulate("flatten_first")(ctx) + ["--recommend"], timeout=120,
        desc="caravan simulate --recommend on flatten_first")

    mistakes = [
        ("function", (), 2, "a scripted function, not a module"),
        ("no_params", (), 2, "a module with no parameters"),
        ("empty_sequential", (), 2, "an empty nn.Sequential"),
        ("int64_out", (), 2, "forward returns int64"),
        ("tuple_out", (), 2, "forward returns a tuple"),
        ("dict_out", (), 2, "forward returns a dict"),
        ("list_out", (), 2, "forward returns a list"),
        ("scalar_out", (), 2, "forward returns a scalar"),
        ("five_classes", (), 2, "5 outputs for 10 classes"),
        ("wrong_width", (), 2, "first Linear expects 100 features, not 784"),
        ("raises", (), 2, "forward always raises"),
        ("two_inputs", (), 2, "forward takes two inputs"),
        ("flatten_first", ("model.loss=mse",), 2, "model.loss = mse with class-id targets"),
        ("flatten_first", ("model.loss=module",), 2, "model.loss = module without a loss method"),
        ("flatten_first", ("model.loss=hinge",), 2, "model.loss = an unknown loss"),
        ("loss_vector", ("model.loss=module",), 2, "loss returns a vector"),
        ("loss_one_arg", ("model.loss=module",), 2, "loss takes one argument"),
        ("loss_string", ("model.loss=module",), 2, "loss returns a string"),
        ("loss_int", ("model.loss=module",), 2, "loss returns an int"),
        ("loss_constant", ("model.loss=module",), 2, "loss is a constant (no gradient)"),
        ("loss_raises", ("model.loss=module",), 2, "loss always raises"),
        ("double", (), 2, "float64 parameters"),
        ("half", (), 2, "float16 parameters"),
        ("tied", (), 2, "one Linear under two names"),
        ("layers_scaled", ("model.blocks=layers",), 2, "model.blocks whose items are not forward"),
        ("head_linear", ("model.blocks=head",), 2, "model.blocks names an nn.Linear"),
        ("flatten_first", ("model.blocks=nope",), 2, "model.blocks names nothing"),
        ("all_frozen", (), 2, "every parameter frozen"),
    ]
    for name, sets, code, desc in mistakes:
        tag = name if not sets else f"{name}-{sets[0].split('=')[1]}"
        # A key's own mistake (an unknown loss, model.blocks) names the key, not the file.
        key_error = any(s.startswith("model.blocks=") or s == "model.loss=hinge" for s in sets)
        add(f"model-bad-{tag}", "model", code, ts(name, sets, names_module=not key_error),
            desc=desc)
    add("model-bad-nan_out", "model", 6, ts("nan_out", names_module=False),
        desc="forward makes NaN: non-finite loss")
    add("model-bad-nan_weights", "model", 6, ts("nan_weights", names_module=False),
        desc="NaN weights: non-finite loss")
    add("model-bad-one-block-pipeline", "model", 2,
        ts("not_sequential", ("parallel.pipeline_stages=2",), ["--workers", "2"],
           names_module=False), timeout=90,
        desc="a one-block module (forward is not its children) as a 2-stage pipeline")
    add("model-bad-float64_out", "model", (0, 2), ts("float64_out", names_module=False),
        desc="forward returns float64 (trains or refused)")

    def not_ts(kind):
        def path(ctx):
            if kind == "text":
                return ctx.write("m.pt", "this is not a model\n")
            if kind == "empty":
                return ctx.write("m.pt", b"")
            if kind == "truncated":
                data = open(ctx.fx.model("flatten_first"), "rb").read()
                return ctx.write("m.pt", data[: len(data) // 2])
            if kind == "garbage-zip":
                return ctx.write("m.pt", b"PK\x03\x04" + os.urandom(2000))
            if kind == "directory":
                return ctx.mkdir("m.pt")
            if kind == "fifo":
                return ctx.fifo("m.pt")
            if kind == "missing":
                return ctx.p("absent.pt")
            if kind == "symlink-loop":
                ctx.symlink("loop-b.pt", "loop-a.pt")
                ctx.symlink("loop-a.pt", "loop-b.pt")
                return ctx.p("loop-a.pt")
            if kind == "dev-zero":
                return "/dev/zero"
            if kind == "state-dict":
                return ctx.model("state_dict")
            if kind == "pickled-module":
                return ctx.model("pickled_module")
            if kind == "checkpoint":
                run = ctx.run_copy("src-run")
                return glob_ckpts(run)[-1]
            raise ValueError(kind)
        return path

    for kind in ["text", "empty", "truncated", "garbage-zip", "directory", "fifo", "missing",
                 "symlink-loop", "dev-zero", "state-dict", "pickled-module", "checkpoint"]:
        names = kind not in ("dev-zero",)
        add(f"model-file-{kind}", "model", 2,
            ts(None, names_module=names, path_override=not_ts(kind)), timeout=30,
            desc=f"model.path is {kind}")

    def no_path(ctx):
        return ctx.train("model.name=torchscript")
    add("model-file-no-path", "model", 2, no_path, desc="model.name = torchscript, no model.path")


# ---- stores and restarts -----------------------------------------------------------------


def register_store_cases():
    W2 = ["--workers", "2"]

    def store_path_case(make_path, expect_absent_parent=False):
        def fn(ctx):
            path = make_path(ctx)
            if path and os.path.lexists(path):
                ctx.preserve(path)
            if expect_absent_parent:
                ctx.preserve(os.path.dirname(path))
            return ctx.train("dist.store=file", f"dist.store_path={path}",
                             "fault.rendezvous_timeout=5", extra=W2)
        return fn

    add("store-file-fresh", "store", 0, store_path_case(lambda c: c.p("store")), timeout=90,
        desc="--workers 2, dist.store=file on a fresh path")
    add("store-file-default", "store", 0,
        lambda ctx: ctx.train("dist.store=file", extra=W2), timeout=90,
        desc="--workers 2, dist.store=file, store_path empty (RUN_DIR/rendezvous)")
    add("store-file-directory", "store", 2, store_path_case(lambda c: c.mkdir("storedir")),
        desc="store_path is a directory")
    add("store-file-fifo", "store", 2, store_path_case(lambda c: c.fifo("store.fifo")),
        timeout=30, desc="store_path is a FIFO")
    add("store-file-garbage", "store", 2,
        store_path_case(lambda c: c.write("store", os.urandom(333))), timeout=30,
        desc="store_path holds random bytes")
    add("store-file-huge-length", "store", 2,
        store_path_case(lambda c: c.write("store", struct.pack("<i", 0x7fffffff) + b"x" * 8)),
        timeout=30, desc="store_path holds a giant length field")
    add("store-file-text", "store", 2,
        store_path_case(lambda c: c.write("store", USER_TEXT)), timeout=30,
        desc="store_path is the user's text file (kept)")
    add("store-file-devnull", "store", "nonzero", store_path_case(lambda c: "/dev/null"),
        timeout=30, desc="store_path is /dev/null (kept a device)")
    add("store-file-config", "store", "nonzero",
        store_path_case(lambda c: c.config()), timeout=30,
        desc="store_path is the --config file (kept)")
    add("store-file-symlink", "store", "nonzero",
        store_path_case(lambda c: c.symlink(c.write("user.txt", USER_TEXT), "store-link")),
        timeout=30, desc="store_path is a symlink to the user's file (kept)")
    add("store-file-missing-dir", "store", "nonzero",
        store_path_case(lambda c: c.p("nodir", "store"), expect_absent_parent=True), timeout=30,
        desc="store_path in a missing directory")

    def ro_store(ctx):
        d = ctx.readonly("rodir")
        ctx.preserve(d)
        return ctx.train("dist.store=file", f"dist.store_path={d}/store",
                         "fault.rendezvous_timeout=5", extra=W2)
    add("store-file-readonly-dir", "store", "nonzero", ro_store, timeout=30,
        desc="store_path in a read-only directory")
    add("store-kind-bogus", "store", 2, lambda ctx: ctx.train("dist.store=etcd", extra=W2),
        desc="dist.store = etcd")
    add("store-file-single-process", "store", 0,
        lambda ctx: ctx.train("dist.store=file", f"dist.store_path={ctx.p('store')}"),
        desc="dist.store = file on one process (unused)")

    def killed_job(reuse):
        """A job on a file store killed with SIGKILL (launcher only) mid-run; then a new job
        (reuse == 'store': a new run dir on the same store path) or --resume of the run."""
        def fn(ctx):
            store = ctx.p("store")
            first = ctx.train("dist.store=file", f"dist.store_path={store}",
                              "train.max_steps=1000000", "checkpoint.every=5",
                              run="run1", extra=W2)
            p = ctx.spawn(first, name="first")
            if not ctx.wait_for(lambda: glob_ckpts(ctx.p("run1")), 60, p):
                return Result(setup_failed="the first job wrote no checkpoint: "
                              + last_line(ctx.read_io(p)[1]))
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
            strays = kill_strays(grace=20)  # the workers: PR_SET_PDEATHSIG, then a checkpoint
            if strays:
                ctx.check(lambda r, n=strays: f"{n} worker(s) still ran 20 s after the launcher "
                          "was killed")
            if reuse == "store":
                argv = ctx.train("dist.store=file", f"dist.store_path={store}",
                                 "fault.rendezvous_timeout=10", run="run2", extra=W2)
            else:
                argv = [ctx.caravan, "train", "--resume", ctx.p("run1"), "-q", "--workers", "2",
                        "--set", "train.max_steps=" + str(_last_step(ctx.p("run1")) + 3)]
            return ctx.run(argv, timeout=90, name="second")
        return fn

    add("store-file-after-kill9", "store", 0, killed_job("store"), timeout=150,
        desc="a new job on the store path of a job whose launcher was SIGKILLed")
    add("store-file-resume-after-kill9", "store", 0, killed_job("resume"), timeout=150,
        desc="--resume --workers 2 of a file-store job whose launcher was SIGKILLed")

    def killed_worker(rank, restarts, ckpt_first=True, mode=None, file_store=False, stop_at=0):
        def fn(ctx):
            sets = ["model.name=cnn", f"train.max_steps={1000000 if stop_at else 300}",
                    "checkpoint.every=10", "train.eval_batches=1"]
            if file_store:
                sets += ["dist.store=file", f"dist.store_path={ctx.p('store')}"]
            if mode:
                sets.append(f"sync.mode={mode}")
            extra = W2 + ["--max-restarts", str(restarts)]
            if stop_at:
                extra += ["--stop-at-step", str(stop_at)]
            p = ctx.spawn(ctx.train(*sets, extra=extra), name="job")
            if ckpt_first:
                ok = ctx.wait_for(lambda: glob_ckpts(ctx.p("run")), 60, p)
            else:
                ok = ctx.wait_for(lambda: metrics_lines(ctx.p("run")) > 0, 60, p)
            if not ok:
                out, err = ctx.read_io(p)
                return Result(setup_failed="the job did not get going: " + last_line(err))
            victims = [c for c in children_of(p.pid) if proc_environ(c).get("RANK") == str(rank)]
            if not victims:
                return Result(setup_failed=f"no worker with RANK={rank} under the launcher")
            for v in victims:
                os.kill(v, signal.SIGKILL)
            return ctx.wait(p, ctx.case.timeout)
        return fn

    add("store-restart-rank1", "store", 0, killed_worker(1, 1), timeout=180,
        desc="--max-restarts 1, worker rank 1 SIGKILLed mid-run: restarts and finishes")
    add("store-restart-rank0", "store", 0, killed_worker(0, 1), timeout=180,
        desc="--max-restarts 1, worker rank 0 SIGKILLed mid-run: restarts and finishes")
    add("store-restart-none", "store", 8, killed_worker(1, 0), timeout=180,
        desc="--max-restarts 0, a worker SIGKILLed: exit 8 naming it")
    add("store-restart-stop-at-step", "store", 0, killed_worker(1, 1, stop_at=200), timeout=90,
        desc="--max-restarts 1 --stop-at-step 200 (train.max_steps 1e6), rank 1 SIGKILLed: "
             "the restarted job still stops at step 200")
    add("store-restart-before-checkpoint", "store", 8, killed_worker(1, 1, ckpt_first=False),
        timeout=90, desc="--max-restarts 1, rank 1 SIGKILLed before the first checkpoint: 8, "
                         "not restarted, one line")
    add("store-restart-file-store", "store", 0, killed_worker(1, 1, file_store=True), timeout=180,
        desc="--max-restarts 1 on a file store (dist.store_path), rank 1 SIGKILLed mid-run")

    def dup_rank(store_kind, same_run_dir=False, second_rank=0, job_complete=True):
        """Ranks 0 and 1 of a job started by hand (external launcher variables); then another
        process with RANK=`second_rank`: it must be refused at once, told a job is running,
        and never advised to remove anything."""
        def fn(ctx):
            port = str(free_port())
            sets = ["train.max_steps=1000000", "fault.timeout=5", "fault.rendezvous_timeout=20"]
            if store_kind == "file":
                sets += ["dist.store=file", f"dist.store_path={ctx.p('store')}"]
            env = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            a = ctx.spawn(ctx.train(*sets, run="a"), dict(env, RANK="0"), name="rank0")
            if job_complete:
                ctx.spawn(ctx.train(*sets, run="b"), dict(env, RANK="1"), name="rank1")
                ok = ctx.wait_for(lambda: metrics_lines(ctx.p("a")) > 0, 60, a)
            else:
                ok = ctx.wait_for(lambda: os.path.exists(ctx.p("a")), 30, a)
                time.sleep(1.0)
            if not ok or a.poll() is not None:
                return Result(setup_failed="the first ranks did not start: "
                              + last_line(ctx.read_io(a)[1]))
            if os.path.exists(ctx.p("a", "config.toml")):
                ctx.preserve(ctx.p("a", "config.toml"))
            ctx.must_not_say(r"\bremove\b|\bdelete\b|\brm -|\bunlink\b",
                             "advises removing something while a job is running")
            ctx.must_say(r"running|in use|taken|already", "does not say a job is running")
            ctx.check(lambda r: None if a.poll() is None
                      else "the running job's rank 0 ended when the duplicate came")
            run = "a" if same_run_dir else "c"
            return ctx.run(ctx.train(*sets, run=run), timeout=40,
                           env=dict(env, RANK=str(second_rank)), name="dup")
        return fn

    add("store-dup-rank0-tcp", "store", 2, dup_rank("tcp"), timeout=120,
        desc="a second RANK=0 (tcp store, its own run dir) while the job runs")
    add("store-dup-rank0-tcp-same-dir", "store", 2, dup_rank("tcp", same_run_dir=True),
        timeout=120, desc="a second RANK=0 on the running rank 0's run dir")
    add("store-dup-rank0-file", "store", 2, dup_rank("file"), timeout=120,
        desc="a second RANK=0 on the same file store while the job runs")
    add("store-dup-rank1-file", "store", 2, dup_rank("file", second_rank=1), timeout=120,
        desc="a second RANK=1 on the same file store while the job runs")
    add("store-dup-rank0-tcp-waiting", "store", 2, dup_rank("tcp", job_complete=False),
        timeout=120, desc="a second RANK=0 while rank 0 waits for rank 1 at the rendezvous")
    add("store-dup-rank0-file-waiting", "store", 2, dup_rank("file", job_complete=False),
        timeout=120, desc="a second RANK=0 on a file store while rank 0 waits for rank 1")

    def bad_env(env):
        def fn(ctx):
            ctx.env.update(env)
            return ctx.train("fault.rendezvous_timeout=3")
        return fn

    for tag, env, expect in [
        ("rank-too-big", {"RANK": "2", "WORLD_SIZE": "2"}, 2),
        ("rank-negative", {"RANK": "-1", "WORLD_SIZE": "2"}, 2),
        ("world-zero", {"RANK": "0", "WORLD_SIZE": "0"}, 2),
        ("world-text", {"RANK": "0", "WORLD_SIZE": "two"}, 2),
        ("rank-only", {"RANK": "1"}, 2),
        ("port-too-big", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                          "MASTER_PORT": "99999"}, 2),
        ("port-text", {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "http"}, 2),
        ("addr-unresolvable", {"RANK": "1", "WORLD_SIZE": "2",
                               "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29500"},
         (2, 7)),
        ("workers-under-launcher", {"RANK": "0", "WORLD_SIZE": "2"}, 2),
    ]:
        fn = bad_env(env)
        if tag == "workers-under-launcher":
            fn = (lambda f: lambda ctx: f(ctx) + W2)(fn)
        add(f"store-env-{tag}", "store", expect, fn, timeout=30,
            desc=f"external launcher variables: {env}")

    for key, value in [("fault.rendezvous_timeout", "0"), ("fault.rendezvous_timeout", "-1"),
                       ("fault.rendezvous_timeout", "nan"), ("fault.timeout", "inf"),
                       ("fault.timeout", "1e300")]:
        add(f"store-{key.split('.')[1]}-{value}", "store", 2,
            (lambda k, v: lambda ctx: ctx.train(f"{k}={v}", extra=W2))(key, value), timeout=30,
            desc=f"--workers 2 with {key} = {value}")


def _last_step(run_dir):
    steps = [int(re.search(r"(\d+)", os.path.basename(c)).group(1)) for c in glob_ckpts(run_dir)]
    return max(steps) if steps else 0


# ---- data commands -----------------------------------------------------------------------


def register_data_cases():
    def tokenize(make_args, preserve_input=True):
        def fn(ctx):
            text = ctx.write("in.txt", english_text(400))
            if preserve_input:
                ctx.preserve(text)
            return [ctx.caravan, "data", "tokenize"] + make_args(ctx, text)
        return fn

    for value in ["0", "-1", "1", "2", "7", "2000000000", "2147483648", "1e18",
                  "99999999999999999999", "abc", "", "3.5", "0x10", "nan"]:
        tag = value if value else "empty"
        # More pieces than the text has characters: 3, as SentencePiece's own "too many".
        expect = (2, 3) if value == "0x10" else 3 if value == "2000000000" else 2
        add(f"data-tok-vocab-{tag}", "data", expect,
            tokenize(lambda c, t, v=value: ["--input", t, "--out", c.p("o"), "--vocab-size", v]),
            timeout=30, desc=f"data tokenize --vocab-size '{value}'")
    add("data-tok-vocab-100", "data", 0,
        tokenize(lambda c, t: ["--input", t, "--out", c.p("o"), "--vocab-size", "100"]),
        timeout=30, desc="data tokenize --vocab-size 100 (works)")
    for value in ["-0.1", "0", "1", "1.5", "nan", "inf", "abc", "1e-300"]:
        add(f"data-tok-valfrac-{value}", "data", "any" if value == "1e-300" else 2,
            tokenize(lambda c, t, v=value: ["--input", t, "--out", c.p("o"), "--model", "bytes",
                                            "--val-fraction", v]),
            timeout=30, desc=f"data tokenize --val-fraction {value}")

    def tok_input(make_input, vocab=None, model="bytes"):
        def fn(ctx):
            inp = make_input(ctx)
            if isinstance(inp, str) and os.path.lexists(inp):
                ctx.preserve(inp)
            extra = ["--vocab-size", vocab] if vocab else ["--model", model]
            return [ctx.caravan, "data", "tokenize", "--input", inp, "--out", ctx.p("o")] + extra
        return fn

    inputs = [
        ("empty", lambda c: c.write("in.txt", b""), 3),
        ("binary", lambda c: c.write("in.txt", bytes(range(256)) * 40), "any"),
        ("nul-bytes", lambda c: c.write("in.txt", b"hello\x00world\n" * 50), "any"),
        ("invalid-utf8", lambda c: c.write("in.txt", b"caf\xe9 au lait\n" * 50), "any"),
        ("fifo", lambda c: c.fifo("in.txt"), "nonzero"),
        ("directory", lambda c: c.mkdir("in.txt"), "nonzero"),
        ("missing", lambda c: c.p("absent.txt"), "nonzero"),
        ("dev-null", lambda c: "/dev/null", "nonzero"),
        ("dev-zero", lambda c: "/dev/zero", "nonzero"),
        ("symlink-loop", lambda c: (c.symlink("b.txt", "a.txt"), c.symlink("a.txt", "b.txt"),
                                    c.p("a.txt"))[2], "nonzero"),
        ("only-newlines", lambda c: c.write("in.txt", "\n" * 1000), "any"),
        ("one-line-no-newline", lambda c: c.write("in.txt", "just one line"), "any"),
    ]
    for tag, make, expect in inputs:
        add(f"data-tok-input-{tag}", "data", expect, tok_input(make), timeout=20,
            desc=f"data tokenize --model bytes --input <{tag}>")
    for tag, make, expect in [
        ("empty", lambda c: c.write("in.txt", b""), 3),
        ("binary", lambda c: c.write("in.txt", bytes(range(256)) * 40), 3),
        ("nul-bytes", lambda c: c.write("in.txt", b"hello\x00world\n" * 200), 3),
        ("invalid-utf8", lambda c: c.write("in.txt", b"caf\xe9 au lait\n" * 200), 3),
        ("only-newlines", lambda c: c.write("in.txt", "\n" * 1000), 3),
        ("tiny-vocab-2000", lambda c: c.write("in.txt", "a tiny text.\nof two lines.\n"), "any"),
        ("tiny-vocab-8", lambda c: c.write("in.txt", "ab\n"), "any"),
        ("small-vocab-30000", lambda c: c.write("in.txt", english_text(50)), "any"),
        ("long-line", lambda c: c.write("in.txt", ("word " * 400000) + "\n"), "any"),
    ]:
        vocab = {"tiny-vocab-8": "8", "small-vocab-30000": "30000", "nul-bytes": "50",
                 "invalid-utf8": "50", "only-newlines": "50"}.get(tag, "2000")
        add(f"data-tok-train-{tag}", "data", expect, tok_input(make, vocab=vocab), timeout=20,
            desc=f"data tokenize --vocab-size {vocab} --input <{tag}> (no hang)")

    def tok_model(make_model):
        def fn(ctx):
            text = ctx.write("in.txt", english_text(100))
            m = make_model(ctx)
            if os.path.lexists(m):
                ctx.preserve(m)
            return [ctx.caravan, "data", "tokenize", "--input", text, "--out", ctx.p("o"),
                    "--model", m]
        return fn

    for tag, make, expect in [
        ("missing", lambda c: c.p("absent.model"), "nonzero"),
        ("text", lambda c: c.write("t.model", USER_TEXT), "nonzero"),
        ("empty", lambda c: c.write("t.model", b""), "nonzero"),
        ("directory", lambda c: c.mkdir("t.model"), "nonzero"),
        ("fifo", lambda c: c.fifo("t.model"), "nonzero"),
        ("torchscript", lambda c: c.model("flatten_first", "t.model"), "nonzero"),
        ("truncated", lambda c: c.write("t.model", open(c.fx.spm_model(), "rb").read()[:200]),
         "nonzero"),
        ("spm-ok", lambda c: c.fx.spm_model(), 0),
    ]:
        add(f"data-tok-model-{tag}", "data", expect, tok_model(make), timeout=20,
            desc=f"data tokenize --model <{tag}>")
    add("data-tok-no-out", "data", 2,
        lambda ctx: [ctx.caravan, "data", "tokenize", "--input", ctx.write("in.txt", "x\n")],
        desc="data tokenize without --out")
    add("data-tok-no-input", "data", 2,
        lambda ctx: [ctx.caravan, "data", "tokenize", "--out", ctx.p("o")],
        desc="data tokenize without --input")

    # caravan data inspect
    def inspect(make, dtype=None):
        def fn(ctx):
            path = make(ctx)
            if os.path.lexists(path):
                ctx.preserve(path)
            argv = [ctx.caravan, "data", "inspect", path]
            if dtype is not None:
                argv += ["--token-dtype", dtype]
            return argv
        return fn

    f32 = b"\0" * 4 * 12
    ins = [
        ("fifo-npy", lambda c: c.fifo("x.npy"), "nonzero"),
        ("fifo-bin", lambda c: c.fifo("x.bin"), "nonzero"),
        ("fifo-idx", lambda c: c.fifo("train-images-idx3-ubyte"), "nonzero"),
        ("fifo-noext", lambda c: c.fifo("x"), "nonzero"),
        ("dir-with-fifo", lambda c: (c.fifo("d/train.bin"), c.fifo("d/x.npy"), c.p("d"))[2],
         "any"),
        ("dir-with-fifo-and-file", lambda c: (c.fifo("d/a.npy"),
                                              c.write("d/b.npy", npy("<f4", (3, 4), f32)),
                                              c.p("d"))[2], "any"),
        ("empty-dir", lambda c: c.mkdir("d"), "nonzero"),
        ("dir-with-subdir-loop", lambda c: (c.mkdir("d"), c.symlink(".", "d/loop.npy"),
                                            c.p("d"))[2], "any"),
        ("symlink-loop", lambda c: (c.symlink("b.npy", "a.npy"), c.symlink("a.npy", "b.npy"),
                                    c.p("a.npy"))[2], "nonzero"),
        ("dev-zero-link", lambda c: c.symlink("/dev/zero", "zero.bin"), "nonzero"),
        ("dev-null", lambda c: "/dev/null", "nonzero"),
        ("missing", lambda c: c.p("absent.npy"), "nonzero"),
        ("npy-bad-magic", lambda c: c.write("x.npy", b"NOTNUMPY" + b"\0" * 100), 3),
        ("npy-truncated-header", lambda c: c.write("x.npy", npy("<f4", (3, 4), f32)[:20]), 3),
        ("npy-truncated-payload", lambda c: c.write("x.npy", npy("<f4", (3, 4), f32[:10])), 3),
        ("npy-huge-shape", lambda c: c.write("x.npy", npy("<f4", (2 ** 40, 2 ** 30), f32)), 3),
        ("npy-negative-shape", lambda c: c.write("x.npy", npy("<f4", (-3, 4), f32)), 3),
        ("npy-object", lambda c: c.write("x.npy", npy("|O", (3,), b"\0" * 24)), 3),
        ("npy-fortran", lambda c: c.write("x.npy", npy("<f4", (3, 4), f32, fortran=True)), 3),
        ("npy-bigendian", lambda c: c.write("x.npy", npy(">f4", (3, 4), f32)), 3),
        ("npy-header-garbage", lambda c: c.write("x.npy", npy("", (), f32, header="{{{{((")),
         3),
        ("npy-header-len-huge", lambda c: c.write("x.npy", b"\x93NUMPY\x02\x00\xff\xff\xff\x7f"
                                                  + b"{" * 64), 3),
        ("npy-version-9", lambda c: c.write("x.npy", npy("<f4", (3, 4), f32, version=(9, 0))),
         3),
        ("idx-bad-magic", lambda c: c.write("t-images-idx3-ubyte", b"\1\2\3\4" + b"\0" * 64),
         3),
        ("idx-huge-dims", lambda c: c.write("t-images-idx3-ubyte",
                                            idx([0xffffffff, 0xffffffff, 0xffffffff], b"\0")), 3),
        ("idx-truncated", lambda c: c.write("t-labels-idx1-ubyte", idx([100], b"\0" * 10)), 3),
        ("idx-zero-dims", lambda c: c.write("t-labels-idx1-ubyte", bytes([0, 0, 8, 0])), 3),
        ("idx-gz-corrupt", lambda c: c.write("t-labels-idx1-ubyte.gz",
                                             gz(idx([50], b"\1" * 50))[:30]), 3),
        ("idx-gz-not-gz", lambda c: c.write("t-labels-idx1-ubyte.gz", b"plain bytes"), 3),
        ("idx-gz-bomb-dims", lambda c: c.write("t-images-idx3-ubyte.gz",
                                               gz(idx([60000, 28, 28], b"\0" * 100))), 3),
        ("bin-odd-length", lambda c: c.write("x.bin", b"\1\0\2\0\3"), 3),
        ("bin-empty", lambda c: c.write("x.bin", b""), "any"),
        ("bin-tokens-json-garbage", lambda c: (c.write("d/tokens.json", "{{{not json"),
                                               c.write("d/x.bin", b"\1\0\2\0"),
                                               c.p("d", "x.bin"))[2], "any"),
        ("bin-tokens-json-dtype-bogus", lambda c: (c.write("d/tokens.json",
                                                           '{"token_dtype": "float128"}'),
                                                   c.write("d/x.bin", b"\1\0\2\0"),
                                                   c.p("d", "x.bin"))[2], "any"),
        ("bin-tokens-json-fifo", lambda c: (c.fifo("d/tokens.json"),
                                            c.write("d/x.bin", b"\1\0\2\0"),
                                            c.p("d", "x.bin"))[2], "any"),
        ("txt-binary", lambda c: c.write("x.txt", bytes(range(256))), "any"),
        ("unknown-ext", lambda c: c.write("x.csv", "a,b\n1,2\n"), "nonzero"),
    ]
    for tag, make, expect in ins:
        add(f"data-inspect-{tag}", "data", expect, inspect(make), timeout=20,
            desc=f"data inspect <{tag}>")
    add("data-inspect-dtype-bogus", "data", 2,
        inspect(lambda c: c.write("x.bin", b"\1\0"), dtype="int8"), timeout=20,
        desc="data inspect --token-dtype int8")
    add("data-inspect-uint32-odd", "data", 3,
        inspect(lambda c: c.write("x.bin", b"\1\0\0\0\2\0"), dtype="uint32"), timeout=20,
        desc="data inspect --token-dtype uint32 on 6 bytes")

    # hostile data files under training
    def train_data(dataset, make_dir, sets=()):
        def fn(ctx):
            d = make_dir(ctx)
            ctx.preserve(d)
            return ctx.train(f"data.dataset={dataset}", f"data.path={d}", *sets)
        return fn

    def npy_dir(ctx, fifo=None, labels=None):
        d = ctx.mkdir("npy")
        x = npy("<f4", (16, 1, 4, 4), b"\0" * 4 * 16 * 16)
        y = labels if labels is not None else npy("<i8", (16,), struct.pack("<16q", *range(16)))
        for split in ("train", "test"):
            for name, data in ((f"{split}_inputs.npy", x), (f"{split}_targets.npy", y)):
                if fifo == name:
                    ctx.fifo(os.path.join("npy", name))
                else:
                    ctx.write(os.path.join("npy", name), data)
        return d

    add("data-train-npy-fifo", "data", 3,
        train_data("npy", lambda c: npy_dir(c, fifo="train_inputs.npy")), timeout=30,
        desc="npy dataset whose train_inputs.npy is a FIFO")
    add("data-train-tokens-fifo", "data", 3,
        train_data("tokens", lambda c: (c.fifo("tok/train.bin"),
                                        c.write("tok/val.bin", b"\1\0" * 100), c.p("tok"))[2],
                   ("data.vocab_size=16", "model.name=gpt", "data.seq_len=8")), timeout=30,
        desc="tokens dataset whose train.bin is a FIFO")
    add("data-train-tokens-id-too-big", "data", 3,
        train_data("tokens", lambda c: (c.write("tok/train.bin", b"\x63\0" * 200),
                                        c.write("tok/val.bin", b"\1\0" * 200), c.p("tok"))[2],
                   ("data.vocab_size=16", "model.name=gpt", "data.seq_len=8")), timeout=30,
        desc="tokens dataset with id 99 >= vocab_size 16")
    add("data-train-text-binary", "data", "any",
        train_data("text", lambda c: (c.write("txt/train.txt", bytes(range(256)) * 20),
                                      c.write("txt/val.txt", bytes(range(256)) * 4),
                                      c.p("txt"))[2], ("model.name=gpt", "data.seq_len=8")),
        timeout=30, desc="text dataset of binary bytes (bytes are tokens: may train)")
    add("data-train-idx-fifo", "data", 3,
        train_data("idx", lambda c: (c.fifo("idx/train-images-idx3-ubyte"), c.p("idx"))[1]),
        timeout=30, desc="idx dataset whose images file is a FIFO")
    add("data-train-path-devnull", "data", 3,
        lambda ctx: ctx.train("data.dataset=npy", "data.path=/dev/null"), timeout=30,
        desc="data.path = /dev/null")
    add("data-train-path-loop", "data", 3,
        lambda ctx: (ctx.symlink("l2", "l1"), ctx.symlink("l1", "l2"),
                     ctx.train("data.dataset=tokens", f"data.path={ctx.p('l1')}",
                               "data.vocab_size=16", "model.name=gpt"))[2], timeout=30,
        desc="data.path is a symlink loop")


# ---- backends ----------------------------------------------------------------------------


def register_backend_cases():
    W2 = ["--workers", "2"]
    for backend, expect in [("auto", 0), ("shm", 0), ("gloo", 0), ("mpi", (0, 2)),
                            ("nccl", 2), ("", 2), ("GLOO", 2), ("shm ", 2), ("tcp", 2)]:
        tag = backend.strip() + ("-space" if backend.endswith(" ") else "") if backend else "empty"
        add(f"backend-w2-{tag}", "backend", expect,
            (lambda b: lambda ctx: ctx.train(f"dist.backend={b}", extra=W2))(backend),
            timeout=90, desc=f"--workers 2, dist.backend = '{backend}'")
    add("backend-single-shm", "backend", 0, lambda ctx: ctx.train("dist.backend=shm"),
        desc="one process, dist.backend = shm")

    def with_shm(mount, backend, quiet=True):
        def fn(ctx):
            ctx.ns.append(mount)
            if backend == "auto" and not quiet:
                ctx.must_say(r"gloo", "does not say it falls back to gloo", when_failed=False)
            return ctx.train(f"dist.backend={backend}", quiet=quiet, extra=W2)
        return fn

    ro = "mount -t tmpfs -o ro,size=1k tmpfs /dev/shm"
    tiny = "mount -t tmpfs -o size=8k tmpfs /dev/shm"
    gone = "mount -t tmpfs -o size=1k tmpfs /dev/shm && chmod 000 /dev/shm && " \
           "mount -o remount,ro /dev/shm"
    add("backend-shm-ro-auto", "backend", 0, with_shm(ro, "auto", quiet=False), timeout=90,
        desc="auto with a read-only /dev/shm: falls back to gloo saying so in one line")
    add("backend-shm-ro-auto-quiet", "backend", 0, with_shm(ro, "auto"), timeout=90,
        desc="auto with a read-only /dev/shm, -q")
    add("backend-shm-ro-shm", "backend", "nonzero", with_shm(ro, "shm"), timeout=90,
        desc="dist.backend = shm with a read-only /dev/shm: one line")
    add("backend-shm-ro-gloo", "backend", 0, with_shm(ro, "gloo"), timeout=90,
        desc="dist.backend = gloo with a read-only /dev/shm (not needed)")
    add("backend-shm-tiny-auto", "backend", "any", with_shm(tiny, "auto", quiet=False),
        timeout=90, desc="auto with an 8 KiB /dev/shm (full: no SIGBUS)")
    add("backend-shm-tiny-shm", "backend", "any", with_shm(tiny, "shm"), timeout=90,
        desc="dist.backend = shm with an 8 KiB /dev/shm (full: no SIGBUS)")
    add("backend-shm-ro-auto-pipeline", "backend", 0,
        (lambda f: lambda ctx: f(ctx) + ["--set", "parallel.pipeline_stages=2"])(
            with_shm(ro, "auto")), timeout=90,
        desc="auto with a read-only /dev/shm, 2-stage pipeline")
    add("backend-shm-ro-auto-ps", "backend", 0,
        (lambda f: lambda ctx: f(ctx) + ["--set", "sync.mode=ps-bsp"])(with_shm(ro, "auto")),
        timeout=90, desc="auto with a read-only /dev/shm, ps-bsp")
    add("backend-shm-noperm-auto", "backend", 0, with_shm(gone, "auto"), timeout=90,
        desc="auto with a /dev/shm of mode 000, read-only")

    for value in ["0", "-1", "1000000", "abc"]:
        add(f"backend-connections-{value}", "backend", 2,
            (lambda v: lambda ctx: ctx.train(f"dist.connections={v}", "dist.backend=gloo",
                                             extra=W2))(value), timeout=60,
            desc=f"dist.connections = {value}")

    # config errors only found in the workers: exit 2, not 8
    for tag, sets, expect in [
        ("partition-99", ("parallel.pipeline_stages=2", "parallel.partition=99"), 2),
        ("partition-0", ("parallel.pipeline_stages=2", "parallel.partition=0"), 2),
        ("partition-text", ("parallel.pipeline_stages=2", "parallel.partition=abc"), 2),
        ("partition-two-cuts", ("parallel.pipeline_stages=2", "parallel.partition=1,2"), 2),
        ("pipeline-budget-tiny", ("parallel.pipeline_stages=2", "memory.budget=4KiB"), 2),
        ("pipeline-auto-budget-tiny", ("parallel.pipeline_stages=2", "memory.budget=4KiB",
                                       "memory.policy=auto"), 2),
        ("budget-tiny", ("memory.budget=1KiB",), 2),
        ("budget-tiny-auto", ("memory.budget=1KiB", "memory.policy=auto"), 2),
        ("budget-tiny-offload", ("memory.budget=1KiB", "memory.weights=offload"), 2),
        ("micro-batches-3", ("parallel.pipeline_stages=2", "parallel.micro_batches=3"), 2),
        ("policy-list-wrong-length", ("memory.policy=keep,keep,keep,keep,keep,keep,keep",), 2),
        ("swap-dir-missing", ("memory.policy=swap", "memory.swap_dir=/nonexistent/probe"),
         (2, 5)),
        ("swap-dir-tmpfs", ("memory.policy=swap", "memory.swap_dir=/dev/shm"), 2),
    ]:
        add(f"backend-worker-{tag}", "backend", expect,
            (lambda s: lambda ctx: ctx.train(*s, extra=W2))(sets), timeout=90,
            desc=f"--workers 2 with {', '.join(sets)}: refused with 2, not 8")


# ---- misc (issue 51) ---------------------------------------------------------------------

SIZE_RX = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]iB|B)\b")


def register_misc_cases():
    W2 = ["--workers", "2"]

    def budget(value, model="mlp", workers=False):
        def fn(ctx):
            argv = ctx.train("memory.policy=auto", f"memory.budget={value}", f"model.name={model}",
                             extra=W2 if workers else ())

            def check(r):
                problems = []
                for m in re.finditer(r"(\S*memory_plan\.txt)", r.err):
                    name = m.group(1).strip("'\"`(),;")
                    cand = name if os.path.isabs(name) else ctx.p("run", "memory_plan.txt")
                    if not os.path.exists(cand):
                        problems.append(f"names {name}, which does not exist")
                if r.rc not in (0, None):
                    tail = r.err.split("smallest", 1)[-1]
                    sizes = SIZE_RX.findall(tail)
                    exact = re.search(r"\((\d+) bytes\)", tail)
                    if not sizes and not exact:
                        problems.append("names no budget that works")
                        return "; ".join(problems)

                    def works(budget_text, tag):
                        again = ctx.run(ctx.train("memory.policy=auto",
                                                  f"memory.budget={budget_text}",
                                                  f"model.name={model}", run=f"run-{tag}",
                                                  extra=W2 if workers else ()),
                                        timeout=90, name=tag)
                        return again
                    if sizes:
                        shown = "".join(sizes[0])
                        a = works(shown, "again-shown")
                        if a.timed_out or a.rc != 0:
                            msg = f"the budget it shows ({shown}) does not work"
                            if exact:
                                b = works(exact.group(1) + "B", "again-bytes")
                                msg += (" (its byte count does)" if b.rc == 0 else
                                        f", nor its byte count: {b.code_text} {last_line(b.err)}")
                            problems.append(msg)
                return "; ".join(problems) or None
            ctx.check(check)
            return argv
        return fn

    for value, model, workers in [("1.5MiB", "mlp", False), ("1.5MiB", "cnn", False),
                                  ("1MiB", "cnn", False), ("200KiB", "mlp", False),
                                  ("1.5MiB", "mlp", True)]:
        tag = f"{value}-{model}" + ("-w2" if workers else "")
        add(f"misc-budget-{tag}", "misc", (0, 2), budget(value, model, workers),
            timeout=150, desc=f"memory.budget={value} policy=auto ({model}"
                              f"{', 2 workers' if workers else ''}): trains or names a budget "
                              "that works, never a missing memory_plan.txt")
    for value in ["1.5 MiB", "0", "-1MiB", "1e3MiB", "nanMiB", "99999999999999999999GiB", "1.5",
                  "0x10MiB", "1PiB"]:
        add(f"misc-budget-text-{value.replace(' ', '_')}", "misc", (0, 2),
            (lambda v: lambda ctx: ctx.train(f"memory.budget={v}"))(value),
            desc=f"memory.budget = '{value}'")

    def outer(value, local_period="2", workers=True):
        def fn(ctx):
            ctx.check(lambda r: "blames optim.lr for sync.outer_lr"
                      if "optim.lr" in r.err and "outer_lr" not in r.err else None)
            return ctx.train("sync.mode=diloco", f"sync.outer_lr={value}",
                             f"sync.local_period={local_period}", "train.max_steps=8",
                             extra=W2 if workers else ())
        return fn

    add("misc-outer-lr-1e6", "misc", "nonzero", outer("1e6"), timeout=90,
        desc="diloco, sync.outer_lr = 1e6: the message must not blame optim.lr")
    add("misc-outer-lr-1e6-period1", "misc", "nonzero", outer("1e6", "1"), timeout=90,
        desc="diloco, sync.outer_lr = 1e6, local_period 1")
    add("misc-outer-lr-1e30", "misc", "nonzero", outer("1e30"), timeout=90,
        desc="diloco, sync.outer_lr = 1e30")
    for value in ["nan", "-1", "inf", "0"]:
        add(f"misc-outer-lr-{value}", "misc", 2 if value != "0" else (0, 2), outer(value),
            timeout=90, desc=f"diloco, sync.outer_lr = {value}")
    add("misc-outer-lr-1e6-ps-diloco", "misc", "nonzero",
        (lambda ctx: (ctx.check(lambda r: "blames optim.lr for sync.outer_lr"
                                if "optim.lr" in r.err and "outer_lr" not in r.err else None),
                      ctx.train("sync.mode=ps-diloco", "sync.outer_lr=1e6", "sync.local_period=2",
                                "train.max_steps=8", extra=W2))[1]),
        timeout=90, desc="ps-diloco, sync.outer_lr = 1e6")

    def npy_labels(label_bytes, dtype="<i8", n=16):
        def fn(ctx):
            d = ctx.mkdir("npy")
            x = npy("<f4", (n, 1, 4, 4), b"\0" * 4 * n * 16)
            good = {"<i8": npy("<i8", (n,), struct.pack(f"<{n}q", *[i % 10 for i in range(n)])),
                    "<f4": npy("<f4", (n,), struct.pack(f"<{n}f", *[0.5] * n)),
                    "|u1": npy("|u1", (n,), bytes(i % 10 for i in range(n)))}[dtype]
            ctx.write("npy/train_inputs.npy", x)
            ctx.write("npy/test_inputs.npy", x)
            ctx.write("npy/train_targets.npy", npy(dtype, (n,), label_bytes))
            ctx.write("npy/test_targets.npy", good)
            ctx.must_not_say(r"out of memory", "calls a bad label out of memory")
            return ctx.train("data.dataset=npy", f"data.path={d}")
        return fn

    def labels(big):
        return struct.pack("<16q", *([big] + [i % 10 for i in range(15)]))

    for tag, big in [("1e9", 10 ** 9), ("2e31", 2 ** 31), ("2e40", 2 ** 40),
                     ("int64-max", 2 ** 63 - 1), ("minus-1", -1), ("int64-min", -2 ** 63)]:
        add(f"misc-npy-label-{tag}", "misc", 3, npy_labels(labels(big)), timeout=60,
            desc=f"npy train label {big}: a dataset error, not out of memory")
    add("misc-npy-label-float-nan", "misc", "any",
        npy_labels(struct.pack("<16f", *([float("nan")] * 16)), dtype="<f4"), timeout=60,
        desc="npy float targets of NaN (regression)")
    add("misc-npy-label-uint8-255", "misc", (0, 3),
        npy_labels(bytes([255] + list(range(15))), dtype="|u1"), timeout=60,
        desc="npy uint8 label 255 (256 classes)")

    for value in ["nan", "inf", "-1", "0", "-inf", "1e400", "abc", "1e7", "NaN"]:
        add(f"misc-calibrate-link-{value}", "misc", 2 if value != "1e7" else 0,
            (lambda v: lambda ctx: [ctx.caravan, "calibrate", "--hosts", "2", "--link-mbit", v,
                                    "--swap-dir", ctx.mkdir("swap")])(value), timeout=90,
            desc=f"calibrate --link-mbit {value}")
    for value in ["nan", "-1", "inf"]:
        add(f"misc-calibrate-latency-{value}", "misc", 2,
            (lambda v: lambda ctx: [ctx.caravan, "calibrate", "--link-mbit", "1000",
                                    "--latency-us", v, "--swap-dir", ctx.mkdir("swap")])(value),
            timeout=90, desc=f"calibrate --latency-us {value}")
    for value in ["0", "-3", "nan"]:
        add(f"misc-calibrate-hosts-{value}", "misc", 2,
            (lambda v: lambda ctx: [ctx.caravan, "calibrate", "--hosts", v, "--link-mbit", "1000",
                                    "--swap-dir", ctx.mkdir("swap")])(value), timeout=90,
            desc=f"calibrate --hosts {value}")
    add("misc-calibrate-swap-tmpfs", "misc", "nonzero",
        lambda ctx: [ctx.caravan, "calibrate", "--link-mbit", "1000", "--swap-dir", "/dev/shm"],
        timeout=90, desc="calibrate --swap-dir /dev/shm (tmpfs)")
    add("misc-calibrate-swap-missing", "misc", "nonzero",
        lambda ctx: [ctx.caravan, "calibrate", "--link-mbit", "1000", "--swap-dir",
                     ctx.p("nope")], timeout=90, desc="calibrate --swap-dir missing")

    def sim_workload(make_workload, sets=()):
        def fn(ctx):
            w = make_workload(ctx)
            if os.path.lexists(w):
                ctx.preserve(w)
            argv = [ctx.caravan, "simulate", "-c", ctx.config(), "--cluster", ctx.cluster(),
                    "--workers", "2", "--steps", "5", "--workload", w]
            for s in sets:
                argv += ["--set", s]
            return argv
        return fn

    def copy_workload(model):
        def make(c):
            shutil.copyfile(c.fx.workload(model), c.p("workload.json"))
            return c.p("workload.json")
        return make

    def edited_workload(edit):
        def make(c):
            w = json.load(open(c.fx.workload("mlp")))
            edit(w)
            return c.write("workload.json", json.dumps(w))
        return make

    add("misc-workload-other-model", "misc", 2, sim_workload(copy_workload("cnn")), timeout=90,
        desc="simulate (mlp config) --workload of the CNN: refused")
    add("misc-workload-other-width", "misc", 2,
        sim_workload(copy_workload("mlp"), ("model.width=64",)), timeout=90,
        desc="simulate --workload of mlp width default with model.width = 64: refused")
    add("misc-workload-other-batch", "misc", 2,
        sim_workload(copy_workload("mlp"), ("data.batch_size=16",)), timeout=90,
        desc="simulate --workload with another data.batch_size: refused")
    add("misc-workload-same", "misc", 0, sim_workload(copy_workload("mlp")), timeout=90,
        desc="simulate --workload of the same config (works)")
    for tag, make in [
        ("garbage", lambda c: c.write("workload.json", "{{{ not json")),
        ("empty", lambda c: c.write("workload.json", b"")),
        ("empty-object", lambda c: c.write("workload.json", "{}")),
        ("array", lambda c: c.write("workload.json", "[1, 2, 3]")),
        ("fifo", lambda c: c.fifo("workload.json")),
        ("directory", lambda c: c.mkdir("workload.json")),
        ("missing", lambda c: c.p("absent.json")),
        ("dev-zero", lambda c: "/dev/zero"),
        ("truncated", lambda c: c.write("workload.json",
                                        open(c.fx.workload("mlp")).read()[:100])),
        ("negative-times", edited_workload(lambda w: _negate_numbers(w))),
        ("nan-times", edited_workload(lambda w: _negate_numbers(w, nan=True))),
        ("strings", edited_workload(lambda w: _stringify(w))),
    ]:
        add(f"misc-workload-{tag}", "misc", (2, 3, 5) if tag != "missing" else "nonzero",
            sim_workload(make), timeout=30, desc=f"simulate --workload <{tag}>")

    for mode in ["ps-bsp", "ps-asp", "ps-ssp", "osp", "ps-diloco"]:
        def fn(ctx, mode=mode):
            ctx.must_say(r"pipeline", "does not name the pipeline")
            ctx.must_say(re.escape(mode), f"does not name sync.mode {mode}")
            ctx.must_not_say(r"\b3 workers\b", "counts the parameter server as a worker")
            return ctx.train("parallel.pipeline_stages=2", f"sync.mode={mode}", extra=W2)
        add(f"misc-pipeline-{mode}", "misc", 2, fn, timeout=60,
            desc=f"2-stage pipeline with sync.mode = {mode}: one clear line")
    for mode in ["local-sgd", "diloco", "gossip"]:
        add(f"misc-pipeline-{mode}", "misc", 2,
            (lambda m: lambda ctx: ctx.train("parallel.pipeline_stages=2", f"sync.mode={m}",
                                             extra=W2))(mode), timeout=60,
            desc=f"2-stage pipeline with sync.mode = {mode}")

    for tag, sets, expect in [
        ("max-steps-negative", ("train.max_steps=-1",), 2),
        ("batch-zero", ("data.batch_size=0",), 2),
        ("batch-huge", ("data.batch_size=1000000000",), (2, 9)),
        ("lr-nan", ("optim.lr=nan",), 2),
        ("lr-inf", ("optim.lr=inf",), 2),
        ("lr-1e30", ("optim.lr=1e30",), (2, 6)),
        ("keep-zero", ("checkpoint.keep=0",), (0, 2)),
        ("threads-negative", ("train.threads=-1",), 2),
        ("seed-huge", ("seed.init=99999999999999999999",), 2),
        ("multi-value", ('data.path="x"\n[model]\nname="gpt"',), 2),
        ("unknown-key", ("train.max_step=3",), 2),
        ("synthetic-size-zero", ("data.synthetic_size=0",), 2),
    ]:
        add(f"misc-config-{tag}", "misc", expect,
            (lambda s: lambda ctx: ctx.train(*s))(sets), timeout=60, desc=f"--set {sets[0]!r}")
    add("misc-stop-at-step-negative", "misc", 2,
        lambda ctx: ctx.train(extra=["--stop-at-step", "-1"]), desc="--stop-at-step -1")
    add("misc-resume-nonrun", "misc", 4,
        lambda ctx: [ctx.caravan, "train", "--resume", ctx.mkdir("empty"), "-q"],
        desc="--resume of an empty directory")
    add("misc-eval-model-pt", "misc", 4,
        lambda ctx: (lambda run: (ctx.preserve(run),
                                  [ctx.caravan, "eval", "--run-dir", run, "--checkpoint",
                                   os.path.join(run, "model.pt")])[1])(ctx.run_copy("run")),
        desc="eval --checkpoint RUN/model.pt")


def _negate_numbers(obj, nan=False):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                obj[k] = float("nan") if nan else -abs(v) - 1
            else:
                _negate_numbers(v, nan)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                obj[i] = float("nan") if nan else -abs(v) - 1
            else:
                _negate_numbers(v, nan)


def _stringify(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                obj[k] = "x"
            else:
                _stringify(v)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                obj[i] = "x"
            else:
                _stringify(v)


def register_all():
    register_output_cases()
    register_model_cases()
    register_store_cases()
    register_data_cases()
    register_backend_cases()
    register_misc_cases()
    ids = [c.id for c in CASES]
    dup = {i for i in ids if ids.count(i) > 1}
    if dup:
        raise SystemExit(f"hostile_probe: duplicate case ids: {sorted(dup)}")


# ------------------------------------------------------------------------------------------
# the runner

FLAGS = ("data-loss", "hang", "crash", "internal-error", "wrong-exit", "unclear-message",
         "bad-message", "stray-processes", "setup-failed")


class Probe:
    def __init__(self, caravan, root):
        self.caravan = caravan
        self.root = root
        self.fixtures = Fixtures(self)
        self.notes = []

    def note(self, text):
        self.notes.append(text)

    def run_plain(self, argv, cwd, timeout):
        """A command outside any case (fixtures)."""
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
        env.update(OMP_NUM_THREADS="1", TMPDIR=cwd)
        t0 = time.time()
        p = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                             start_new_session=True)
        try:
            out, err = p.communicate(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            kill_tree(p.pid)
            out, err = p.communicate()
            timed_out = True
        kill_strays()
        rc = p.returncode
        return Result(rc if rc >= 0 else None, -rc if rc < 0 else None, timed_out,
                      out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                      time.time() - t0)

    def run_case(self, case):
        directory = os.path.join(self.root, case.id)
        os.makedirs(directory)
        ctx = Ctx(self, case, directory)
        flags, details = [], []
        t0 = time.time()
        try:
            try:
                what = case.fn(ctx)
            except SetupError as e:
                what = Result(setup_failed=str(e))
            if isinstance(what, Result):
                r = what
            else:
                r = ctx.run(what, timeout=case.timeout, name="main")
            if r.setup_failed:
                flags.append("setup-failed")
                details.append(r.setup_failed)
            else:
                flags, details = self.judge(case, ctx, r)
        except Exception as e:  # noqa: BLE001 - a broken case is reported, the run goes on
            r = Result(setup_failed=f"{type(e).__name__}: {e}")
            flags, details = ["setup-failed"], [r.setup_failed]
        finally:
            ctx.cleanup()
        strays = kill_strays(grace=3.0)
        if strays and "setup-failed" not in flags:
            flags.append("stray-processes")
            details.append(f"{strays} process(es) still running after the command ended")
        dev_null = check_dev_null()
        if dev_null:
            if "data-loss" not in flags:
                flags.append("data-loss")
            details.append(dev_null)
        return r, flags, details, time.time() - t0

    def judge(self, case, ctx, r):
        flags, details = [], []
        err = r.err
        if r.timed_out:
            flags.append("hang")
            details.append(f"no end within {case.timeout:.0f} s")
        elif r.sig is not None:
            flags.append("crash")
            details.append(f"killed by signal {r.sig} ({signal.Signals(r.sig).name})")
        elif r.rc is not None and r.rc > 128 and r.rc != 130 and (r.rc - 128) in (
                signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL,
                signal.SIGKILL):
            flags.append("crash")
            details.append(f"exit {r.rc} (a signal's status)")
        if re.search(r"internal error", err, re.I):
            flags.append("internal-error")
        changes = compare(ctx.before)
        if changes:
            flags.append("data-loss")
            details.append("; ".join(changes[:3]) + (f" (+{len(changes) - 3})"
                                                      if len(changes) > 3 else ""))
        if not r.timed_out and r.sig is None:
            if not expectation_met(case.expect, r.rc):
                flags.append("wrong-exit")
                details.append(f"exit {r.rc}, expected {expect_text(case.expect)}")
            if r.rc != 0:
                lines = [ln for ln in err.splitlines() if ln.strip()]
                if len(lines) != 1 or not lines[0].startswith("caravan: error:"):
                    flags.append("unclear-message")
                    details.append(f"{len(lines)} stderr line(s)"
                                   + ("" if lines and lines[0].startswith("caravan: error:")
                                      else ", not 'caravan: error: ...'"))
            for check in ctx.checks:
                try:
                    problem = check(r)
                except Exception as e:  # noqa: BLE001
                    problem = f"check failed: {type(e).__name__}: {e}"
                if problem:
                    if "bad-message" not in flags:
                        flags.append("bad-message")
                    details.append(problem)
        return flags, details


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caravan", default=os.path.join(REPO, "build", "caravan"),
                    help="the caravan binary (default build/caravan)")
    ap.add_argument("--only", help="run only these classes (comma-separated): output, model, "
                                   "store, data, backend, misc")
    ap.add_argument("--case", action="append", default=[],
                    help="run only cases whose id starts with this (repeatable)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--strict", action="store_true",
                    help="exit 1 when any case lost data, hung, crashed or printed an internal "
                         "error")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directories")
    ap.add_argument("--json", help="also write every case's result to this JSON file")
    args = ap.parse_args()

    register_all()
    cases = CASES
    if args.only:
        classes = {c.strip() for c in args.only.split(",") if c.strip()}
        known = {c.cls for c in CASES}
        unknown = classes - known
        if unknown:
            ap.error(f"unknown class(es) {sorted(unknown)}; the classes are {sorted(known)}")
        cases = [c for c in cases if c.cls in classes]
    if args.case:
        cases = [c for c in cases if any(c.id.startswith(p) for p in args.case)]

    if args.list:
        for c in cases:
            print(f"{c.id:<48} {c.cls:<8} expect {expect_text(c.expect):<8} {c.desc}")
        counts = {}
        for c in cases:
            counts[c.cls] = counts.get(c.cls, 0) + 1
        print(f"{len(cases)} cases: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        return 0

    caravan = os.path.abspath(args.caravan)
    if not os.access(caravan, os.X_OK):
        print(f"hostile_probe: {caravan} is not an executable; build it (scripts/test.sh) or "
              f"pass --caravan", file=sys.stderr)
        return 3
    if os.geteuid() != 0:
        print("hostile_probe: not root: the read-only directory and /dev/shm cases (unshare -m) "
              "will be reported as setup-failed", file=sys.stderr)

    _set_subreaper()
    root = tempfile.mkdtemp(prefix="hostile-probe-", dir="/var/tmp" if os.path.isdir("/var/tmp")
                            else None)
    probe = Probe(caravan, root)
    print(f"hostile_probe: {len(cases)} cases against {caravan} in {root}", flush=True)
    t_start = time.time()
    results = []
    counts = {f: 0 for f in FLAGS}
    clean = 0
    try:
        for i, case in enumerate(cases, 1):
            r, flags, details, secs = probe.run_case(case)
            verdict = ",".join(flags) if flags else "clean"
            if not flags:
                clean += 1
            for f in flags:
                counts[f] += 1
            line = (f"[{i:3d}/{len(cases)}] {case.id:<46} {case.cls:<7} "
                    f"rc={r.code_text:<5} {verdict} ({secs:.1f}s)")
            if flags:
                line += " | " + "; ".join(details)
                lines = [ln for ln in r.err.splitlines() if ln.strip()] if not r.setup_failed \
                    else []
                if len(lines) == 1:
                    line += f" | stderr: {lines[0][:240]}"
                elif lines:
                    line += (f" | stderr first: {lines[0][:200]} | stderr last: "
                             f"{lines[-1][:200]}")
            print(line, flush=True)
            results.append({"id": case.id, "class": case.cls, "expect": expect_text(case.expect),
                            "rc": r.rc, "signal": r.sig, "timed_out": r.timed_out,
                            "flags": flags, "details": details, "seconds": round(secs, 2),
                            "stderr": r.err[-4000:], "desc": case.desc})
    finally:
        kill_strays()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    total_s = time.time() - t_start
    for n in probe.notes:
        print(f"note: {n}")
    print(f"summary: {len(cases)} cases, {clean} clean; data loss {counts['data-loss']}, "
          f"hang {counts['hang']}, crash {counts['crash']}, internal error "
          f"{counts['internal-error']}, wrong exit code {counts['wrong-exit']}, unclear message "
          f"{counts['unclear-message']}; also bad message {counts['bad-message']}, stray "
          f"processes {counts['stray-processes']}, setup failed {counts['setup-failed']}; "
          f"{total_s / 60:.1f} min" + (f"; kept {root}" if args.keep else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"caravan": caravan, "seconds": round(total_s, 1), "counts": counts,
                       "clean": clean, "cases": results}, f, indent=1)
    serious = counts["data-loss"] + counts["hang"] + counts["crash"] + counts["internal-error"]
    return 1 if args.strict and serious else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        kill_strays()
        sys.exit(130)
