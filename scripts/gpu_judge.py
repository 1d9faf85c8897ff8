"""A pytest step's verdict in the GPU check (`scripts/gpu_check.sh`), from what it left behind: the
number of tests it was to run (written at collection, tests/conftest.py's pytest_collection_finish),
pytest's junit xml and the step's exit status.

A step passes only when the junit xml counts every collected test, none failed, errored or was
skipped (a skip on a device means no CUDA or no FlashInfer: nothing was checked). A step cut at its
time limit (124 or 137, SIGINT then SIGKILL) has a junit xml of the tests that finished only: it is
a TIMEOUT saying how many of how many ran, unless every one of them had (the interpreter's exit, a
CUDA teardown, ran past the limit).

    python scripts/gpu_judge.py COLLECTED_FILE JUNIT_XML EXIT_STATUS [--dry]   # prints the verdict; exit 0: a pass

`--dry` (the check's dry run, on a machine without a device): the same count, from the real pytest
run, where every gpu test skips; skips are then expected and said, failures and errors still fail.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

TIMED_OUT = (124, 137)  # timeout(1)'s own status, and a kill after its grace


@dataclass(frozen=True)
class Junit:
    tests: int = 0
    failures: int = 0
    errors: int = 0
    skipped: int = 0

    @classmethod
    def read(cls, path: Path) -> Junit | None:
        """The counts of pytest's junit xml; None where it is missing or does not parse (a step
        killed before pytest wrote it)."""
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            return None
        suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
        total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
        return cls(**total)


def collected(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def verdict(expected: int | None, junit: Junit | None, status: int, dry: bool = False) -> tuple[bool, str]:
    """(passed, the summary's words) for a step that was to run `expected` tests."""
    if expected is None:
        return False, f"FAILED (exit {status}; pytest collected nothing: see its log)"
    ran = junit.tests if junit is not None else 0
    of = f"{ran} of {expected} tests ran"
    if dry and junit is not None and junit.skipped:  # no device: every gpu test skips, as it should here
        of += f", {junit.skipped} skipped without a device"
        junit = Junit(junit.tests, junit.failures, junit.errors, 0)
    bad = junit is not None and (junit.failures or junit.errors or junit.skipped)
    if junit is not None and bad:
        parts = (f"{junit.failures} failed", f"{junit.errors} errors", f"{junit.skipped} skipped")
        return False, f"FAILED ({of}; {', '.join(parts)})"
    if status in TIMED_OUT:
        if ran == expected and expected > 0:
            return True, f"ok ({of}; timed out on exit)"
        return False, f"TIMEOUT ({of})"
    if status != 0:
        return False, f"FAILED (exit {status}; {of})"
    if expected == 0:
        return False, "FAILED (no test selected)"
    if ran != expected:
        return False, f"FAILED ({of}: the junit xml misses some)"
    return True, f"ok ({of})"


def main(argv: list[str]) -> int:
    passed, words = verdict(collected(Path(argv[0])), Junit.read(Path(argv[1])), int(argv[2]), "--dry" in argv[3:])
    print(words)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
