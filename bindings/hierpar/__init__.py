"""hierpar's operators and layers for PyTorch.

Importing the package loads the operator library (libhierpar_ops.so), which registers torch.ops.hierpar.*
with the dispatcher: CPU and CUDA kernels, Meta kernels (shape inference: FakeTensor, torch.compile,
torch.export) and Autograd kernels whose backward is the registered *_backward op. The functions below and
hierpar.nn's layers are thin, TorchScript-compatible calls of those ops.

The library is looked for in $HIERPAR_OPS_LIBRARY (e.g. a CMake build tree's libhierpar_ops.so), then next
to this file (where `pip install ./bindings` puts it).
"""

import os as _os

import torch as _torch


def _find_library() -> str:
    path = _os.environ.get("HIERPAR_OPS_LIBRARY")
    if path:
        if not _os.path.isfile(path):
            raise ImportError(f"hierpar: HIERPAR_OPS_LIBRARY={path!r} is not a file")
        return path
    path = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "libhierpar_ops.so")
    if not _os.path.isfile(path):
        raise ImportError(
            f"hierpar: the operator library {path} is missing. Install the package with "
            "`pip install --no-build-isolation ./bindings`, or point HIERPAR_OPS_LIBRARY at a built "
            "libhierpar_ops.so")
    return path


library_path: str = _find_library()
"""The libhierpar_ops.so that was loaded (C++ programs load the same file to run TorchScript using it)."""
_torch.ops.load_library(library_path)

from ._functional import batch_norm_act, conv2d, conv_transpose2d, max_pool2d, max_pool2d_with_indices  # noqa: E402
from . import nn  # noqa: E402


def cuda_arch_list() -> str:
    """The CUDA architectures the loaded library holds code for, e.g. '7.5 8.0 8.6 9.0 10.0 12.0+PTX'."""
    return _torch.ops.hierpar.cuda_arch_list()


def cuda_code_arch(device: int = 0) -> str:
    """The code GPU `device` runs hierpar's kernels from: 'sm_90', or 'compute_80 (PTX compiled by the driver
    for sm_90)'. Raises, naming the GPU and cuda_arch_list(), when the library has no code that GPU can run."""
    return _torch.ops.hierpar.cuda_code_arch(device)


__all__ = ["batch_norm_act", "conv2d", "conv_transpose2d", "cuda_arch_list", "cuda_code_arch", "max_pool2d",
           "max_pool2d_with_indices", "nn", "library_path"]
__version__ = "0.1.0"
