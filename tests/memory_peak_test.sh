#!/usr/bin/env bash
# ctest scripts.memory_peak: scripts/memory-peak on a synthetic snapshot (PyTorch's format: per-device lists of
# alloc / free_requested / free_completed events with their frames): the peak is the largest total of live
# allocations, a free counts at its free_completed, and the live ones are grouped by hierpar frame and ATen operator;
# a file that is not a snapshot is one line and a non-zero exit.
#   bash tests/memory_peak_test.sh PYTHON SCRIPT
set -euo pipefail
python=$1 script=$2
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
"$python" - "$dir/snap.pickle" <<'PY'
import pickle, sys
def frames(op, ours):
    return [{"name": "c10::cuda::CUDACachingAllocator::malloc", "filename": "", "line": 0},
            {"name": "at::_ops::empty_strided::call", "filename": "", "line": 0},
            {"name": f"at::_ops::{op}::call(at::Tensor const&)", "filename": "", "line": 0},
            {"name": ours, "filename": "", "line": 0},
            {"name": "main", "filename": "", "line": 0}]
conv = frames("convolution", "hierpar::models::DiscriminatorImpl::forward(at::Tensor const&)")
bn = frames("native_batch_norm", "hierpar::nn::RecomputeBackward::apply(std::vector<at::Tensor>&&)")
MiB = 1 << 20
events = [
    {"action": "alloc", "addr": 1, "size": 100 * MiB, "frames": conv, "time_us": 0},
    {"action": "alloc", "addr": 2, "size": 50 * MiB, "frames": bn, "time_us": 10},
    {"action": "free_requested", "addr": 1, "size": 100 * MiB, "frames": conv, "time_us": 20},
    {"action": "alloc", "addr": 3, "size": 30 * MiB, "frames": bn, "time_us": 30},  # peak 180: 1 still held
    {"action": "free_completed", "addr": 1, "size": 100 * MiB, "frames": conv, "time_us": 40},
    {"action": "alloc", "addr": 4, "size": 90 * MiB, "frames": conv, "time_us": 50},  # 170: below the peak
]
pickle.dump({"segments": [], "device_traces": [[], events]}, open(sys.argv[1], "wb"))
PY
out=$("$python" "$script" "$dir/snap.pickle")
echo "$out"
grep -Eq "^cuda:1: 6 events; peak 0\.176 GiB allocated at event 3, 0\.000 s after the recording began; 3 allocations alive then$" <<< "$out" ||
  { echo "peak: expected 180 MiB at event 3 with 3 alive"; exit 1; }
grep -Eq "^ +0\.098 GiB +55\.6% +1  convolution / hierpar::models::DiscriminatorImpl::forward$" <<< "$out" ||
  { echo "the convolution's 100 MiB, first"; exit 1; }
grep -Eq "^ +0\.078 GiB +44\.4% +2  native_batch_norm / hierpar::nn::RecomputeBackward::apply$" <<< "$out" ||
  { echo "the two batch norm allocations, together"; exit 1; }
if grep -q "cuda:0" <<< "$out"; then echo "a device without events is listed"; exit 1; fi
echo "not a pickle" > "$dir/bad.pickle"
status=0
"$python" "$script" "$dir/bad.pickle" 2> "$dir/error" || status=$?
[ "$status" != 0 ] || { echo "a file that is not a snapshot: exit 0"; exit 1; }
grep -q "^memory-peak: .*bad.pickle" "$dir/error" || { cat "$dir/error"; exit 1; }
[ "$(wc -l < "$dir/error")" = 1 ] || { echo "the error is not one line:"; cat "$dir/error"; exit 1; }
echo "scripts.memory_peak: the peak, its live allocations by frame and operator; a bad file refused"
