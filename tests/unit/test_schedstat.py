"""What the kernel did with a thread lately (gthulhu_node/tasks/schedstat.py): the real /proc of this
process for the figures (a busy thread's share of a CPU against a sleeping one's), a /proc tree on disk
for each way they cannot be read, which says "not available" and why, never zeros."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gthulhu_node.tasks.procfs import Task, read_task
from gthulhu_node.tasks.schedstat import CLOCK_TICKS, SchedStat, first_reads, lately
from tests.unit.fakeproc import FakeProc


def task_of(tid: int) -> Task:
    t = read_task(os.getpid(), tid)
    assert t is not None
    return t


def asleep(tid: int) -> None:
    """Until the thread sleeps and has not run for 0.2 s: past the barrier it still has its way into
    `stop.wait()` to go, and on a loaded host (make test's lanes) that took it two timeslices inside the
    test's window."""
    task = Path(f"/proc/self/task/{tid}")
    last, still_since = "", 0.0
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
        slices = (task / "schedstat").read_text().split()[2]
        now = time.monotonic()
        if state != "S" or slices != last:
            last, still_since = slices, now
        elif now - still_since >= 0.2:
            return
        time.sleep(0.02)
    raise AssertionError(f"thread {tid} never settled asleep")


@pytest.fixture()
def busy_and_idle() -> Iterator[tuple[Task, Task]]:
    """Two live threads of this process: one spinning, one asleep."""
    stop = threading.Event()
    tids: dict[str, int] = {}
    ready = threading.Barrier(3)

    def spin() -> None:
        tids["busy"] = threading.get_native_id()
        ready.wait()
        while not stop.is_set():
            pass

    def sleep() -> None:
        tids["idle"] = threading.get_native_id()
        ready.wait()
        stop.wait()

    threads = [threading.Thread(target=spin), threading.Thread(target=sleep)]
    for t in threads:
        t.start()
    ready.wait()
    asleep(tids["idle"])
    try:
        yield task_of(tids["busy"]), task_of(tids["idle"])
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_a_busy_thread_takes_a_share_a_sleeping_one_does_not(busy_and_idle: tuple[Task, Task]) -> None:
    busy, idle = busy_and_idle
    got = lately([busy, idle], first_reads([busy, idle]), sample_s=0.3)
    b, i = got[busy.tid], got[idle.tid]
    assert b.note == "" and b.recent is not None and b.since_start is not None
    assert i.note == "" and i.recent is not None and i.recent.timeslices <= 1  # at most its way into wait()
    assert b.recent.seconds >= 0.3 and b.recent.timeslices > 0
    assert b.recent.cpu_share > 0.05 > i.recent.cpu_share
    # since it started: its whole life, so at least the window, and an age the kernel's own clock gives
    assert b.since_start.run_ns >= b.recent.run_ns and b.since_start.timeslices >= b.recent.timeslices
    assert 0 < b.since_start.seconds < 3600


def test_the_share_is_of_one_cpu() -> None:
    assert SchedStat(2.0, 1_000_000_000, 0, 3).cpu_share == 0.5
    assert SchedStat(0.0, 5, 0, 1).cpu_share == 0.0


def schedstat(fp: FakeProc, tgid: int, tid: int, text: str) -> None:
    (fp.root / str(tgid) / "task" / str(tid) / "schedstat").write_text(text)


def uptime(fp: FakeProc, seconds: float) -> None:
    (fp.root / "uptime").write_text(f"{seconds:.2f} 0.00\n")


def test_figures_and_window_from_a_proc_tree(tmp_path: Path) -> None:
    fp = FakeProc(tmp_path / "proc")
    fp.add(10, 11, "w", start_time=100 * CLOCK_TICKS)  # started 100 s after boot
    schedstat(fp, 10, 11, "1000 2000 3\n")
    uptime(fp, 300.0)
    task = Task(10, 11, "w", 100 * CLOCK_TICKS)
    first = first_reads([task], fp.root)
    schedstat(fp, 10, 11, "51000 7000 8\n")
    got = lately([task], first, fp.root, sample_s=0.0)[11]
    assert got.note == "" and got.recent is not None and got.since_start is not None
    assert (got.recent.run_ns, got.recent.wait_ns, got.recent.timeslices) == (50_000, 5_000, 5)
    assert got.since_start == SchedStat(200.0, 51_000, 7_000, 8)


@pytest.mark.parametrize("case, note", [
    ("exited", "not available: the thread exited"),
    ("reused", "not available: the thread exited"),
    ("no schedstat", "not available: this kernel has no /proc/<pid>/task/<tid>/schedstat "
                     "(CONFIG_SCHED_INFO off)"),
    ("zeros", "not available: schedstat shows 0 0 0: the thread has not run yet, or the kernel keeps no "
              "such accounting (CONFIG_SCHED_INFO off)"),
    ("garbage", "not available: schedstat is not three numbers: b'x y z'"),
])
def test_never_zeros_for_unknown(tmp_path: Path, case: str, note: str) -> None:
    fp = FakeProc(tmp_path / "proc")
    fp.add(10, 11, "w", start_time=500)
    uptime(fp, 300.0)
    task = Task(10, 11, "w", 500)
    schedstat(fp, 10, 11, "1000 2000 3\n")
    first = first_reads([task], fp.root)
    if case == "exited":
        fp.remove(10, 11)
    elif case == "reused":  # the TID names a thread that started later: another thread
        fp.add(10, 11, "w", start_time=900)
        schedstat(fp, 10, 11, "1 2 3\n")
    elif case == "no schedstat":
        (fp.root / "10" / "task" / "11" / "schedstat").unlink()
    elif case == "zeros":
        schedstat(fp, 10, 11, "0 0 0\n")
    else:
        schedstat(fp, 10, 11, "x y z\n")
    got = lately([task], first, fp.root, sample_s=0.0)[11]
    assert got.recent is None and got.since_start is None and got.note == note


def test_unreadable_at_the_first_read_says_why(tmp_path: Path) -> None:
    fp = FakeProc(tmp_path / "proc")
    fp.add(10, 11, "w")
    uptime(fp, 300.0)
    schedstat(fp, 10, 11, "0 0 0\n")
    task = Task(10, 11, "w", 100)
    got = lately([task], first_reads([task], fp.root), fp.root, sample_s=0.0)[11]
    assert got.recent is None and got.note.startswith("not available: schedstat shows 0 0 0")


def test_no_uptime_keeps_the_window_and_says_why_not_the_totals(tmp_path: Path) -> None:
    fp = FakeProc(tmp_path / "proc")
    fp.add(10, 11, "w")
    schedstat(fp, 10, 11, "1000 2000 3\n")
    task = Task(10, 11, "w", 100)
    got = lately([task], first_reads([task], fp.root), fp.root, sample_s=0.0)[11]
    assert got.recent is not None and got.since_start is None
    assert got.note.startswith("totals since start not available: ") and "uptime" in got.note
