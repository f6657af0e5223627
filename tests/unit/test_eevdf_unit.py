"""EEVDF backend logic against a fake kernel: what the host tests cannot observe or provoke.

sched_getattr cannot tell "no slice request" from "a request equal to the base slice", old kernels and
missing privileges cannot be had on this host, so those paths are checked here; everything observable is
checked on the real kernel in tests/host/test_eevdf_backend.py.
"""

from __future__ import annotations

import errno
import itertools
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gthulhu_node.backends.base import (
    BackendError,
    BackendUnavailable,
    Entry,
    EntryKey,
    InvalidEntryError,
    KeyKind,
)
from gthulhu_node.backends.eevdf import JOURNAL_NAME, LEGACY_JOURNAL_NAME, EevdfBackend
from gthulhu_node.backends.eevdf_journal import boot_id, read_journal
from gthulhu_node.backends.eevdf_policy import nice_for_priority
from gthulhu_node.backends.sched_attr import (
    KERNEL_SLICE_MAX_NS,
    KERNEL_SLICE_MIN_NS,
    SCHED_OTHER,
    SchedAttr,
    SchedAttrSyscalls,
    probe,
)
from tests.unit.fakeproc import FakeProc

BASE = 1_400_000


@dataclass
class _Task:
    policy: int = SCHED_OTHER
    nice: int = 0
    request: int = 0  # 0: no slice request of its own (the kernel's custom_slice flag clear)
    reset_on_fork: bool = False


@dataclass
class FakeKernel(SchedAttrSyscalls):
    """Behaves like 6.12+ EEVDF: clamps requests, reports the base slice when there is no request."""

    tasks: dict[int, _Task] = field(default_factory=dict)
    calls: list[tuple[str, int]] = field(default_factory=list)
    honours_slices: bool = True
    refuse: set[int] = field(default_factory=set)
    probe_threads: dict[int, _Task] = field(default_factory=dict)

    def __post_init__(self) -> None:  # no ctypes: nothing here reaches the real kernel
        pass

    def _task(self, tid: int) -> _Task:
        if self._probes_own(tid):
            return self.probe_threads.setdefault(tid, _Task())
        return self.tasks.setdefault(tid, _Task())

    @staticmethod
    def _probes_own(tid: int) -> bool:
        """A thread other than the test's own working on itself is the probe's throwaway thread, a real
        one, where the tests' tids are made up: in a container with few pids the two can be the same
        number, which a kernel would never confuse, so neither does this fake (CI once saw the probe
        rewrite made-up thread 701). Tests call the backend from their own thread; one that called it
        from another on a made-up tid equal to that thread's id would meet the same collision."""
        return tid == threading.get_native_id() and threading.current_thread() is not threading.main_thread()

    def get(self, tid: int) -> SchedAttr:
        self.calls.append(("get", tid))
        t = self._task(tid)
        runtime = (t.request or BASE) if self.honours_slices else 0
        return SchedAttr(t.policy, t.nice, runtime, t.reset_on_fork)

    def set(self, tid: int, attr: SchedAttr) -> None:
        self.calls.append(("set", tid))
        if tid in self.refuse and not self._probes_own(tid):
            raise OSError(errno.EPERM, "operation not permitted")
        t = self._task(tid)
        t.policy, t.nice, t.reset_on_fork = attr.policy, max(-20, min(19, attr.nice)), attr.reset_on_fork
        if self.honours_slices:
            t.request = (
                min(max(attr.runtime_ns, KERNEL_SLICE_MIN_NS), KERNEL_SLICE_MAX_NS) if attr.runtime_ns else 0
            )


def make(tmp_path: Path, kernel: FakeKernel, *tids: int, journal: Path | None = None) -> EevdfBackend:
    proc = FakeProc(tmp_path)
    for tid in tids:
        proc.add(100, tid, "worker", start_time=500 + tid)
        proc.add(tid, tid, "worker", start_time=500 + tid)  # /proc/<tid> resolves for any thread
        (tmp_path / str(tid)).mkdir(exist_ok=True)
        (tmp_path / str(tid) / "status").write_text(f"Name:\tworker\nTgid:\t100\nPid:\t{tid}\n")
        kernel.tasks.setdefault(tid, _Task())
    backend = EevdfBackend(proc_root=tmp_path, syscalls=kernel, cover_interval_s=0, journal=journal)
    backend.start()
    kernel.calls.clear()
    return backend


def key(tid: int) -> EntryKey:
    return EntryKey(KeyKind.TID, tid)


def entry(tid: int, priority: int, slice_ns: int = 0) -> Entry:
    return Entry(priority, slice_ns, start_time=500 + tid)


def test_nice_map_runs_from_minus_20_at_1_to_minus_5_at_20() -> None:
    """Upstream's scale (issue 39): 1, the strongest, gets the strongest nice; a stronger level never a
    weaker one."""
    table = [nice_for_priority(p) for p in range(1, 21)]
    assert table[0] == -20 and table[-1] == -5
    assert all(a <= b for a, b in itertools.pairwise(table))
    assert len(set(table)) == 16
    # the table in docs/eevdf.md
    assert table == [-20, -19, -18, -18, -17, -16, -15, -14, -14, -13,
                     -12, -11, -11, -10, -9, -8, -7, -7, -6, -5]
    for bad in (0, 21, -1):
        with pytest.raises(ValueError):
            nice_for_priority(bad)


def test_invalid_batch_makes_no_system_call(tmp_path: Path) -> None:
    kernel = FakeKernel()
    backend = make(tmp_path, kernel, 201, 202)
    with pytest.raises(InvalidEntryError):
        backend.apply({key(201): entry(201, 5), key(202): entry(202, 5, 40_000)}, [key(201)])
    with pytest.raises(InvalidEntryError):
        backend.apply({EntryKey(KeyKind.TID, 0): Entry(1, 0, 0)}, [])
    assert kernel.calls == []


def test_restore_gives_back_no_request_or_the_threads_own_request(tmp_path: Path) -> None:
    kernel = FakeKernel()
    backend = make(tmp_path, kernel, 301, 302)
    kernel.tasks[302] = _Task(nice=2, request=BASE)  # its own request happens to equal the base slice
    kernel.tasks[301] = _Task(nice=-3, request=0)
    backend.apply({key(301): entry(301, 1, 2_000_000), key(302): entry(302, 1, 2_000_000)}, [])
    assert (kernel.tasks[301].nice, kernel.tasks[301].request, kernel.tasks[301].reset_on_fork) == (
        -20,
        2_000_000,
        True,
    )
    backend.apply({}, [key(301), key(302)])
    assert kernel.tasks[301] == _Task(nice=-3, request=0)
    # indistinguishable from no request through sched_getattr: restored as none (documented)
    assert kernel.tasks[302] == _Task(nice=2, request=0)


def test_one_refused_thread_does_not_stop_the_batch(tmp_path: Path) -> None:
    kernel = FakeKernel()
    backend = make(tmp_path, kernel, 401, 402)
    kernel.refuse.add(402)
    result = backend.apply({key(401): entry(401, 11), key(402): entry(402, 11)}, [])
    assert result.upserted == 1 and type(result.failed[key(402)]) is BackendError
    assert "not permitted" in str(result.failed[key(402)])
    assert kernel.tasks[401].nice == -12 and kernel.tasks[402].nice == 0
    assert backend.counters()["errors"] == 1


def test_kernel_that_ignores_slice_requests_is_unavailable() -> None:
    found = probe(FakeKernel(honours_slices=False))
    assert not found.ok and "6.12" in found.reason
    with pytest.raises(BackendUnavailable, match=r"6\.12"):
        EevdfBackend(syscalls=FakeKernel(honours_slices=False)).start()


def test_the_probes_real_thread_is_not_a_made_up_thread_of_the_same_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CI's container gave the probe's throwaway thread id 701, one of the journal test's made-up tids:
    the fake kernel let the probe rewrite that thread (nice -18, a 2 ms request), and the journal test
    read it as a thread its successor had failed to restore."""
    kernel = FakeKernel(tasks={701: _Task(nice=-17)}, refuse={701})
    monkeypatch.setattr(threading, "get_native_id", lambda: 701)
    assert probe(kernel).ok  # nor is it refused as made-up thread 701 is
    assert kernel.tasks == {701: _Task(nice=-17)}


def test_without_privilege_the_backend_is_unavailable() -> None:
    class Unprivileged(FakeKernel):
        def set(self, tid: int, attr: SchedAttr) -> None:
            raise OSError(errno.EPERM, "operation not permitted")

    with pytest.raises(BackendUnavailable, match="CAP_SYS_NICE"):
        EevdfBackend(syscalls=Unprivileged()).start()


def test_apply_before_start_is_an_error(tmp_path: Path) -> None:
    backend = EevdfBackend(proc_root=tmp_path, syscalls=FakeKernel(), cover_interval_s=0)
    with pytest.raises(BackendError, match="not started"):
        backend.apply({}, [])


def test_tick_runs_the_passes_on_their_intervals(tmp_path: Path) -> None:
    """No thread of its own: the engine's tick covers new threads of a TGID entry every cover interval
    and reads every thread back every verify interval (where a foreign change is found)."""
    kernel = FakeKernel()
    make(tmp_path, kernel, 100, 501).stop()
    backend = EevdfBackend(proc_root=tmp_path, syscalls=kernel, cover_interval_s=1.0, verify_interval_s=30.0)
    backend.start()
    process = EntryKey(KeyKind.TGID, 100)
    backend.apply({process: Entry(1, 0, start_time=600)}, [])
    assert kernel.tasks[501].nice == -20
    FakeProc(tmp_path).add(100, 502, "worker", start_time=1002)
    FakeProc(tmp_path).add(502, 502, "worker", start_time=1002)
    backend.tick(1000.0)  # the first tick only sets the schedule
    backend.tick(1000.5)
    assert kernel.tasks.get(502, _Task()).nice == 0
    backend.tick(1001.1)
    assert kernel.tasks[502].nice == -20 and backend.gauges()["threads_managed"] == 3
    kernel.tasks[501].nice = 4  # an admin re-tunes a thread: found by the verify pass only
    backend.tick(1002.2)
    assert backend.counters()["foreign_changes"] == 0
    backend.tick(1030.1)
    assert backend.counters()["foreign_changes"] == 1 and backend.gauges()["threads_left_alone"] == 1
    backend.stop()
    assert kernel.tasks[501].nice == 4 and kernel.tasks[502].nice == 0


def test_journal_restores_a_predecessors_threads_and_survives_garbage(tmp_path: Path) -> None:
    kernel = FakeKernel()
    journal = tmp_path / "run" / "eevdf-threads.journal"
    crashed = make(tmp_path, kernel, 501, 502, journal=journal)
    kernel.tasks[502] = _Task(nice=3)
    crashed.apply({key(501): entry(501, 1, 300_000), key(502): entry(502, 20)}, [])
    assert kernel.tasks[501] == _Task(nice=-20, request=300_000, reset_on_fork=True)
    successor = EevdfBackend(proc_root=tmp_path, syscalls=kernel, cover_interval_s=0, journal=journal)
    successor.start()
    assert kernel.tasks[501] == _Task() and kernel.tasks[502] == _Task(nice=3)
    assert read_journal(journal) == []
    successor.stop()
    for garbage in ("{not json", "not a header\n+ 501 100\n", "H x 1\n+ 501 100 1001 0 0 x\n"):
        journal.write_text(garbage)
        again = EevdfBackend(proc_root=tmp_path, syscalls=kernel, cover_interval_s=0, journal=journal)
        again.start()  # an unreadable journal is logged and replaced, never fatal
        assert read_journal(journal) == [] and journal.read_text().startswith("H ")
        again.stop()


@pytest.mark.parametrize("form", ["lines", "legacy json"])
def test_a_journal_from_another_boot_is_ignored(tmp_path: Path, form: str) -> None:
    kernel = FakeKernel()
    make(tmp_path, kernel, 601)
    kernel.tasks[601] = _Task(nice=-20, request=300_000, reset_on_fork=True)
    journal = tmp_path / JOURNAL_NAME
    if form == "lines":
        journal.write_text(f"H another-boot {BASE}\n+ 601 100 1101 0 0 {BASE} 0 0 -20 300000 1\n")
    else:
        journal = tmp_path / LEGACY_JOURNAL_NAME
        journal.write_text(json.dumps({"boot_id": "another-boot", "threads": [LEGACY_RECORD]}))
    EevdfBackend(proc_root=tmp_path, syscalls=kernel, cover_interval_s=0, journal=journal).start()
    assert kernel.tasks[601].nice == -20  # the same tid and start time name another task after a reboot


LEGACY_RECORD = {
    "tid": 601,
    "tgid": 100,
    "start_time": 1101,
    "original": {"policy": 0, "nice": 0, "runtime_ns": BASE, "reset_on_fork": False},
    "applied": {"policy": 0, "nice": -20, "runtime_ns": 300_000, "reset_on_fork": True},
}


def test_a_journal_left_by_an_earlier_version_is_restored_then_removed(tmp_path: Path) -> None:
    """An upgrade right after a crash: the JSON journal of versions before the incremental one."""
    kernel = FakeKernel()
    make(tmp_path, kernel, 601)
    kernel.tasks[601] = _Task(nice=-20, request=300_000, reset_on_fork=True)
    legacy = tmp_path / "state" / LEGACY_JOURNAL_NAME
    legacy.parent.mkdir()
    legacy.write_text(json.dumps({"boot_id": boot_id(), "threads": [LEGACY_RECORD]}))
    backend = EevdfBackend(
        proc_root=tmp_path, syscalls=kernel, cover_interval_s=0, journal=legacy.with_name(JOURNAL_NAME)
    )
    backend.start()
    assert kernel.tasks[601] == _Task()
    assert not legacy.exists() and read_journal(legacy.with_name(JOURNAL_NAME)) == []
    backend.stop()


def test_engine_slice_refused_costs_a_counted_error_not_the_write(tmp_path: Path) -> None:
    """The engine thread's slice request (issue 43) refused by the kernel: logged and counted once, and
    the entries are written all the same."""
    kernel = FakeKernel()
    me = threading.get_native_id()
    kernel.refuse.add(me)
    proc = FakeProc(tmp_path)
    proc.add(7, 7, "worker", start_time=507)
    kernel.tasks[7] = _Task()
    b = EevdfBackend(proc_root=tmp_path, syscalls=kernel, cover_interval_s=0, engine_slice_ns=100_000)
    b.start()
    for _ in range(2):
        result = b.apply({key(7): entry(7, 10)}, [])
        assert not result.failed
    assert kernel.tasks[7].nice == nice_for_priority(10)
    assert b.counters()["errors"] == 1
    assert kernel.calls.count(("set", me)) == 1
    b.stop()


def test_read_keys_is_read_back_of_those_keys_with_their_threads_syscalls_only(tmp_path: Path) -> None:
    """explain's read-back of a thread: the same answer as read_back's for its keys (held, changed by
    someone else, never written), asking the kernel about those threads alone."""
    kernel = FakeKernel()
    backend = make(tmp_path, kernel, 501, 502, 503)
    backend.apply({key(501): entry(501, 10), key(502): entry(502, 5)}, [])
    kernel.tasks[502].nice = 3  # someone else changed it: not in effect
    wanted = [key(501), key(502), key(503)]
    full = backend.read_back()
    kernel.calls.clear()
    assert backend.read_keys(wanted) == {k: v for k, v in full.items() if k in wanted} == {
        key(501): entry(501, 10)}
    assert {tid for _, tid in kernel.calls} == {501, 502}
