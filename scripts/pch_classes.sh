#!/usr/bin/env bash
# Prints which precompiled header each source of caravan_lib needs (CMakeLists.txt keeps the
# lists): "plain" includes no LibTorch, "aten" tensors but not the C++ front end (torch::nn,
# c10d, TorchScript), "full" the rest. Reads the compile commands of a build/ configured with
# gcc (scripts/setup.sh), and asks gcc for each source's headers (-M).
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f build/build.ninja ] || { echo "pch_classes: configure build/ first (scripts/setup.sh)" >&2; exit 2; }
ninja -C build -t commands caravan_lib | grep -E ' -c [^ ]*/src/[^ ]*\.cpp$' | while read -r line; do
  src=${line##* -c }
  if ! deps=$(cd build && eval "$(echo "$line" | sed -E 's#^[^ ]*ccache ##; s# -Winvalid-pch -include [^ ]*##; s# -MD -MT [^ ]* -MF [^ ]*##; s# -o [^ ]*# -M#')" 2>&1); then
    echo "pch_classes: gcc -M failed for $src: $(head -1 <<<"$deps")" >&2
    exit 1
  fi
  if grep -qE 'torch/nn/module\.h|api/include/torch/torch\.h|torch/script\.h|torch/csrc/jit' <<<"$deps"; then
    echo "full  ${src#"$PWD"/src/}"
  elif grep -q 'torch/include' <<<"$deps"; then
    echo "aten  ${src#"$PWD"/src/}"
  else
    echo "plain ${src#"$PWD"/src/}"
  fi
done | sort -u
