"""Reading a thread's per-task counters (SchedExtBackend.task_stats): the task storage map is keyed by a
pidfd from user space, so the reader must open the right one (PIDFD_THREAD for a thread that leads no
process), and every way it cannot read says "not available" and why, never zeros.

The pidfds are real (this kernel's pidfd_open); the scheduler's map lookup is a stand-in that reads back
which task the pidfd names (/proc/self/fdinfo), so a pidfd of the wrong task shows. The lab test
(tests/vm/test_explain_vm.py) reads the real map.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.scheduler import backend as sched_backend
from gthulhu_node.scheduler.layout import GthulhuTaskStats


def counts(tid: int) -> dict[str, int]:
    """What MapByPidfd answers for a TID: boosted_runs = the TID, fixed values for the rest."""
    return {"boosted_runs": tid, "demotions": 7, "preemptions": 3}


class MapByPidfd:
    """task_ctxs as the kernel would answer: the counters of the task the pidfd names (its `Pid:` in
    fdinfo), boosted_runs = that TID; None (no context) for the TIDs in `without`."""

    def __init__(self, without: tuple[int, ...] = ()) -> None:
        self.without = without

    def task_stats(self, pidfd: int) -> GthulhuTaskStats | None:
        fdinfo = Path(f"/proc/self/fdinfo/{pidfd}").read_text()
        tid = int(next(ln.split()[1] for ln in fdinfo.splitlines() if ln.startswith("Pid:")))
        return None if tid in self.without else GthulhuTaskStats(**counts(tid))


@pytest.fixture()
def other_thread() -> Iterator[int]:
    """A live thread of this process that is not its leader."""
    ready, done = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        done.wait(30)

    t = threading.Thread(target=body)
    t.start()
    ready.wait(10)
    yield tid[0]
    done.set()
    t.join()


def start_of(tid: int) -> int:
    """The thread's start time as explain reads it (stat field 22)."""
    start = sched_backend.task_start_time(tid)
    assert start is not None
    return start


def stats_of(sched: Any, tid: int, tgid: int, start_time: int | None = None) -> dict[str, int] | str:
    start = start_of(tid) if start_time is None else start_time
    return sched_backend._task_stats(sched, tid, tgid, start)


def test_the_leader_and_another_thread_are_each_read_by_their_own_pidfd(other_thread: int) -> None:
    me = os.getpid()
    assert stats_of(MapByPidfd(), me, me) == counts(me)
    assert stats_of(MapByPidfd(), other_thread, me) == counts(other_thread)


def test_no_context_and_a_gone_thread_are_not_available() -> None:
    me = os.getpid()
    assert stats_of(MapByPidfd(without=(me,)), me, me) == \
        "not available: the scheduler holds no context for this thread"
    assert stats_of(MapByPidfd(), 0x3FFFFF, me, 1) == "not available: the thread exited"


def test_a_reused_tid_is_not_read_as_the_thread_explained(other_thread: int) -> None:
    """The TID now names a thread that started at another time than the one explain read (the thread
    explained exited and the kernel gave its TID to a new one before the pidfd was opened): the pidfd
    names the new thread, so its counters are not the answer; the thread explained has exited."""
    me = os.getpid()
    for tid in (me, other_thread):
        assert stats_of(MapByPidfd(), tid, me, start_of(tid) - 1) == "not available: the thread exited"
        assert stats_of(MapByPidfd(), tid, me, start_of(tid)) == counts(tid)


def test_a_kernel_without_pidfd_thread_says_so(monkeypatch: pytest.MonkeyPatch, other_thread: int) -> None:
    """Before Linux 6.9 pidfd_open refuses PIDFD_THREAD (EINVAL): the answer names the kernel, not zeros."""
    real = os.pidfd_open

    def old_kernel(pid: int, flags: int = 0) -> int:
        if flags & sched_backend.PIDFD_THREAD:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(pid, flags)

    monkeypatch.setattr(os, "pidfd_open", old_kernel)
    note = stats_of(MapByPidfd(), other_thread, os.getpid())
    assert isinstance(note, str) and note.startswith("not available:") and "Linux 6.9+" in note
    assert stats_of(MapByPidfd(), os.getpid(), os.getpid()) == counts(os.getpid())


def test_a_lookup_error_is_not_available_with_its_words() -> None:
    class Broken:
        def task_stats(self, pidfd: int) -> GthulhuTaskStats | None:
            raise OSError(errno.EPERM, "Operation not permitted")

    note = stats_of(Broken(), os.getpid(), os.getpid())
    assert note == "not available: task_ctxs lookup: [Errno 1] Operation not permitted"


def test_backends_without_counters_say_so() -> None:
    assert DryRunBackend().task_stats([(5, 5, 1)]) == {
        5: "not available: the dry-run backend keeps no per-task counters"}
