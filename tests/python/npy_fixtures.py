#!/usr/bin/env python3
"""Writes .npy fixtures with NumPy's own writer (the oracle for Caravan's reader) into OUT:

  good/     classification: train_inputs [7,2,3] float32 = arange/8, train_targets [7] int64 = i%3,
            test_* the same for 4 examples (format version 1.0)
  bytes/    train_inputs [5,4] uint8 = arange, train_targets [5,2] float32 (regression),
            test_* 3 examples; written with format version 2.0
  bad/      single files: object.npy, fortran.npy, float64.npy, bigendian.npy, truncated.npy,
            trailing.npy, empty.npy, text.npy, structured.npy, scalar.npy, zero.npy
"""
import os
import sys

import numpy as np

out = sys.argv[1]
for d in ("good", "bytes", "bad"):
    os.makedirs(os.path.join(out, d), exist_ok=True)


def put(path, a, version=None):
    with open(os.path.join(out, path), "wb") as f:
        np.lib.format.write_array(f, a, version=version, allow_pickle=True)


for split, n in (("train", 7), ("test", 4)):
    put(f"good/{split}_inputs.npy", (np.arange(n * 6, dtype=np.float32) / 8).reshape(n, 2, 3))
    put(f"good/{split}_targets.npy", np.arange(n, dtype=np.int64) % 3)
for split, n in (("train", 5), ("test", 3)):
    put(f"bytes/{split}_inputs.npy", np.arange(n * 4, dtype=np.uint8).reshape(n, 4), (2, 0))
    put(f"bytes/{split}_targets.npy", (np.arange(n * 2, dtype=np.float32) - 1.5).reshape(n, 2),
        (2, 0))

put("bad/object.npy", np.array([{"a": 1}, None], dtype=object))
put("bad/fortran.npy", np.asfortranarray(np.ones((3, 4), dtype=np.float32)))
put("bad/float64.npy", np.ones((3, 4)))
put("bad/bigendian.npy", np.ones((3, 4), dtype=">f4"))
put("bad/structured.npy", np.zeros(3, dtype=[("x", "<f4"), ("y", "<i8")]))
put("bad/scalar.npy", np.array(1.0, dtype=np.float32))
put("bad/zero.npy", np.zeros((0, 4), dtype=np.float32))
put("bad/truncated.npy", np.ones((3, 4), dtype=np.float32))
with open(os.path.join(out, "bad/truncated.npy"), "r+b") as f:
    f.truncate(os.path.getsize(f.name) - 5)
put("bad/trailing.npy", np.ones((3, 4), dtype=np.float32))
with open(os.path.join(out, "bad/trailing.npy"), "ab") as f:
    f.write(b"\0\0\0\0")
open(os.path.join(out, "bad/empty.npy"), "wb").close()
with open(os.path.join(out, "bad/text.npy"), "w") as f:
    f.write("1,2,3\n4,5,6\n")
