# Finds LibTorch 2.11.0, in this order:
#   1. Torch_DIR / CMAKE_PREFIX_PATH (the ordinary CMake way);
#   2. the torch that a Python imports (HIERPAR_PYTHON, /opt/torch/.venv, the cached venv, python3):
#      torch.utils.cmake_prefix_path;
#   3. with HIERPAR_INSTALL_TORCH (default ON): scripts/setup installs PyPI torch==2.11.0 into a cached
#      virtualenv outside the checkout (~/.cache/hierpar/torch-venv), reused by later builds.
# Also resolves TORCH_CUDA_ARCH_LIST, the CUDA architectures to build for (PyTorch's syntax; -D, else the
# environment), before LibTorch's config turns it into nvcc flags:
#   unset or "torch"  every architecture the installed torch was built for (torch._C._cuda_getArchFlags()), with
#                     PTX for the newest so later GPUs JIT-compile it: what installs and the Python package get;
#   "native"          the GPUs of this machine (nvidia-smi): a development build (scripts/common.sh's default);
#   a list            e.g. "8.0;9.0" or "8.0+PTX", as PyTorch reads it.
# docs/architectures.md says what each architecture runs and what the list costs in build time.

set(HIERPAR_TORCH_VERSION 2.11.0)
option(HIERPAR_INSTALL_TORCH "Install PyPI torch==${HIERPAR_TORCH_VERSION} into a cached venv when none is found" ON)
set(HIERPAR_PYTHON "" CACHE FILEPATH "A Python whose torch provides LibTorch")
set(TORCH_CUDA_ARCH_LIST "" CACHE STRING
    "CUDA architectures (PyTorch's syntax), 'native' (this machine's GPUs), or empty: every one torch supports")
# What LibTorch 2.11.0's CUDA 13.0 wheels hold: the default when no Python with torch can be asked.
set(HIERPAR_TORCH_WHEEL_ARCHS "7.5;8.0;8.6;9.0;10.0;12.0")

function(_hierpar_torch_prefix_from_python python out_var)
  execute_process(
    COMMAND "${python}" -c "import torch; print(torch.__version__.split('+')[0]); print(torch.utils.cmake_prefix_path)"
    OUTPUT_VARIABLE _out RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(${out_var} "" PARENT_SCOPE)
  if(_rc EQUAL 0)
    string(REPLACE "\n" ";" _lines "${_out}")
    list(GET _lines 0 _version)
    list(GET _lines 1 _prefix)
    if(_version VERSION_EQUAL HIERPAR_TORCH_VERSION)
      set(${out_var} "${_prefix}" PARENT_SCOPE)
      set(HIERPAR_TORCH_PYTHON "${python}" CACHE FILEPATH "The Python whose torch was used" FORCE)
    else()
      message(STATUS "hierpar: ${python} has torch ${_version}, not ${HIERPAR_TORCH_VERSION}; skipped")
    endif()
  endif()
endfunction()

function(_hierpar_find_torch_python out_var)
  set(_candidates "${HIERPAR_PYTHON}" "/opt/torch/.venv/bin/python3")
  if(DEFINED ENV{HIERPAR_CACHE})
    list(APPEND _candidates "$ENV{HIERPAR_CACHE}/torch-venv/bin/python3")
  endif()
  list(APPEND _candidates "$ENV{HOME}/.cache/hierpar/torch-venv/bin/python3")
  find_program(_python3 NAMES python3 NO_CACHE)
  list(APPEND _candidates "${_python3}")
  foreach(_py IN LISTS _candidates)
    if(_py AND EXISTS "${_py}")
      _hierpar_torch_prefix_from_python("${_py}" _prefix)
      if(_prefix)
        set(${out_var} "${_prefix}" PARENT_SCOPE)
        return()
      endif()
    endif()
  endforeach()
  set(${out_var} "" PARENT_SCOPE)
endfunction()

# torch's own architecture list ("7.5;...;12.0"), from the first Python whose torch is the pinned version.
function(_hierpar_torch_arch_list out_var)
  set(${out_var} "" PARENT_SCOPE)
  set(_candidates "${HIERPAR_PYTHON}" "/opt/torch/.venv/bin/python3")
  if(DEFINED ENV{HIERPAR_CACHE})
    list(APPEND _candidates "$ENV{HIERPAR_CACHE}/torch-venv/bin/python3")
  endif()
  list(APPEND _candidates "$ENV{HOME}/.cache/hierpar/torch-venv/bin/python3")
  foreach(_py IN LISTS _candidates)
    if(_py AND EXISTS "${_py}")
      execute_process(
        COMMAND "${_py}" -c "import torch; assert torch.__version__.startswith('${HIERPAR_TORCH_VERSION}'); print(';'.join(f[3:-1] + '.' + f[-1] for f in torch._C._cuda_getArchFlags().split() if f.startswith('sm_')))"
        OUTPUT_VARIABLE _archs RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
      if(_rc EQUAL 0 AND _archs)
        set(${out_var} "${_archs}" PARENT_SCOPE)
        return()
      endif()
    endif()
  endforeach()
endfunction()

function(_hierpar_resolve_cuda_archs)
  set(_request "${TORCH_CUDA_ARCH_LIST}")
  if(_request STREQUAL "" AND DEFINED ENV{TORCH_CUDA_ARCH_LIST})
    set(_request "$ENV{TORCH_CUDA_ARCH_LIST}")
  endif()
  if(_request STREQUAL "" OR _request STREQUAL "torch")
    _hierpar_torch_arch_list(_archs)
    if(NOT _archs)
      set(_archs "${HIERPAR_TORCH_WHEEL_ARCHS}")
    endif()
    list(POP_BACK _archs _newest)
    list(APPEND _archs "${_newest}+PTX")
    set(_how "every architecture torch ${HIERPAR_TORCH_VERSION} supports")
  elseif(_request STREQUAL "native")
    execute_process(COMMAND nvidia-smi --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE _caps RESULT_VARIABLE _rc ERROR_QUIET OUTPUT_STRIP_TRAILING_WHITESPACE)
    string(REGEX MATCHALL "[0-9]+\\.[0-9]+" _archs "${_caps}")
    list(REMOVE_DUPLICATES _archs)
    if(NOT _rc EQUAL 0 OR NOT _archs)
      message(FATAL_ERROR "TORCH_CUDA_ARCH_LIST=native: nvidia-smi found no GPU on this machine. Name the "
                          "architectures instead (e.g. -DTORCH_CUDA_ARCH_LIST=\"8.0;9.0\"), or leave it empty "
                          "for every architecture torch supports.")
    endif()
    set(_how "the GPUs of this machine")
  else()
    set(_archs "${_request}")
    set(_how "as requested")
  endif()
  list(SORT _archs COMPARE NATURAL)  # one spelling per set: compiler caches keyed on the flags stay warm
  # A normal variable: it shadows the cache entry, which keeps the request ("", "native") for the next configure.
  set(TORCH_CUDA_ARCH_LIST "${_archs}" PARENT_SCOPE)
  message(STATUS "hierpar: CUDA architectures ${_archs} (${_how})")
endfunction()
_hierpar_resolve_cuda_archs()

find_package(Torch ${HIERPAR_TORCH_VERSION} QUIET)
if(NOT Torch_FOUND)
  _hierpar_find_torch_python(_torch_prefix)
  if(NOT _torch_prefix AND HIERPAR_INSTALL_TORCH)
    message(STATUS "hierpar: no LibTorch ${HIERPAR_TORCH_VERSION} found; running scripts/setup to install it")
    execute_process(COMMAND bash "${PROJECT_SOURCE_DIR}/scripts/setup" RESULT_VARIABLE _rc)
    if(_rc EQUAL 0)
      _hierpar_find_torch_python(_torch_prefix)
    endif()
  endif()
  if(NOT _torch_prefix)
    message(FATAL_ERROR
      "hierpar needs LibTorch ${HIERPAR_TORCH_VERSION}. Point Torch_DIR or CMAKE_PREFIX_PATH at it, set "
      "HIERPAR_PYTHON to a Python whose torch is ${HIERPAR_TORCH_VERSION}, or run scripts/setup.")
  endif()
  list(APPEND CMAKE_PREFIX_PATH "${_torch_prefix}")
  find_package(Torch ${HIERPAR_TORCH_VERSION} REQUIRED)
endif()
message(STATUS "hierpar: LibTorch ${Torch_VERSION} from ${Torch_DIR}")
