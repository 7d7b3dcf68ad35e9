#!/usr/bin/env bash
# Checks that the C++ lines changed since BASE follow .clang-format (the style the code has).
# Only changed lines: older code is reformatted when it is next touched, not all at once.
#   bash scripts/format_check.sh [BASE]   # default BASE: the commit that added .clang-format
# Fix what it reports with: git clang-format BASE
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:-$(git log --diff-filter=A --format=%H -- .clang-format | tail -1)}
if [ -z "$base" ] || ! git cat-file -e "$base^{commit}" 2>/dev/null; then
  echo "format: no base commit to compare with (a shallow clone?); not checked"
  exit 0
fi
out=$(git clang-format --diff --extensions cpp,h "$base" -- src tests bench fuzz 2>&1) || true
case "$out" in
  "" | "no modified files to format"* | "clang-format did not modify any files"*)
    echo "format: lines changed since ${base:0:12} follow .clang-format"
    exit 0 ;;
esac
echo "$out"
echo "format: the lines above do not follow .clang-format; fix them with: git clang-format $base"
exit 1
