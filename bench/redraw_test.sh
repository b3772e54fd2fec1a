#!/usr/bin/env bash
# ctest bench.redraw: `hierpar-bench SUITE --redraw RECORD.json` draws the strategy and dcgan_step charts again from
# committed records (copied to a scratch folder, no GPU) into --out DIR, else into $HIERPAR_BENCH_OUT, else into
# ~/.cache/hierpar/bench, never beside the record (the committed records in RESULTS_DIR stay as they are); a file
# that is not a record is one line and exit 1.
#   bash bench/redraw_test.sh HIERPAR_BENCH RESULTS_DIR
set -euo pipefail
bench=$1 results=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# Nothing this test runs may write to the user's home: the default folder is a scratch one unless a case says not.
export HIERPAR_BENCH_OUT=$dir/env
mkdir "$dir/src"
cp "$results/h100x4-strategy-bf16.json" "$dir/src/strategy.json"
cp "$results/h100-dcgan_step-b64-b4096.json" "$dir/src/step.json"
is_png() {
  local magic
  magic=$(head -c 8 "$1" | od -An -tx1 | tr -d ' \n')
  [ "$magic" = 89504e470d0a1a0a ] || { echo "$1 is not a PNG"; exit 1; }
}
src_before=$(ls -l --time-style=full-iso "$dir/src")
unchanged() {  # the folder of the records holds what it held, no chart beside them
  [ "$(ls -l --time-style=full-iso "$dir/src")" = "$src_before" ] ||
    { echo "$1: the record's folder changed:"; ls -l "$dir/src"; exit 1; }
}
# --out DIR: the chart goes there, named after the record.
out=$("$bench" strategy --redraw "$dir/src/strategy.json" --out "$dir/out")
grep -qx "wrote $dir/out/strategy.png" <<< "$out" || { echo "--out: $out"; exit 1; }
grep -qx "hierpar-bench: writing to $dir/out (--out)" <<< "$out" || { echo "--out: $out"; exit 1; }
is_png "$dir/out/strategy.png"
unchanged "--redraw --out"
[ ! -e "$dir/env" ] || { echo "--redraw --out also wrote to \$HIERPAR_BENCH_OUT"; exit 1; }
# No --out: $HIERPAR_BENCH_OUT.
out=$("$bench" dcgan_step --redraw "$dir/src/step.json")
grep -qx "wrote $dir/env/step.png" <<< "$out" || { echo "\$HIERPAR_BENCH_OUT: $out"; exit 1; }
is_png "$dir/env/step.png"
unchanged "--redraw, \$HIERPAR_BENCH_OUT"
# No --out, no HIERPAR_BENCH_OUT: ~/.cache/hierpar/bench (HOME a scratch folder here).
out=$(HIERPAR_BENCH_OUT='' HOME="$dir/home" "$bench" strategy --redraw "$dir/src/strategy.json")
grep -qx "wrote $dir/home/.cache/hierpar/bench/strategy.png" <<< "$out" || { echo "default folder: $out"; exit 1; }
is_png "$dir/home/.cache/hierpar/bench/strategy.png"
unchanged "--redraw, ~/.cache/hierpar/bench"
# A committed record redrawn in place leaves the committed folder as it was (the chart goes to the default folder).
results_before=$(ls -l --time-style=full-iso "$results")
"$bench" strategy --redraw "$results/h100x4-strategy-bf16.json" | grep -qx "wrote $dir/env/h100x4-strategy-bf16.png"
[ "$(ls -l --time-style=full-iso "$results")" = "$results_before" ] || { echo "--redraw changed $results"; exit 1; }
echo '{}' > "$dir/bad.json"
status=0
"$bench" strategy --redraw "$dir/bad.json" 2> "$dir/error" >/dev/null || status=$?
[ "$status" = 1 ] || { echo "a file that is not a record: exit $status, expected 1"; exit 1; }
grep -q "bad.json: not a hierpar-bench record" "$dir/error" || { cat "$dir/error"; exit 1; }
[ "$(wc -l < "$dir/error")" = 1 ] || { echo "the error is not one line:"; cat "$dir/error"; exit 1; }
echo "bench.redraw: both charts drawn into --out, \$HIERPAR_BENCH_OUT and ~/.cache/hierpar/bench, none beside" \
     "the record; the bad record refused"
