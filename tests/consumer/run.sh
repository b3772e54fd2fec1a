#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, then configures, builds and runs tests/consumer
# against it, as a user's project would. Arguments: build dir, cmake, Torch_DIR.
set -euo pipefail
build=$1 cmake=$2 torch_dir=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/hierpar-consumer.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$cmake" --install "$build" --prefix "$work/prefix" >/dev/null
"$cmake" -S "$(dirname "$0")" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DTorch_DIR="$torch_dir" \
  -DCMAKE_BUILD_TYPE=Release -DTORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" >/dev/null
"$cmake" --build "$work/build" -j 2 >/dev/null
"$work/build/consumer"
