"""The EEVDF journal under a kill -9 at any moment: whatever the agent had written to threads when it
died, a successor reading the journal it left gives every thread its original attributes back.

A kill can land between any two system calls (sched_setattr of a thread, a journal write) or in the
middle of a journal write (a torn last line). The fake kernel and the journal's writer record the pair
(journal file on disk, every thread's attributes) at each such point; each pair is then handed to a
successor, as a crash there would leave it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gthulhu_node.backends import eevdf_journal
from gthulhu_node.backends.base import Entry, EntryKey, KeyKind
from gthulhu_node.backends.eevdf import EevdfBackend
from gthulhu_node.backends.sched_attr import SchedAttr
from tests.unit.fakeproc import FakeProc
from tests.unit.test_eevdf_unit import FakeKernel, _Task

TIDS = (701, 702, 703)
ORIGINAL = {701: _Task(), 702: _Task(nice=3), 703: _Task(nice=-2)}
Crash = tuple[bytes, dict[int, _Task]]


class RecordingKernel(FakeKernel):
    """Records a crash point before and after every write to a thread."""

    def __init__(self, on_call: Callable[[], None]) -> None:
        super().__init__()
        self.on_call = on_call

    def set(self, tid: int, attr: SchedAttr) -> None:
        self.on_call()
        super().set(tid, attr)
        self.on_call()


def proc_tree(root: Path) -> None:
    proc = FakeProc(root)
    for tid in TIDS:
        proc.add(100, tid, "worker", start_time=500 + tid)
        proc.add(tid, tid, "worker", start_time=500 + tid)  # /proc/<tid> resolves for any thread
        (root / str(tid)).mkdir(exist_ok=True)
        (root / str(tid) / "status").write_text(f"Name:\tworker\nTgid:\t100\nPid:\t{tid}\n")


def threads(kernel: FakeKernel) -> dict[int, _Task]:
    """The test's threads only (the backend's probe runs on a throwaway thread of its own)."""
    return {tid: copy.deepcopy(kernel.tasks[tid]) for tid in TIDS}


def key(tid: int) -> EntryKey:
    return EntryKey(KeyKind.TID, tid)


def entry(tid: int, priority: int, slice_ns: int = 0) -> Entry:
    return Entry(priority, slice_ns, start_time=500 + tid)


def crash_points(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[Crash]:
    """Run an agent's life (boosts, changed entries, removals, compactions) and collect every state a
    kill could leave."""
    journal = tmp_path / "state" / "eevdf-threads.journal"
    points: list[Crash] = []
    kernel: RecordingKernel

    def on_disk() -> bytes:
        return journal.read_bytes() if journal.exists() else b""

    def record() -> None:
        points.append((on_disk(), threads(kernel)))

    real_write = eevdf_journal._write_all

    def torn_write(fd: int, data: bytes) -> None:
        # A kill inside write(2): a prefix of the data reached the file (an append to the journal; a
        # compaction writes a temporary file, and the journal on disk stays the old one meanwhile).
        appending = journal.exists() and journal.stat().st_ino == os.fstat(fd).st_ino
        for cut in range(len(data)):
            points.append((on_disk() + (data[:cut] if appending else b""), threads(kernel)))
        real_write(fd, data)
        record()

    kernel = RecordingKernel(record)
    monkeypatch.setattr(eevdf_journal, "_write_all", torn_write)
    monkeypatch.setattr(eevdf_journal, "COMPACT_SLACK", 3)  # compactions every few changes
    for tid in TIDS:
        kernel.tasks[tid] = copy.deepcopy(ORIGINAL[tid])
    backend = EevdfBackend(proc_root=tmp_path / "proc", syscalls=kernel, cover_interval_s=0, journal=journal)
    backend.start()
    backend.apply({key(701): entry(701, 20, 300_000), key(702): entry(702, 1)}, [])
    backend.apply({key(701): entry(701, 5), key(703): entry(703, 10, 50_000)}, [])  # 701 re-written
    backend.apply({}, [key(702)])
    backend.apply({key(702): entry(702, 20, 2_000_000_000 // 2)}, [key(703)])
    backend.apply({key(703): entry(703, 15)}, [key(701)])
    points.append((on_disk(), threads(kernel)))  # and a kill with everything applied
    return points


def test_a_kill_at_any_moment_leaves_a_journal_that_restores_every_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc_tree(tmp_path / "proc")
    points = crash_points(tmp_path, monkeypatch)
    monkeypatch.undo()
    assert len(points) > 200  # every write, every torn prefix
    boosted = 0
    for i, (left, tasks) in enumerate(points):
        boosted += any(t.nice < ORIGINAL[tid].nice for tid, t in tasks.items())
        journal = tmp_path / f"crash-{i}" / "eevdf-threads.journal"
        journal.parent.mkdir()
        journal.write_bytes(left)
        kernel = FakeKernel(tasks=tasks)
        successor = EevdfBackend(
            proc_root=tmp_path / "proc", syscalls=kernel, cover_interval_s=0, journal=journal
        )
        successor.start()
        assert threads(kernel) == ORIGINAL, f"crash point {i}: {left!r}"
        assert eevdf_journal.read_journal(journal) == []
    assert boosted > len(points) // 2  # most crash points had threads to restore


def test_a_torn_last_line_is_dropped_and_earlier_writes_are_still_restored(tmp_path: Path) -> None:
    journal = tmp_path / "eevdf-threads.journal"
    boot = eevdf_journal.boot_id()
    journal.write_text(f"H {boot} 1400000\n+ 701 100 1201 0 0 1400000 0 0 -20 300000 1\n+ 702 100 12")
    records = eevdf_journal.read_journal(journal)
    assert [r.tid for r in records] == [701]
    assert records[0].applied == SchedAttr(0, -20, 300_000, True)


def test_the_journal_stays_small_under_many_changes(tmp_path: Path) -> None:
    """Appending forever would grow the file without bound: compaction keeps it near the live set."""
    journal = eevdf_journal.ThreadJournal(tmp_path / "j")
    journal.begin(1_400_000)
    attr = SchedAttr(0, 0, 1_400_000)
    for n in range(3 * eevdf_journal.COMPACT_SLACK):
        journal.changing(eevdf_journal.JournalRecord(1000 + n % 7, 1000, 5, attr, attr))
        journal.released(1000 + (n + 3) % 7)
    lines = (tmp_path / "j").read_text().count("\n")
    assert lines <= eevdf_journal.COMPACT_SLACK + 2 * 7 + 2
    assert {r.tid for r in eevdf_journal.read_journal(tmp_path / "j")} == set(journal._live)
    journal.close()
