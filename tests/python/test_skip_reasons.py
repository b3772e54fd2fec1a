"""scripts/skip_reasons.py, which scripts/test runs after ctest: from CTest's JUnit report of a small CTest
project with a GoogleTest-style skip, a SKIP_RETURN_CODE skip, a pass and a failure, it prints each skip's reason
and test name, grouped by reason, and nothing for the others, then one line counting passes, failures and skips
(a skip never counted as a pass)."""
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
CTEST = os.environ.get("HIERPAR_CTEST") or shutil.which("ctest")
CMAKE = os.path.join(os.path.dirname(CTEST), "cmake") if CTEST else None

PROJECT = r"""
cmake_minimum_required(VERSION 3.21)
project(skips NONE)
enable_testing()
foreach(name IN ITEMS Gpu.One Gpu.Two)
  add_test(NAME ${name} COMMAND sh -c "echo 'x.cpp:12: Skipped'; echo 'no CUDA device on this machine'; echo '[  SKIPPED ] ${name} (0 ms)'")
  set_tests_properties(${name} PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
endforeach()
add_test(NAME python.none COMMAND sh -c "echo 'collecting'; echo 'pytest is not installed'; exit 77")
set_tests_properties(python.none PROPERTIES SKIP_RETURN_CODE 77)
add_test(NAME Cpu.Passes COMMAND sh -c "echo 'all fine'")
add_test(NAME Cpu.Fails COMMAND sh -c "echo 'a failure, not a skip'; exit 1")
"""


@pytest.mark.skipif(CTEST is None, reason="no ctest (HIERPAR_CTEST) to write a JUnit report")
def test_skip_reasons_are_printed_by_reason(tmp_path):
    (tmp_path / "CMakeLists.txt").write_text(PROJECT)
    subprocess.run([CMAKE, "-S", str(tmp_path), "-B", str(tmp_path / "build")], check=True, capture_output=True)
    junit = tmp_path / "junit.xml"
    ran = subprocess.run([CTEST, "--output-junit", str(junit)], cwd=tmp_path / "build", capture_output=True, text=True)
    assert ran.returncode != 0, "Cpu.Fails should fail ctest"
    printed = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "skip_reasons.py"), str(junit)],
                             check=True, capture_output=True, text=True).stdout
    assert printed.splitlines() == [
        "3 tests skipped, by reason:",
        "    2  no CUDA device on this machine",
        "       (Gpu.One, Gpu.Two)",
        "    1  pytest is not installed",
        "       (python.none)",
        "1 passed, 1 failed, 3 skipped",
    ], printed
