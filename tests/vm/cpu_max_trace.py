"""A diagnostic, run by hand in the lab guest: a lone hog under a quota below one tick (cpu.max 3000/100000),
after the limit changes of the lab's cpu.max scenario, measured three ways in the same windows: the CPU it
held by sched_switch timestamps (tracefs), the run time the kernel accounted (schedstat) and the work it
did against its own rate without a limit. EEVDF, then ours unboosted, then ours boosted.

    make lab-run CMD=".venv/bin/python -m tests.vm.cpu_max_trace"

Figures and what they showed: docs/scheduler.md, "cpu.max".
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from gthulhu_node.backends.base import Entry, KeyKind
from gthulhu_node.config import SchedulerConfig
from gthulhu_node.limits import boost_levels_strongest_first
from gthulhu_node.scheduler.backend import SchedExtBackend
from tests.vm.sched_workloads import (
    BW_PERIOD_S,
    WorkCounter,
    _cgroup_at,
    _hogs_in,
    _remove_cgroups,
    key_for,
    run_ns,
    workers,
)
from tests.vm.switch_trace import switches

LIMITS = ("20000 100000", "50000 100000", "10000 100000", "3000 100000")


def held_share(pid: int, seconds: float, work: WorkCounter) -> dict[str, float]:
    """One window: the share by sched_switch timestamps, by schedstat and by work."""
    with switches([pid]) as seen:
        run0, t0 = run_ns(pid), time.monotonic()
        rate = work.rate(seconds)
        elapsed = time.monotonic() - t0
        run1 = run_ns(pid)
    return {"switch": round(seen.seconds(pid) / elapsed, 4),
            "schedstat": round((run1 - run0) / 1e9 / elapsed, 4), "work": round(rate / work.full_rate, 4)}


def windows(cg: Path, pid: int, work: WorkCounter, count: int = 3) -> list[dict[str, float]]:
    (cg / "cpu.max").write_text("max 100000")
    time.sleep(BW_PERIOD_S)
    work.full_rate = work.rate(1.0)
    for limit in LIMITS:
        (cg / "cpu.max").write_text(limit)
        time.sleep(1.0)
    return [held_share(pid, 2.0, work) for _ in range(count)]


def main() -> None:
    out: dict[str, Any] = {}
    cg = _cgroup_at("gthulhu-bw-trace", {})
    work = WorkCounter()
    with workers() as pids:
        pid = _hogs_in(cg, "traced", 1, pids, work.body)["traced0"]
        out["eevdf"] = windows(cg, pid, work)
        backend = SchedExtBackend(SchedulerConfig(), protect_agent=False)
        backend.start()
        try:
            out["ours"] = windows(cg, pid, work)
            key, start = key_for(KeyKind.TID, pid)
            backend.apply({key: Entry(boost_levels_strongest_first()[0], 0, start)}, [])
            out["ours_boosted"] = windows(cg, pid, work)
        finally:
            backend.stop()
    _remove_cgroups(cg)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
