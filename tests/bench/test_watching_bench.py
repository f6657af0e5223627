"""Watching benchmarks on this machine's kernel (dry run): reaction latency against the proc connector's
own delivery floor, full snapshot cost against `cat /proc/*/task/*/comm`, and a 100,000-thread storm.

Run with `make bench` (or `.venv/bin/python -m pytest -m bench -s tests/bench/test_watching_bench.py`).
Each prints its figures and ratios; the only assertions are correctness (nothing missed, nothing leaked).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.backends.dryrun import RecordReader
from gthulhu_node.tasks.procfs import snapshot
from tests.bench.watchbench import Role, workload

pytestmark = pytest.mark.bench

HELPER = [sys.executable, "-m", "tests.bench.watchbench"]
REPO = Path(__file__).resolve().parents[2]
# This 2-core machine is shared (other people's emulated VMs: load 5-25). Measured there, a nice -10 agent
# waited up to 80 ms on the run queue with its work in hand (docs/watching.md), which is the host's noise,
# not the agent's cost. So the agent, the reader and the floor listener run SCHED_FIFO (only these processes,
# started by the benchmark); the workload stays SCHED_OTHER. Same priority for all three: a fair comparison.
# GTHULHU_BENCH_PRIO=--nice=0 measures them as ordinary processes instead.
NICE = os.environ.get("GTHULHU_BENCH_PRIO", "--fifo=10")


@pytest.fixture
def roles() -> Iterator[list[Role]]:
    started: list[Role] = []
    yield started
    for r in started:
        r.kill()


def test_reaction_latency() -> None:
    """1,000 renames and 1,000 thread starts; agent vs floor, both seen from other processes."""
    r = subprocess.run(
        [*HELPER, "latency", "--backend=dry-run", f"--prio={NICE}", "--count=1000"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    print("\n" + r.stdout + r.stderr)
    assert r.returncode == 0
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["missed"] == {"rename": 0, "spawn": 0}, "entries never seen by the reader"
    assert result["agent"]["events_lost"] == 0
    print(
        f"  goal p99 <= 5 ms: rename {result['rows']['rename agent']['p99_ms']:.3f} ms, "
        f"spawn {result['rows']['spawn agent']['p99_ms']:.3f} ms"
    )


def test_snapshot_cost(roles: list[Role]) -> None:
    holder = Role("hold", "--count=20000")
    roles.append(holder)

    def timed(fn: Any) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def cat() -> None:
        # threads of other processes may vanish between the glob and the read: cat then exits 1
        subprocess.run(["sh", "-c", "cat /proc/*/task/*/comm > /dev/null 2>&1"], check=False)

    tasks = len(snapshot().tasks)
    cat_s = sorted(timed(cat) for _ in range(7))
    snap_s = sorted(timed(snapshot) for _ in range(7))
    cat_us = statistics.median(cat_s) / tasks * 1e6
    snap_us = statistics.median(snap_s) / tasks * 1e6
    print(f"\nfull snapshot, {tasks} tasks (20,000 threads held by one process), median of 7")
    print(f"  cat /proc/*/task/*/comm   {statistics.median(cat_s) * 1000:8.1f} ms  {cat_us:6.2f} us/task")
    print(f"  procfs.snapshot()         {statistics.median(snap_s) * 1000:8.1f} ms  {snap_us:6.2f} us/task")
    print(f"  ratio snapshot / cat = {snap_us / cat_us:.2f}x   (goal <= 2x)")
    assert tasks >= 20_000


def test_thread_storm(tmp_path: Path, roles: list[Role]) -> None:
    record = tmp_path / "record"
    agent = Role("agent", f"--record={record}", NICE)
    roles.append(agent)
    storm = workload("storm", tmp_path / "storm.json", count=100_000, life_ms=20, concurrency=256)
    reader = RecordReader(record)
    deadline = time.monotonic() + 60
    while True:
        changes = reader.poll()
        if not any(k.kind.value == "tid" for k in reader.table) or time.monotonic() > deadline:
            break
        time.sleep(0.2 if not changes else 0.05)
    st = json.loads(agent.finish())
    created = Counter(storm["tids"])
    upserted = Counter[int]()
    for line in record.read_text().splitlines():
        parts = line.split()
        if parts[0] == "U" and parts[2] == "tid":
            upserted[int(parts[3])] += 1
    missed = sum(max(0, n - upserted[t]) for t, n in created.items())
    leaked = [k for k in reader.table if k.kind.value == "tid"]
    print(
        f"\nthread storm: {len(storm['tids'])} matching threads (each >= 20 ms, <= 256 alive) in "
        f"{storm['elapsed_s']:.1f} s, {len(created)} distinct TIDs (pid_max wraps: TIDs reused)"
    )
    print(
        f"  missed matches: {missed}   leaked entries: {len(leaked)}   events lost: {st['events_lost']}   "
        f"threads already gone when the agent read their fork event: {st['tasks_vanished']}"
    )
    print(f"  agent CPU time: {st['cpu_s']:.1f} s   peak RSS: {st['maxrss_kib'] / 1024:.1f} MiB")
    print(f"  agent: {st}")
    assert storm["elapsed_s"] <= 60, "the workload itself was too slow to make the storm"
    assert not leaked, f"entries left behind: {leaked[:10]}"
    # A miss is acceptable only when the thread had already ended when the agent got to its fork event
    # (the agent was kept off the CPU longer than the thread lived): anything else is a matching bug.
    assert missed <= st["tasks_vanished"], f"{missed} missed, only {st['tasks_vanished']} explained"
    if missed:
        print(f"  GOAL NOT MET on this run: {missed} threads ended before the agent could read them")
