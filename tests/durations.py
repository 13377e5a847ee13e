"""Each test file's time in one `make test` run (tests/durations.json), which `conftest.py` hands to pytest-xdist
longest first, so that the workers end together instead of one waiting while another runs the last long files.

Refresh it after a run that wrote JUnit XML::

    PYTEST_ADDOPTS=--junitxml=/tmp/junit.xml make test
    .venv/bin/python -m tests.durations /tmp/junit.xml

A file missing from it (a new one) is handed out first, as if it were the longest; a stale figure only makes the end of
the run less even, never a test fail.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

DURATIONS = Path(__file__).resolve().parent / "durations.json"


def load() -> dict[str, float]:
    """File name -> seconds; empty when the file is missing or unreadable."""
    try:
        table = json.loads(DURATIONS.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {str(name): float(seconds) for name, seconds in table.items()} if isinstance(table, dict) else {}


def from_junit(path: Path) -> dict[str, float]:
    """Seconds per test file from JUnit XML (a test's time there is its set-up, call and teardown together)."""
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).iter("testcase"):
        module = (case.get("classname") or "").split(".")
        if len(module) >= 2 and module[0] == "tests":
            seconds[f"{module[1]}.py"] += float(case.get("time") or 0)
    return {name: round(total, 1) for name, total in sorted(seconds.items())}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m tests.durations JUNIT.xml")
    table = from_junit(Path(sys.argv[1]))
    DURATIONS.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")
    sys.stdout.write(f"{len(table)} files, {sum(table.values()):.0f} s in all, written to {DURATIONS}\n")
