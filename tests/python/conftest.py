"""Shared set-up of hierpar's Python tests.

The package under test is the installed one (pip install ./bindings) or, when HIERPAR_OPS_LIBRARY names a
build tree's libhierpar_ops.so (as ctest sets it), bindings/ of this checkout.

Random shapes and values are drawn fresh on each run from a seed printed in pytest's header and in every
failure; HIERPAR_TEST_SEED=<seed> reproduces a run.
"""
import os
import random
import sys

import pytest
import torch

_BINDINGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings")
if os.environ.get("HIERPAR_OPS_LIBRARY") and os.path.abspath(_BINDINGS) not in map(os.path.abspath, sys.path):
    sys.path.insert(0, os.path.abspath(_BINDINGS))

import hierpar  # noqa: E402,F401

SEED = int(os.environ.get("HIERPAR_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return [f"hierpar: HIERPAR_TEST_SEED={SEED}; operator library {hierpar.library_path}"]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("hierpar", f"reproduce with HIERPAR_TEST_SEED={SEED}"))


@pytest.fixture(autouse=True)
def seeded(request):
    """Every test starts from the run's seed mixed with its own name, so one test's draws do not depend on
    which others ran before it."""
    seed = (SEED * 1000003 + sum(map(ord, request.node.nodeid))) % 2**31
    torch.manual_seed(seed)
    return random.Random(seed)


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))
DEVICES = ["cpu", CUDA]


def random_tensor(sizes, dtype=torch.float32, device="cpu", layout="contiguous", rng=None):
    """Standard-normal values (never zeros) in the given layout: "contiguous", "channels_last" or "strided"
    (a non-contiguous view: every other element of a wider tensor's last dimension)."""
    if layout == "strided":
        wide = list(sizes)
        wide[-1] *= 2
        return torch.randn(wide, dtype=torch.float64, device=device).to(dtype)[..., ::2]
    t = torch.randn(sizes, dtype=torch.float64, device=device).to(dtype)
    if layout == "channels_last" and t.dim() == 4:
        t = t.contiguous(memory_format=torch.channels_last)
    return t
