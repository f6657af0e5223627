"""What the lab VM costs: boot times and the per-command round trip (docs/lab.md).

Baseline: the same commands run on the host with subprocess (a fork+exec without the VM); the lab's
figures are shown next to it as ratios. Every figure moves with the machine's load (TCG shares the two
cores with everything else), so the load average is printed too.
Run: `make bench` (or `.venv/bin/python -m pytest -m bench -s tests/bench/test_lab_bench.py`).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time
from collections.abc import Callable

import pytest

from tests.vm.lab import REPO, Lab

pytestmark = pytest.mark.bench


def median_s(fn: Callable[[], object], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_lab_costs() -> None:
    venv_python = str(REPO / ".venv/bin/python")
    host_true = median_s(lambda: subprocess.run(["bash", "-c", "true"], check=True), 10)
    host_import = median_s(lambda: subprocess.run([venv_python, "-c", "import gthulhu_node"], check=True), 3)
    print(f"\nload average before: {os.getloadavg()}")
    with Lab() as lab:
        assert lab.boot_seconds is not None
        print(f"plain boot (start() until the agent answered): {lab.boot_seconds:.1f} s")
        lab_true = median_s(lambda: lab.run("true").check(), 10)
        lab_import = median_s(lambda: lab.python("-c", "import gthulhu_node").check(), 3)
        print(f"run('true'): {lab_true * 1e3:.0f} ms (host bash -c true {host_true * 1e3:.1f} ms, "
              f"x{lab_true / host_true:.0f})")
        print(f"venv python import gthulhu_node: {lab_import:.2f} s (host {host_import:.2f} s, "
              f"x{lab_import / host_import:.1f})")
        mb = median_s(lambda: lab.run("head -c 4000000 /dev/zero").check(), 3)
        print(f"4 MB of stdout: {mb:.2f} s ({4 / mb:.1f} MB/s)")
    with Lab("systemd") as lab:
        assert lab.boot_seconds is not None
        print(f"systemd boot (until is-system-running={lab.systemd_state}): {lab.boot_seconds:.1f} s")
    print(f"load average after: {os.getloadavg()}")
