#!/usr/bin/env bash
# Resident memory of a run on token files (data.dataset = "tokens") against the files' size:
# a 2 GB train.bin against a 20 MB one, the same GPT and steps, interleaved A B A B; prints
# each run's peak RSS (/usr/bin/time), the medians and their difference (target: < 100 MB).
#
#   bench/token_rss.sh [ROUNDS] [STEPS]      (default 2 rounds of 300 steps; needs 2.1 GB disk)
#
# The token files are made from repeated byte ids (uint16) under $TMPDIR; OPENBLAS_CORETYPE is
# unset for the runs, as for every benchmark here.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-2}
steps=${2:-300}
caravan=${CARAVAN:-build/caravan}
python=${CARAVAN_PYTHON:-.venv/bin/python}  # the project's Python (NumPy)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
unset OPENBLAS_CORETYPE
echo "token_rss: OPENBLAS_CORETYPE unset for these runs"
"$python" - "$work" <<'PY'
import os, sys
import numpy as np
work = sys.argv[1]
ids = (np.arange(1 << 20, dtype=np.uint64) * 2654435761 % 256).astype(np.uint16)
for name, count in (("small", 10_000_000), ("big", 1_000_000_000)):
    os.makedirs(f"{work}/{name}")
    with open(f"{work}/{name}/train.bin", "wb") as f:
        for start in range(0, count, len(ids)):
            ids[: min(len(ids), count - start)].tofile(f)
    ids[:200_000].tofile(f"{work}/{name}/val.bin")
PY
declare -A rss
for round in $(seq "$rounds"); do
  for name in small big; do
    rm -rf "$work/run"
    kb=$( { /usr/bin/time -f "%M" "$caravan" train -q --config /dev/null \
      --set data.dataset=tokens --set "data.path=$work/$name" --set data.vocab_size=256 \
      --set model.name=gpt --set model.width=64 --set model.depth=2 --set model.heads=2 \
      --set data.seq_len=128 --set data.batch_size=16 --set "train.max_steps=$steps" \
      --set train.eval_every=0 --set train.eval_batches=2 --set train.threads=1 \
      --run-dir "$work/run" >/dev/null; } 2>&1 | tail -1)
    echo "round $round $name ($(du -h "$work/$name/train.bin" | cut -f1) train.bin): peak RSS $((kb / 1024)) MiB"
    rss[$name]="${rss[$name]:-} $kb"
  done
done
median() { tr ' ' '\n' <<<"$1" | grep -v '^$' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
small=$(median "${rss[small]}")
big=$(median "${rss[big]}")
echo "median peak RSS: 20 MB file $((small / 1024)) MiB, 2 GB file $((big / 1024)) MiB, difference $(((big - small) / 1024)) MiB (target < 100 MB)"
