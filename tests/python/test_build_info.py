"""hierpar.cuda_arch_list / cuda_code_arch: what the loaded library holds code for, and which of it a GPU runs."""
import re

import pytest
import torch

import hierpar

ARCH = r"\d+\.\d[af]?(\+PTX)?"


def test_arch_list_names_architectures():
    archs = hierpar.cuda_arch_list()
    assert archs == torch.ops.hierpar.cuda_arch_list()
    assert re.fullmatch(rf"({ARCH}( {ARCH})*)?", archs), archs


def test_code_arch_of_a_missing_device_raises():
    message = "does not exist" if hierpar.cuda_arch_list() else "no CUDA kernels"
    with pytest.raises(RuntimeError, match=message):
        hierpar.cuda_code_arch(999)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_each_gpu_runs_code_of_the_build():
    built = {int(a.split("+")[0].replace(".", "").rstrip("af")) for a in hierpar.cuda_arch_list().split()}
    for d in range(torch.cuda.device_count()):
        code = hierpar.cuda_code_arch(d)
        m = re.fullmatch(r"(sm|compute)_(\d+)( \(PTX compiled by the driver for sm_\d+\))?", code)
        assert m and int(m[2]) in built, (code, built)
