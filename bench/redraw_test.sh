#!/usr/bin/env bash
# ctest bench.redraw: `hierpar-bench SUITE --redraw RECORD.json` draws the strategy and dcgan_step charts again from
# committed records (in a scratch folder, no GPU), and a file that is not a record is one line and exit 1.
#   bash bench/redraw_test.sh HIERPAR_BENCH RESULTS_DIR
set -euo pipefail
bench=$1 results=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cp "$results/h100x4-strategy-bf16.json" "$dir/strategy.json"
cp "$results/h100-dcgan_step-b64-b4096.json" "$dir/step.json"
"$bench" strategy --redraw "$dir/strategy.json" | grep -qx "wrote $dir/strategy.png"
"$bench" dcgan_step --redraw "$dir/step.json" | grep -qx "wrote $dir/step.png"
for png in strategy step; do
  magic=$(head -c 8 "$dir/$png.png" | od -An -tx1 | tr -d ' \n')
  [ "$magic" = 89504e470d0a1a0a ] || { echo "$png.png is not a PNG"; exit 1; }
done
echo '{}' > "$dir/bad.json"
status=0
"$bench" strategy --redraw "$dir/bad.json" 2> "$dir/error" || status=$?
[ "$status" = 1 ] || { echo "a file that is not a record: exit $status, expected 1"; exit 1; }
grep -q "bad.json: not a hierpar-bench record" "$dir/error" || { cat "$dir/error"; exit 1; }
[ "$(wc -l < "$dir/error")" = 1 ] || { echo "the error is not one line:"; cat "$dir/error"; exit 1; }
echo "bench.redraw: both charts drawn, the bad record refused"
