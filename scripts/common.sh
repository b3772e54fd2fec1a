# Sourced by the scripts: set-up, then configure and build in $HIERPAR_BUILD_DIR (default build/).
HIERPAR_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HIERPAR_BUILD_DIR=${HIERPAR_BUILD_DIR:-$HIERPAR_ROOT/build}
HIERPAR_JOBS=${HIERPAR_JOBS:-$(nproc)}
# Development builds compile for this machine's GPUs; with none (CI), for the oldest architecture torch supports
# and Hopper, so that every architecture guard and the sm_90a code are compiled. Installs default to every
# architecture torch supports (cmake/HierparTorch.cmake). TORCH_CUDA_ARCH_LIST overrides both.
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  if nvidia-smi -L >/dev/null 2>&1; then TORCH_CUDA_ARCH_LIST=native; else TORCH_CUDA_ARCH_LIST="7.5;9.0"; fi
fi
export TORCH_CUDA_ARCH_LIST

hierpar_setup() {  # installs what is missing; sets HIERPAR_PYTHON and puts its cmake first on PATH
  HIERPAR_PYTHON=$(bash "$HIERPAR_ROOT/scripts/setup") || { echo "set-up failed (see above)" >&2; exit 1; }
  export HIERPAR_PYTHON
  export PATH="$(dirname "$HIERPAR_PYTHON"):$PATH"
}

hierpar_build() {  # configure (once) and build the given targets (all when none)
  local generator=()
  command -v ninja >/dev/null && generator=(-G Ninja)
  local first=" (a first build of everything: ~9 min on 2 cores, docs/build.md)"
  [ -f "$HIERPAR_BUILD_DIR/CMakeCache.txt" ] && generator=() first=""  # an existing build keeps its generator
  echo "[build] configuring $HIERPAR_BUILD_DIR" >&2
  cmake -S "$HIERPAR_ROOT" -B "$HIERPAR_BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DHIERPAR_PYTHON="$HIERPAR_PYTHON" -DTORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" "${HIERPAR_CMAKE_ARGS[@]}" >&2
  echo "[build] building ${*:-everything} with $HIERPAR_JOBS jobs$first" >&2
  local targets=()
  for t in "$@"; do targets+=(--target "$t"); done
  cmake --build "$HIERPAR_BUILD_DIR" -j "$HIERPAR_JOBS" "${targets[@]}" >&2
}
