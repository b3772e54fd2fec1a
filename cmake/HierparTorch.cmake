# Finds LibTorch 2.11.0, in this order:
#   1. Torch_DIR / CMAKE_PREFIX_PATH (the ordinary CMake way);
#   2. the torch that a Python imports (HIERPAR_PYTHON, /opt/torch/.venv, the cached venv, python3):
#      torch.utils.cmake_prefix_path;
#   3. with HIERPAR_INSTALL_TORCH (default ON): scripts/setup installs PyPI torch==2.11.0 into a cached
#      virtualenv outside the checkout (~/.cache/hierpar/torch-venv), reused by later builds.
# TORCH_CUDA_ARCH_LIST defaults to 9.0 (H100/H200) so nvcc builds for one architecture only.

set(HIERPAR_TORCH_VERSION 2.11.0)
option(HIERPAR_INSTALL_TORCH "Install PyPI torch==${HIERPAR_TORCH_VERSION} into a cached venv when none is found" ON)
set(HIERPAR_PYTHON "" CACHE FILEPATH "A Python whose torch provides LibTorch")

if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST} AND NOT TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "9.0")
endif()
if(NOT TORCH_CUDA_ARCH_LIST)
  set(TORCH_CUDA_ARCH_LIST "$ENV{TORCH_CUDA_ARCH_LIST}")
endif()
set(TORCH_CUDA_ARCH_LIST "${TORCH_CUDA_ARCH_LIST}" CACHE STRING "CUDA architectures to build for (PyTorch's syntax)")

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
