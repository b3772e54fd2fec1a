#!/usr/bin/env bash
# ctest bench.flags: --help prints the usage and the flags (and where the records go) and exits 0; an unknown flag or
# a bad batch list is one error line naming it (then the usage) and exit 2; a run without --out writes its record to
# $HIERPAR_BENCH_OUT (not into the working directory's bench/results) and says so. No GPU needed (the CPU suite
# host_dispatch, --quick).
#   bash bench/flags_test.sh HIERPAR_BENCH
set -euo pipefail
bench=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export HIERPAR_BENCH_OUT=$dir/env  # nothing this test runs writes to the user's home
out=$("$bench" --help)
grep -q "^usage: hierpar-bench" <<< "$out" || { echo "--help printed no usage:"; echo "$out"; exit 1; }
grep -q -- "--skip TEXT" <<< "$out" || { echo "--help names no flags:"; echo "$out"; exit 1; }
# shellcheck disable=SC2016,SC2088  # the literal text --help prints
for text in '$HIERPAR_BENCH_OUT' '~/.cache/hierpar/bench' 'RECORD.json \[--out DIR\]'; do
  grep -q -- "$text" <<< "$out" || { echo "--help does not say '$text':"; echo "$out"; exit 1; }
done
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
# A run without --out, from a scratch working directory: the record goes to $HIERPAR_BENCH_OUT, the run says so in
# one line, and the working directory stays empty (no bench/results there). GPUs hidden: the record is cpu-<suite>.
mkdir "$dir/cwd"
out=$(cd "$dir/cwd" && CUDA_VISIBLE_DEVICES='' "$bench" host_dispatch --quick 2>/dev/null)
grep -qx "hierpar-bench: writing to $dir/env (\$HIERPAR_BENCH_OUT; --out DIR to change)" <<< "$out" ||
  { echo "no line saying where the records go:"; echo "$out"; exit 1; }
grep -qx "wrote $dir/env/cpu-host_dispatch.json" <<< "$out" ||
  { echo "no record in \$HIERPAR_BENCH_OUT:"; echo "$out"; exit 1; }
[ -s "$dir/env/cpu-host_dispatch.json" ] || { echo "$dir/env/cpu-host_dispatch.json is empty"; exit 1; }
[ -z "$(ls -A "$dir/cwd")" ] || { echo "the run wrote into its working directory:"; ls -R "$dir/cwd"; exit 1; }
echo "bench.flags: --help, an unknown flag, a bad batch list, a run's record in \$HIERPAR_BENCH_OUT"
