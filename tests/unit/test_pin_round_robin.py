"""The sleeper bench's pinned hogs (tests/vm/engine_step_bench.pin_round_robin): each worker of a parent
bound to one CPU, round robin, on this host's real affinity interface."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.vm import engine_step_bench as esb

# a parent that starts `n` sleeping workers (its argv[1]) and waits for them
PARENT = ("import subprocess, sys; ps = [subprocess.Popen(['sleep', '30']) for _ in range(int(sys.argv[1]))];"
          " [p.wait() for p in ps]")


def test_each_worker_is_bound_to_one_cpu_round_robin() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "4"])
    try:
        placed = esb.pin_round_robin(parent.pid, 4)
        kids = esb.children(parent.pid)
        assert len(kids) == 4
        assert placed == [cpus[i % len(cpus)] for i in range(4)]
        assert [os.sched_getaffinity(k) for k in kids] == [{c} for c in placed]
    finally:
        for kid in esb.children(parent.pid):
            os.kill(kid, 9)
        parent.wait(timeout=10)


def test_missing_workers_raise_instead_of_pinning_some() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, "1"])
    try:
        deadline = time.monotonic() + 10
        while not esb.children(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(RuntimeError, match="1 of 3 workers"):
            esb.pin_round_robin(parent.pid, 3, timeout=1.0)
        assert [os.sched_getaffinity(k) for k in esb.children(parent.pid)] == [os.sched_getaffinity(0)]
    finally:
        for kid in esb.children(parent.pid):
            os.kill(kid, 9)
        parent.wait(timeout=10)
