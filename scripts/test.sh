#!/usr/bin/env bash
# Builds Caravan with its tests (the programs CTest runs: caravan_test_programs) and runs the
# whole suite with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j"$(nproc)" --target caravan_test_programs
cd build
ctest --output-on-failure -j"$(nproc)" --timeout 900
