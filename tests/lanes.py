"""make test's lanes: pytest-xdist workers that each run whole groups of tests, the longest group first.

A group is one lab guest's tests, or the host tests (tests/conftest.py gives each test its `xdist_group`
mark and orders the collection longest group first). A worker runs a group whole, so it owns that guest:
it boots it once and powers it off after the group's last test; an idle worker takes the next group in
collection order. The unit tests have no group: each is a unit of its own and fills whichever lane is idle.

Why not xdist's own `--dist loadgroup`: with pytest 9.2 it silently stops grouping. It appends the group to
each test's node id (`item._nodeid`), which pytest 9.2's structured node ids no longer read (pytest-xdist
issue 1386, open on 2026-12-01), so the tests of one guest spread over both workers and each boots its own
copy of it. Here each worker writes its plan (node id -> group) into a folder the controller made and
passed to it, before it reports its collection; the scheduler reads the plan when it schedules, which xdist
does only once every worker has reported. `--dist loadgroup` picks this scheduler (conftest.py's
`pytest_xdist_make_scheduler`), so the option means what it says with any pytest.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

PLAN_KEY = "gthulhu_lane_plan"  # the key of the plan folder in each worker's workerinput


def group_of(item: pytest.Item) -> str | None:
    """The xdist group tests/conftest.py gave the test, or None."""
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def new_plan_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="gthulhu-lanes-"))


def remove_plan_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def write_plan(folder: Path, worker: str, items: list[pytest.Item]) -> None:
    """This worker's plan, written whole (rename) so the controller never reads half of it."""
    plan = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    tmp = folder / f".{worker}.json"
    tmp.write_text(json.dumps(plan))
    os.replace(tmp, folder / f"{worker}.json")


def read_plan(folder: Path) -> dict[str, str]:
    """Every worker's plan (they are the same: xdist checks that the workers collected alike). Without one
    the guests' tests would spread over both workers, so that is an error, not a fallback."""
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise RuntimeError(f"no lane plan in {folder}: no worker wrote one (tests/conftest.py)")
    plan: dict[str, str] = {}
    for path in paths:
        plan.update(json.loads(path.read_text()))
    return plan


def make_scheduler(config: pytest.Config, log: Any, folder: Path) -> Any:
    """xdist's scope scheduler with our groups as scopes and our collection order kept (xdist would sort
    the groups by their number of tests, and 137 host tests of about a second each would go before the
    17-minute guest)."""
    from xdist.scheduler import LoadScopeScheduling  # type: ignore[import-untyped]

    class LaneScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist has no type information
        def __init__(self, config: pytest.Config, log: Any) -> None:
            super().__init__(config, log)
            self.config.option.loadscopereorder = False
            self._plan: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._plan is None:
                self._plan = read_plan(folder)
            return self._plan.get(nodeid, nodeid)

    return LaneScheduling(config, log)


class LaneClock:
    """Where each lane's time went: seconds per group on each worker and each worker's span from its first
    test to its last, from the reports the controller receives. make test prints it, so the next
    rebalancing starts from measured times rather than estimates."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._plan: dict[str, str] | None = None
        self.seconds: dict[str, dict[str, float]] = {}
        self.span: dict[str, tuple[float, float]] = {}

    def add(self, report: pytest.TestReport) -> None:
        node = getattr(report, "node", None)
        if node is None:  # not from a worker
            return
        if self._plan is None:
            self._plan = read_plan(self.folder)
        worker = str(node.gateway.id)
        group = self._plan.get(report.nodeid, "(unit)")
        per_group = self.seconds.setdefault(worker, {})
        per_group[group] = per_group.get(group, 0.0) + report.duration
        start, stop = getattr(report, "start", None), getattr(report, "stop", None)
        if start is not None and stop is not None:
            first, last = self.span.get(worker, (start, stop))
            self.span[worker] = (min(first, start), max(last, stop))

    def lines(self) -> list[str]:
        out = []
        for worker in sorted(self.seconds):
            first, last = self.span.get(worker, (0.0, 0.0))
            groups = ", ".join(f"{g} {s / 60:.1f} min" for g, s in self.seconds[worker].items())
            out.append(f"{worker}: {(last - first) / 60:.1f} min from its first test to its last: {groups}")
        return out
