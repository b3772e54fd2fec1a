"""Prints why each skipped test was skipped, from CTest's JUnit report (ctest --output-junit FILE), grouped by
reason, then one line "N passed, N failed, N skipped". CTest's own summary counts a skipped test as passed and names
it without saying why; GoogleTest prints the reason after "Skipped", and a test that exits with its SKIP_RETURN_CODE
says it on its last line.

usage: python3 scripts/skip_reasons.py build/Testing/junit.xml
"""
import re
import sys
import xml.etree.ElementTree as ET
from collections import OrderedDict

SHOWN_NAMES = 6


def reason_of(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    # GoogleTest: "<file>:<line>: Skipped", the message, then "[  SKIPPED ] <test>".
    for i, line in enumerate(lines):
        if re.search(r":\d+: Skipped$", line):
            message = []
            for follow in lines[i + 1:]:
                if follow.startswith("[  SKIPPED ]"):
                    break
                message.append(follow)
            return " ".join(message) or "(GoogleTest gave no reason)"
    return lines[-1] if lines else "(no output)"


def skipped_tests(junit_path: str):
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            yield case.get("name"), reason_of(case.findtext("system-out") or "")


def counts(junit_path: str):
    """(passed, failed, skipped) over the report's test cases; a skipped test is never counted as passed."""
    passed = failed = skipped = 0
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            skipped += 1
        elif case.find("failure") is not None or case.find("error") is not None or case.get("status") == "fail":
            failed += 1
        else:
            passed += 1
    return passed, failed, skipped


def main(argv) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    by_reason = OrderedDict()
    for name, reason in skipped_tests(argv[1]):
        by_reason.setdefault(reason, []).append(name)
    total = sum(len(names) for names in by_reason.values())
    if total:
        print(f"{total} test{'s' if total != 1 else ''} skipped, by reason:")
    for reason, names in by_reason.items():
        shown = ", ".join(names[:SHOWN_NAMES]) + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")
        print(f"  {len(names):3d}  {reason}\n       ({shown})")
    passed, failed, skipped = counts(argv[1])
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
