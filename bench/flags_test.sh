#!/usr/bin/env bash
# ctest bench.flags: --help prints the usage and the flags and exits 0; an unknown flag or a bad batch list is one
# error line naming it (then the usage) and exit 2. No GPU needed.
#   bash bench/flags_test.sh HIERPAR_BENCH
set -euo pipefail
bench=$1
out=$("$bench" --help)
grep -q "^usage: hierpar-bench" <<< "$out" || { echo "--help printed no usage:"; echo "$out"; exit 1; }
grep -q -- "--skip TEXT" <<< "$out" || { echo "--help names no flags:"; echo "$out"; exit 1; }
for bad in "--bogus" "--batches 64,x"; do
  status=0
  # shellcheck disable=SC2086
  err=$("$bench" $bad 2>&1 >/dev/null) || status=$?
  [ "$status" = 2 ] || { echo "$bad: exit $status, expected 2"; exit 1; }
  first=$(head -1 <<< "$err")
  case "$bad" in
    --bogus) grep -qx "hierpar-bench: unknown flag --bogus" <<< "$first" ;;
    *) grep -qx "hierpar-bench: --batches: 'x' is not a batch size" <<< "$first" ;;
  esac || { echo "$bad: first line '$first'"; exit 1; }
done
echo "bench.flags: --help, an unknown flag and a bad batch list"
