"""ctest's entry to the Python tests: pytest on the given test files (default: this folder), or exit code 77
(ctest: skipped) when the Python that has torch lacks pytest."""
import importlib.util
import os
import sys

if importlib.util.find_spec("pytest") is None:
    print(f"pytest is not installed for {sys.executable}: the Python tests are skipped")
    sys.exit(77)

import pytest  # noqa: E402

sys.exit(pytest.main([*(sys.argv[1:] or [os.path.dirname(os.path.abspath(__file__))]), "-q", "-p", "no:cacheprovider"]))
