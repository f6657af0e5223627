"""The sleeper bench's pinned hogs (tests/vm/engine_step_bench.pin_round_robin): each worker of a parent
bound to one CPU, round robin, on this host's real affinity interface."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.vm import engine_step_bench as esb

# a parent that starts `n` sleeping workers (its argv[1]) and waits for them
PARENT = ("import subprocess, sys; ps = [subprocess.Popen(['sleep', '30']) for _ in range(int(sys.argv[1]))];"
          " [p.wait() for p in ps]")


@contextmanager
def parent_of(n: int) -> Iterator[int]:
    """A parent of `n` sleeping workers in a process group of its own; the whole group killed after."""
    proc = subprocess.Popen([sys.executable, "-c", PARENT, str(n)], start_new_session=True)
    try:
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: a pin cannot be told from none")
def test_each_worker_is_bound_to_one_cpu_round_robin() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    with parent_of(4) as parent:
        placed = esb.pin_round_robin(parent, 4)
        kids = esb.children(parent)
        assert len(kids) == 4
        assert placed == [cpus[i % len(cpus)] for i in range(4)]
        assert [os.sched_getaffinity(k) for k in kids] == [{c} for c in placed]


def test_missing_or_extra_workers_raise_instead_of_pinning_some() -> None:
    with parent_of(2) as parent:
        deadline = time.monotonic() + 10
        while len(esb.children(parent)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="2 of 3 workers"):
            esb.pin_round_robin(parent, 3, timeout=1.0)
        with pytest.raises(RuntimeError, match=r"2 workers of \d+, not 1"):
            esb.pin_round_robin(parent, 1)
        assert [os.sched_getaffinity(k) for k in esb.children(parent)] == [os.sched_getaffinity(0)] * 2
