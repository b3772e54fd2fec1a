#!/usr/bin/env bash
# ctest scripts.trace_compare: scripts/trace-compare on two synthetic traces of one step each, the same two kernels
# overlapped on two streams (old) and one after the other (new): the span and the busy union grow by the overlap, the
# kernels' time stays; a file without GPU events is one line and a non-zero exit.
#   bash tests/trace_compare_test.sh PYTHON SCRIPT
set -euo pipefail
python=$1 script=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
kernel() { echo "{\"cat\": \"kernel\", \"name\": \"void $1<float>(int)\", \"ts\": $2, \"dur\": $3, \"tid\": $4}"; }
echo "{\"traceEvents\": [$(kernel conv 0 100 7), $(kernel bn 50 100 8), {\"cat\": \"cpu_op\", \"name\": \"x\", \"ts\": 0, \"dur\": 999}]}" > "$dir/old.json"
echo "{\"traceEvents\": [$(kernel conv 0 100 7), $(kernel bn 100 100 7)]}" > "$dir/new.json"
out=$("$python" "$script" "$dir/old.json" "$dir/new.json" --steps 1)
echo "$out"
grep -Eq "^span \(first to last GPU event\) +150\.0 +200\.0 +\+50\.0$" <<< "$out" || { echo "span: expected 150 -> 200"; exit 1; }
grep -Eq "^busy \(union over streams\) +150\.0 +200\.0 +\+50\.0$" <<< "$out" || { echo "busy: expected 150 -> 200"; exit 1; }
grep -Eq "^sum of durations +200\.0 +200\.0 +\+0\.0$" <<< "$out" || { echo "sum: expected 200 in both"; exit 1; }
if grep -Eq "^ *[+-][0-9.]+ .* (conv|bn)$" <<< "$out"; then echo "no kernel changed its time"; exit 1; fi
echo '{"traceEvents": []}' > "$dir/empty.json"
status=0
"$python" "$script" "$dir/old.json" "$dir/empty.json" 2> "$dir/error" || status=$?
[ "$status" != 0 ] || { echo "a trace without GPU events: exit 0"; exit 1; }
grep -q "empty.json: no kernel, memset or copy events" "$dir/error" || { cat "$dir/error"; exit 1; }
[ "$(wc -l < "$dir/error")" = 1 ] || { echo "the error is not one line:"; cat "$dir/error"; exit 1; }
echo "scripts.trace_compare: span, union and sums as built; a trace without GPU events refused"
