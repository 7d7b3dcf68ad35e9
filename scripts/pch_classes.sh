#!/usr/bin/env bash
# Prints which precompiled header each source of `caravan` needs (CMakeLists.txt keeps the
# lists): "plain" includes no LibTorch, "aten" tensors but not the C++ front end (torch::nn,
# c10d, TorchScript), "full" the rest. Reads the compile commands of a configured build/.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -f build/build.ninja ] || { echo "pch_classes: configure build/ first (scripts/setup.sh)" >&2; exit 2; }
ninja -C build -t commands caravan | grep -E ' -c [^ ]*/src/[^ ]*\.cpp$' | while read -r line; do
  src=${line##* -c }
  deps=$(cd build && eval "$(echo "$line" | sed -E 's#^[^ ]*ccache ##; s# -Winvalid-pch -include [^ ]*##; s# -MD -MT [^ ]* -MF [^ ]*##; s# -o [^ ]*# -M#')" 2>/dev/null)
  if grep -qE 'torch/nn/module\.h|api/include/torch/torch\.h|torch/script\.h|torch/csrc/jit' <<<"$deps"; then
    echo "full  ${src#"$PWD"/src/}"
  elif grep -q 'torch/include' <<<"$deps"; then
    echo "aten  ${src#"$PWD"/src/}"
  else
    echo "plain ${src#"$PWD"/src/}"
  fi
done | sort -u
