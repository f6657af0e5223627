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
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.backends.dryrun import RecordReader
from gthulhu_node.tasks.procfs import snapshot

pytestmark = pytest.mark.bench

HELPER = [sys.executable, "-m", "tests.bench.watchbench"]
REPO = Path(__file__).resolve().parents[2]
# This 2-core machine is shared (other people's emulated VMs: load 5-25). Measured there, a nice -10 agent
# waited up to 80 ms on the run queue with its work in hand (docs/watching.md), which is the host's noise,
# not the agent's cost. So the agent, the reader and the floor listener run SCHED_FIFO (only these processes,
# started by the benchmark); the workload stays SCHED_OTHER. Same priority for all three: a fair comparison.
# GTHULHU_BENCH_PRIO=--nice=0 measures them as ordinary processes instead.
NICE = os.environ.get("GTHULHU_BENCH_PRIO", "--fifo=10")


class Role:
    """One helper process; waits for its "ready" line."""

    def __init__(self, *args: str) -> None:
        self.p = subprocess.Popen(
            [*HELPER, *args], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.p.stdout is not None
        line = self.p.stdout.readline().strip()
        assert line == "ready", f"{args[0]} did not start: {line!r}"

    def finish(self) -> str:
        """Close stdin (the agent's stop signal) and return what it printed last."""
        out, _ = self.p.communicate(timeout=120)
        return out.strip().splitlines()[-1] if out.strip() else ""

    def terminate(self) -> None:
        self.p.terminate()
        self.p.wait(timeout=60)

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def roles() -> Iterator[list[Role]]:
    started: list[Role] = []
    yield started
    for r in started:
        r.kill()


def workload(role: str, out: Path, **kw: Any) -> dict[str, Any]:
    args = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    subprocess.run([*HELPER, role, f"--out={out}", *args], cwd=REPO, check=True, timeout=600)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def first_at_or_after(times: list[int], t0: int) -> int | None:
    i = bisect_left(times, t0)
    return times[i] if i < len(times) else None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def summary(name: str, ms: list[float]) -> str:
    return (
        f"  {name:<34} n={len(ms):5d}  p50={pct(ms, 0.5):7.3f} ms  p99={pct(ms, 0.99):7.3f} ms  "
        f"max={max(ms):8.3f} ms"
    )


def test_reaction_latency(tmp_path: Path, roles: list[Role]) -> None:
    record = tmp_path / "record"
    floor_out, reader_out = tmp_path / "floor.json", tmp_path / "reader.json"
    floor = Role("floor", f"--out={floor_out}", NICE)
    roles.append(floor)
    agent = Role("agent", f"--record={record}", NICE)
    roles.append(agent)
    reader = Role("reader", f"--record={record}", f"--out={reader_out}", NICE)
    roles.append(reader)

    rename = workload("rename", tmp_path / "rename.json", count=1000, interval_ms=4)
    spawn = workload("spawn", tmp_path / "spawn.json", count=1000, interval_ms=4, life_ms=50)
    time.sleep(0.5)
    reader.terminate()
    floor.terminate()
    agent_stats = json.loads(agent.finish())
    seen = {k: sorted(v) for k, v in json.loads(reader_out.read_text()).items()}
    fl = json.loads(floor_out.read_text())

    rows: dict[str, list[float]] = {
        "rename agent": [],
        "rename floor": [],
        "spawn agent": [],
        "spawn floor": [],
    }
    missed = Counter[str]()
    tid = rename["tid"]
    entry_seen = seen.get(f"tid:{tid}", [])
    comm_seen = sorted(t for t, comm in fl["comm"].get(str(tid), []) if comm == "EngineCore_DP1")
    for t0 in rename["starts"]:
        a, f = first_at_or_after(entry_seen, t0), first_at_or_after(comm_seen, t0)
        if a is None:
            missed["rename agent"] += 1
        else:
            rows["rename agent"].append((a - t0) / 1e6)
        if f is not None:
            rows["rename floor"].append((f - t0) / 1e6)
    for tid_s, t0 in spawn["starts"].items():
        a = first_at_or_after(seen.get(f"tid:{tid_s}", []), t0)
        f = first_at_or_after(sorted(fl["fork"].get(tid_s, [])), t0)
        if a is None:
            missed["spawn agent"] += 1
        else:
            rows["spawn agent"].append((a - t0) / 1e6)
        if f is not None:
            rows["spawn floor"].append((f - t0) / 1e6)

    print("\nreaction latency, workload timestamp -> entry seen by an independent reader process (dry run)")
    for name, ms in rows.items():
        print(summary(name, ms))
    for kind in ("rename", "spawn"):
        ratio = pct(rows[f"{kind} agent"], 0.99) / pct(rows[f"{kind} floor"], 0.99)
        print(f"  {kind}: agent p99 / floor p99 = {ratio:.1f}x   (goal: agent p99 <= 5 ms)")
    print(f"  agent: {agent_stats}")
    assert not missed, f"entries never seen: {dict(missed)}"
    assert agent_stats["events_lost"] == 0


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
