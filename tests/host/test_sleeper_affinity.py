"""Where the sleeper bench's measuring thread may run (tests/vm/sleeper_bench.py, Sleeper), with the real
cyclictest on this machine: cyclictest pins that thread to one CPU by itself (no `-a` given), which every
sleeper figure before 2026-12-07 measured, and `Sleeper(pinned=False)` frees it on every CPU the process
may use, as a daemon's thread runs (issue 40: a thread pinned to the boosted engine's CPU waits for the
engine's burst by design, one free to move does not have to)."""

from __future__ import annotations

import os

from tests.vm.sleeper_bench import Sleeper


def test_cyclictest_pins_its_measuring_thread_and_the_unpinned_sleeper_runs_free() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert cpus >= 2, "the measurement needs two CPUs to tell pinned from free"
    pinned = Sleeper(2, own_session=False, histogram=False)
    pinned_out = pinned.result()
    free = Sleeper(2, own_session=False, histogram=False, pinned=False)
    free_out = free.result()
    assert pinned_out["sleeper_cpus"] == 1, pinned_out
    assert free_out["sleeper_cpus"] == cpus, free_out
    # both measured: the widened thread kept waking on its period
    assert pinned_out["max_us"] > 0 and free_out["max_us"] > 0
