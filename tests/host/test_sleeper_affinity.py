"""The sleeper bench's measuring thread (tests/vm/sleeper_bench.py, Sleeper) with the real cyclictest on this
machine: pinned by cyclictest itself, or widened to every CPU with `pinned=False` (issue 40's figures
measured the pinned thread unknowingly; docs/benchmarks.md, "What unboosted work pays")."""

from __future__ import annotations

import os

import pytest

from tests.vm.sleeper_bench import Sleeper

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="cyclictest locks its memory (-m): root")


def test_cyclictest_pins_its_measuring_thread_and_the_unpinned_sleeper_runs_free() -> None:
    cpus = len(os.sched_getaffinity(0))
    if cpus < 2:
        pytest.skip("one CPU: pinned and free are the same")
    pinned = Sleeper(2, own_session=False).result()
    free = Sleeper(2, own_session=False, pinned=False).result()
    assert pinned["sleeper_cpus"] == 1, pinned
    assert free["sleeper_cpus"] == cpus, free
    # 2 s at a 5 ms period: about 400 wake-ups each, measured throughout, the widened thread's too
    assert pinned["samples"] >= 200 and free["samples"] >= 200, (pinned, free)
