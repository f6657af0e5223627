"""The lanes' grouping (tests/conftest.py) of the real lab tests: each guest's tests form one xdist group,
a file with its own guest instance (`lab_guest`) forms its own, and the groups are ordered longest first
by their estimates (`lab_seconds` where a test says what it costs)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def groups() -> list[tuple[str, str]]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p",
                          "no:cacheprovider", "-p", "tests.unit.print_lab_groups", "tests/vm"],
                         cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("GROUP ")]
    return [(row[1], row[2]) for row in rows]


def test_the_safety_suite_runs_on_guests_of_its_own(groups: list[tuple[str, str]]) -> None:
    safety = {g for node, g in groups if "test_scheduler_safety.py" in node}
    assert safety == {"plain:7.3/2cpu#safety", "plain:6.12/2cpu#safety", "plain:7.3/8cpu-2numa",
                      "plain:7.3/2cpu-64possible"}
    # the rest of the scheduler suite stays on the shared guests
    assert {g for node, g in groups if "test_scheduler.py" in node} == {"plain:7.3/2cpu", "plain:6.12/2cpu"}


def test_groups_run_whole_and_longest_first(groups: list[tuple[str, str]]) -> None:
    order = [g for _, g in groups]
    seen: list[str] = []
    for g in order:
        if not seen or seen[-1] != g:
            assert g not in seen, f"group {g} is split: {order}"
            seen.append(g)
    # the package's install test (10 minutes) puts the systemd guest ahead of the short groups
    assert seen.index("systemd:7.3/2cpu") < seen.index("plain:7.3/8cpu-2numa")
