#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang, ASan + UBSan) in build-fuzz/ and runs each for
# SECONDS (default 30) from a seed corpus it writes itself: gzipped and plain IDX files, the
# example configs plus overrides, real checkpoints, valid parameter-server pushes.
#
#   scripts/fuzz.sh [SECONDS] [TARGET...]      TARGET: idx config checkpoint codec metrics tokens npy (default all)
#
# First every target reruns the inputs of fuzz/crashes/<target>-* (bugs found and fixed, or
# outside Caravan and tolerated, see fuzz/README.md). The corpus grows in build-fuzz/corpus/
# across runs; logs go to build-fuzz/logs/, anything found to build-fuzz/artifacts/<target>/.
# Exit status 1 when any target crashed, leaked, timed out or ran out of memory.
# The targets run CARAVAN_FUZZ_JOBS at a time (default: one per core), each for SECONDS of its
# own; the table lists them in order when all are done.
# Environment: CXX (default clang++, or clang++-14), CARAVAN_FUZZ_BUILD (default build-fuzz).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)

seconds=${1:-30}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(idx config checkpoint codec metrics tokens npy)
build=${CARAVAN_FUZZ_BUILD:-build-fuzz}
case "$build" in /*) ;; *) build="$root/$build" ;; esac

cxx=${CXX:-}
if [ -z "$cxx" ]; then
  cxx=$(command -v clang++ || command -v clang++-14 || true)
fi
if [ -z "$cxx" ]; then
  echo "fuzz.sh: clang++ not found (apt-get install clang)" >&2
  exit 2
fi

# Build (configure once; ninja does nothing on a warm build).
if [ ! -f "$build/build.ninja" ]; then
  cmake -S fuzz -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" >/dev/null
fi
if ! ninja -C "$build" $(printf 'fuzz_%s ' "${targets[@]}") >"$build/ninja.log" 2>&1; then
  cat "$build/ninja.log" >&2
  echo "fuzz.sh: the build failed" >&2
  exit 2
fi
for t in "${targets[@]}"; do
  [ -x "$build/fuzz_$t" ] || { echo "fuzz.sh: no target fuzz_$t" >&2; exit 2; }
done

export LSAN_OPTIONS="suppressions=$root/fuzz/lsan.supp:print_suppressions=0"
export CARAVAN_FUZZ_SCRATCH="$build/scratch"  # the files the targets read (a crash leaves one)
rm -rf "$CARAVAN_FUZZ_SCRATCH"
export UBSAN_OPTIONS="print_stacktrace=1"
# One target: its known reproducers, then SECONDS of fuzzing; its line of the table goes to
# $build/logs/TARGET.result, the exit status says whether it failed.
fuzz_one() {
  local t=$1
  local seeds="$build/seeds/$t"
  local corpus="$build/corpus/$t"
  local artifacts="$build/artifacts/$t"
  local log="$build/logs/$t.log"
  rm -rf "$seeds" "$seeds.dict"
  mkdir -p "$corpus" "$artifacts" "$build/logs"
  CARAVAN_FUZZ_SEEDS="$seeds" "$build/fuzz_$t"
  [ "$t" = config ] && cp configs/*.toml "$seeds/"
  local flags=(-timeout=10 -print_final_stats=1 -artifact_prefix="$artifacts/")
  [ -f "$seeds.dict" ] && flags+=(-dict="$seeds.dict")

  # Known reproducers must pass.
  shopt -s nullglob
  local known=(fuzz/crashes/"$t"-*)
  shopt -u nullglob
  if [ ${#known[@]} -gt 0 ] &&
     ! "$build/fuzz_$t" "${flags[@]}" "${known[@]}" >"$build/logs/$t-known.log" 2>&1; then
    printf '%-11s %8s %7s %7s %7s  %s\n' "$t" - - - - \
      "FAILED on fuzz/crashes (see $build/logs/$t-known.log)" >"$build/logs/$t.result"
    return 1
  fi

  local result=ok status=0
  if ! "$build/fuzz_$t" "${flags[@]}" -max_total_time="$seconds" "$corpus" "$seeds" \
      >"$log" 2>&1; then
    result="FOUND $(grep -m1 -oE '(ERROR|SUMMARY): [A-Za-z]+(Sanitizer)?: [^(]*|fuzz [a-z]+: .*' \
      "$log" | head -c 100) -> $(ls -t "$artifacts" | head -1) (log $log)"
    status=1
  fi
  local last=$(grep -E '^#[0-9]+' "$log" | tail -1)
  field() { sed -nE "s/.* $1: ([^ ]+).*/\\1/p" <<<"$last"; }
  local execs=$(sed -nE 's/^stat::average_exec_per_sec: *([0-9]+)/\1/p' "$log")
  printf '%-11s %8s %7s %7s %7s  %s\n' "$t" "${execs:-?}" "$(field cov)" "$(field ft)" \
    "$(field corp)" "$result" >"$build/logs/$t.result"
  return $status
}

parallel=${CARAVAN_FUZZ_JOBS:-$(nproc)}
declare -A pids
for t in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n || true; done
  rm -f "$build/logs/$t.result"
  fuzz_one "$t" &
  pids[$t]=$!
done
status=0
printf '%-11s %8s %7s %7s %7s  %s\n' target "exec/s" cov ft corpus result
for t in "${targets[@]}"; do
  wait "${pids[$t]}" || status=1
  cat "$build/logs/$t.result" 2>/dev/null ||
    { printf '%-11s  %s\n' "$t" "FAILED (no result; see $build/logs/$t.log)"; status=1; }
done
exit $status
