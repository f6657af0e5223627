"""The EEVDF backend on this machine's own kernel (6.18, no sched_ext), on threads the tests create.

What users rely on: a boosted thread really has the nice level and slice the kernel then reports; removing
the strategy (or stopping) gives each thread back exactly what it had; exited threads leave nothing
behind; a thread someone else retuned is left alone and reported; TGID entries cover a whole process.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gthulhu_node.backends.base import (
    BackendState,
    Entry,
    EntryKey,
    InvalidEntryError,
    KeyKind,
    TaskGoneError,
)
from gthulhu_node.backends.eevdf import ENGINE_SLICE_NS, EevdfBackend
from gthulhu_node.backends.eevdf_policy import nice_for_priority
from gthulhu_node.backends.eevdf_threads import ForeignChangeError, PolicyNotManagedError
from gthulhu_node.backends.sched_attr import (
    SCHED_BATCH,
    SCHED_OTHER,
    SchedAttr,
    probe,
)
from tests.host.eevdf_threads import BASE_SLICE, SYS, ChildProcess, Worker, nice_of, start_time

pytestmark = pytest.mark.host


def attrs(tid: int) -> SchedAttr:
    return SYS.get(tid)


def wait_gone(path: str) -> None:
    """A joined thread's /proc entry can outlive the join by a moment; wait for the kernel to reap it."""
    for _ in range(1000):
        if not Path(path).exists():
            return
        time.sleep(0.01)
    raise AssertionError(f"{path} still exists")


@pytest.fixture
def backend() -> Iterator[EevdfBackend]:
    """Without periodic passes (tick is never called here), so each test decides when TGID entries are
    refreshed."""
    b = EevdfBackend(cover_interval_s=0)
    b.start()
    yield b
    b.stop()


@pytest.fixture
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.stop()


@pytest.fixture
def child() -> Iterator[ChildProcess]:
    c = ChildProcess()
    yield c
    c.close()


def test_probe_finds_eevdf_slice_requests() -> None:
    found = probe()
    assert found.ok, found.reason
    assert 100_000 <= found.base_slice_ns <= 100_000_000


def test_boost_and_slice_are_what_the_kernel_reports(backend: EevdfBackend, worker: Worker) -> None:
    result = backend.apply({worker.key(): worker.entry(1, 2_000_000)}, [])
    assert result.upserted == 1 and not result.failed
    got = attrs(worker.tid)
    assert (got.policy, got.nice, got.runtime_ns, got.reset_on_fork) == (SCHED_OTHER, -20, 2_000_000, True)
    assert nice_of(worker.tid) == -20
    assert backend.read_back() == {worker.key(): worker.entry(1, 2_000_000)}
    assert backend.thread_attrs()[worker.tid] == (worker.key(), got)
    assert backend.gauges()["threads_managed"] == 1


def test_priority_maps_to_documented_nice(backend: EevdfBackend, worker: Worker) -> None:
    for priority, nice in ((20, -5), (11, -12), (1, -20)):  # 1 the strongest (issue 39)
        backend.apply({worker.key(): worker.entry(priority, 0)}, [])
        assert nice_of(worker.tid) == nice == nice_for_priority(priority)
        assert attrs(worker.tid).runtime_ns == BASE_SLICE  # slice 0: the thread keeps its own


def test_slice_only_keeps_nice_and_kernel_clamps_slices(backend: EevdfBackend, worker: Worker) -> None:
    os.setpriority(os.PRIO_PROCESS, worker.tid, 4)
    backend.apply({worker.key(): worker.entry(0, 3_000_000)}, [])
    assert (nice_of(worker.tid), attrs(worker.tid).runtime_ns) == (4, 3_000_000)
    backend.apply({worker.key(): worker.entry(0, 50_000)}, [])
    assert attrs(worker.tid).runtime_ns == 100_000  # the contract allows 50 us; EEVDF's floor is 100 us
    backend.apply({worker.key(): worker.entry(0, 1_000_000_000)}, [])
    assert attrs(worker.tid).runtime_ns == 100_000_000  # and its ceiling 100 ms
    assert worker.key() in backend.read_back()  # a clamped slice is still our setting, not a foreign one


def test_boost_never_weakens_a_thread_that_was_stronger(backend: EevdfBackend, worker: Worker) -> None:
    os.setpriority(os.PRIO_PROCESS, worker.tid, -15)
    backend.apply({worker.key(): worker.entry(20, 0)}, [])  # the weakest boost: nice -5
    assert nice_of(worker.tid) == -15


def test_removal_restores_the_originals(backend: EevdfBackend) -> None:
    tuned, plain = Worker(), Worker()
    try:
        SYS.set(tuned.tid, SchedAttr(SCHED_BATCH, 3, 5_000_000))
        before_tuned, before_plain = attrs(tuned.tid), attrs(plain.tid)
        backend.apply({tuned.key(): tuned.entry(15, 1_000_000), plain.key(): plain.entry(15, 1_000_000)}, [])
        assert attrs(tuned.tid).policy == SCHED_BATCH  # the policy is the thread's own, kept
        assert nice_of(tuned.tid) == nice_of(plain.tid) == nice_for_priority(15)
        result = backend.apply({}, [tuned.key(), plain.key()])
        assert result.deleted == 2 and not result.failed
        assert attrs(tuned.tid) == before_tuned
        assert attrs(plain.tid) == before_plain
        assert backend.gauges()["threads_managed"] == 0 and backend.read_back() == {}
    finally:
        tuned.stop()
        plain.stop()


def test_stop_restores_every_thread(worker: Worker, child: ChildProcess) -> None:
    before_worker = attrs(worker.tid)
    before_child = {tid: attrs(tid) for tid in child.tids()}
    b = EevdfBackend(cover_interval_s=0)
    b.start()
    b.apply({worker.key(): worker.entry(1, 1_000_000), child.key(): child.entry(10, 0)}, [])
    assert nice_of(worker.tid) == -20 and all(nice_of(t) == nice_for_priority(10) for t in child.tids())
    b.stop()
    assert b.health().state is BackendState.STOPPED
    assert attrs(worker.tid) == before_worker
    assert {tid: attrs(tid) for tid in child.tids()} == before_child


def test_children_of_a_boosted_thread_do_not_inherit_the_boost(backend: EevdfBackend, worker: Worker) -> None:
    backend.apply({worker.key(): worker.entry(20, 2_000_000)}, [])
    grandchild = worker.call(Worker)
    try:
        got = attrs(grandchild.tid)
        assert (got.nice, got.runtime_ns) == (0, BASE_SLICE)
    finally:
        grandchild.stop()


def test_exited_threads_leave_nothing_behind(backend: EevdfBackend) -> None:
    w = Worker()
    key, entry = w.key(), w.entry(20, 2_000_000)
    backend.apply({key: entry}, [])
    w.stop()
    wait_gone(f"/proc/self/task/{w.tid}")
    assert backend.read_back() == {}
    assert not backend.refresh().failed
    assert backend.gauges() == {"entries": 0, "threads_managed": 0, "threads_left_alone": 0}
    counts = backend.counters()
    assert counts["threads_exited"] == 1 and counts["errors"] == 0
    # the reconciler's late delete and a stale re-upsert are both handled, without touching anything
    assert not backend.apply({}, [key]).failed
    again = backend.apply({key: entry}, [])
    assert isinstance(again.failed[key], TaskGoneError) and backend.gauges()["threads_managed"] == 0


def test_delete_after_exit_without_refresh(backend: EevdfBackend) -> None:
    w = Worker()
    backend.apply({w.key(): w.entry(3, 0)}, [])
    w.stop()
    wait_gone(f"/proc/self/task/{w.tid}")
    result = backend.apply({}, [w.key()])
    assert result.deleted == 1 and not result.failed
    assert backend.gauges()["threads_managed"] == 0 and backend.counters()["errors"] == 0


def test_reused_tid_is_never_touched(backend: EevdfBackend, worker: Worker) -> None:
    before = attrs(worker.tid)
    stale = Entry(priority=20, slice_ns=1_000_000, start_time=worker.start_time - 1)
    result = backend.apply({worker.key(): stale}, [])
    assert isinstance(result.failed[worker.key()], TaskGoneError)
    assert attrs(worker.tid) == before


def test_out_of_range_is_refused_before_any_write(
    backend: EevdfBackend, worker: Worker, child: ChildProcess
) -> None:
    before = attrs(worker.tid)
    with pytest.raises(InvalidEntryError, match="priority"):
        backend.apply({worker.key(): worker.entry(20, 0), child.key(): child.entry(21, 0)}, [])
    with pytest.raises(InvalidEntryError, match="slice"):
        backend.apply({worker.key(): worker.entry(20, 0), child.key(): child.entry(1, 49_999)}, [])
    assert attrs(worker.tid) == before
    assert backend.counters()["setattr"] == 0


def test_thread_changed_by_someone_else_is_left_alone(backend: EevdfBackend, worker: Worker) -> None:
    backend.apply({worker.key(): worker.entry(20, 2_000_000)}, [])
    os.setpriority(os.PRIO_PROCESS, worker.tid, 7)  # an admin's renice
    assert worker.key() not in backend.read_back()
    refreshed = backend.refresh()
    assert isinstance(refreshed.failed[worker.key()], ForeignChangeError)
    assert backend.counters()["foreign_changes"] == 1
    again = backend.apply({worker.key(): worker.entry(20, 2_000_000)}, [])
    assert isinstance(again.failed[worker.key()], ForeignChangeError)
    backend.apply({}, [worker.key()])
    assert nice_of(worker.tid) == 7 and attrs(worker.tid).runtime_ns == 2_000_000  # neither ours nor restored
    assert backend.gauges()["threads_managed"] == 0


def test_foreign_change_found_at_removal_is_not_overwritten(backend: EevdfBackend, worker: Worker) -> None:
    backend.apply({worker.key(): worker.entry(20, 0)}, [])
    SYS.set(worker.tid, SchedAttr(SCHED_OTHER, -20, 9_000_000))  # someone else's slice request
    result = backend.apply({}, [worker.key()])
    assert isinstance(result.failed[worker.key()], ForeignChangeError)
    assert attrs(worker.tid).runtime_ns == 9_000_000


def test_real_time_thread_is_left_alone(backend: EevdfBackend, worker: Worker) -> None:
    os.sched_setscheduler(worker.tid, os.SCHED_FIFO, os.sched_param(1))
    try:
        result = backend.apply({worker.key(): worker.entry(20, 0)}, [])
        assert isinstance(result.failed[worker.key()], PolicyNotManagedError)
        assert os.sched_getscheduler(worker.tid) == os.SCHED_FIFO
        assert backend.counters()["policy_skipped"] == 1
    finally:
        os.sched_setscheduler(worker.tid, os.SCHED_OTHER, os.sched_param(0))


def test_tgid_entry_covers_the_process_and_refresh_covers_new_threads(
    backend: EevdfBackend, child: ChildProcess
) -> None:
    first = child.spawn()
    result = backend.apply({child.key(): child.entry(12, 1_500_000)}, [])
    assert result.upserted == 1 and not result.failed
    nice = nice_for_priority(12)
    assert {tid: nice_of(tid) for tid in child.tids()} == dict.fromkeys([child.pid, first], nice)
    assert all(attrs(tid).runtime_ns == 1_500_000 for tid in child.tids())

    late = child.spawn()  # created by the main thread, which has reset-on-fork: starts plain
    assert (nice_of(late), attrs(late).runtime_ns) == (0, BASE_SLICE)
    assert backend.refresh().upserted == 1
    assert (nice_of(late), attrs(late).runtime_ns) == (nice, 1_500_000)

    child.end(first)
    wait_gone(f"/proc/{child.pid}/task/{first}")
    backend.refresh()
    assert set(backend.thread_attrs()) == {child.pid, late}

    backend.apply({}, [child.key()])
    assert all((nice_of(t), attrs(t).runtime_ns) == (0, BASE_SLICE) for t in child.tids())
    assert backend.gauges()["threads_managed"] == 0


def test_tid_entry_wins_over_tgid_and_falls_back_to_it(backend: EevdfBackend, child: ChildProcess) -> None:
    engine = child.spawn()
    engine_key = EntryKey(KeyKind.TID, engine)
    engine_entry = Entry(priority=1, slice_ns=1_000_000, start_time=start_time(child.pid, engine))
    backend.apply({child.key(): child.entry(20, 0), engine_key: engine_entry}, [])
    assert (nice_of(engine), nice_of(child.pid)) == (-20, -5)
    backend.apply({}, [engine_key])
    assert (nice_of(engine), attrs(engine).runtime_ns) == (-5, BASE_SLICE)  # now the process's entry
    backend.apply({}, [child.key()])
    assert (nice_of(engine), nice_of(child.pid)) == (0, 0)


def test_tgid_entry_of_an_exited_process_is_task_gone(backend: EevdfBackend) -> None:
    c = ChildProcess()
    key, entry = c.key(), c.entry(5, 0)
    c.close()
    result = backend.apply({key: entry}, [])
    assert isinstance(result.failed[key], TaskGoneError)
    assert backend.gauges()["entries"] == 0


def test_tick_covers_new_threads_of_a_tgid_entry_and_forgets_exited_ones(child: ChildProcess) -> None:
    """A TGID entry applied directly (the reconciler sends none to this backend): the periodic pass,
    run by the engine's tick, writes threads created later and forgets exited ones."""
    b = EevdfBackend(cover_interval_s=0.05)
    b.start()
    try:
        b.apply({child.key(): child.entry(1, 0)}, [])
        late = child.spawn()
        b.tick(time.monotonic())  # the first tick sets the schedule
        wait_until(lambda: b.tick(time.monotonic()) or nice_of(late) == -20)
        child.end(late)
        wait_until(lambda: b.tick(time.monotonic()) or b.gauges()["threads_managed"] == 1)
        assert set(b.thread_attrs()) == {child.pid}
    finally:
        b.stop()
    assert nice_of(child.pid) == 0


def wait_until(condition: Callable[[], bool]) -> None:
    """Wait for something to happen (a correctness check, not a timing one)."""
    for _ in range(2000):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError("condition never became true")


def test_successor_undoes_what_a_crashed_agent_left(tmp_path: Path) -> None:
    """nice and slice requests outlive the agent (a sched_ext scheduler does not): after a crash, the
    next start gives every thread still showing the dead agent's write its original settings back."""
    journal = tmp_path / "eevdf-threads.journal"
    kept, retuned, gone = Worker(), Worker(), Worker()
    try:
        os.setpriority(os.PRIO_PROCESS, kept.tid, 2)
        before = attrs(kept.tid)
        crashed = EevdfBackend(cover_interval_s=0, journal=journal)
        crashed.start()
        entries = {w.key(): w.entry(20, 1_000_000) for w in (kept, retuned, gone)}
        assert crashed.apply(entries, []).upserted == 3
        assert journal.exists()
        # the agent dies here (no stop()); meanwhile an admin re-tunes one thread and another one exits
        os.setpriority(os.PRIO_PROCESS, retuned.tid, 9)
        gone.stop()
        wait_gone(f"/proc/self/task/{gone.tid}")

        successor = EevdfBackend(cover_interval_s=0, journal=journal)
        successor.start()
        try:
            assert attrs(kept.tid) == before
            assert nice_of(retuned.tid) == 9 and attrs(retuned.tid).runtime_ns == 1_000_000
            assert successor.counters()["restored"] == 1
            assert successor.gauges()["threads_managed"] == 0
        finally:
            successor.stop()
    finally:
        for w in (kept, retuned, gone):
            w.stop()


def test_engine_thread_gets_a_short_slice_and_stop_drops_it(worker: Worker) -> None:
    """The thread that applies (the engine's) asks EEVDF for ENGINE_SLICE_NS, so that its wakeups preempt
    (issue 43); its nice stays; stop() gives it back no request; a thread with its own slice is left
    alone, and a backend built without engine_slice_ns (tests, tools) never touches its caller."""
    plain = EevdfBackend(cover_interval_s=0)
    plain.start()
    worker.call(lambda: plain.apply({}, []))
    assert attrs(worker.tid).runtime_ns == BASE_SLICE
    plain.stop()

    b = EevdfBackend(cover_interval_s=0, engine_slice_ns=ENGINE_SLICE_NS)
    b.start()
    try:
        worker.call(lambda: b.apply({}, []))
        got = attrs(worker.tid)
        assert (got.policy, got.nice, got.runtime_ns) == (SCHED_OTHER, nice_of(worker.tid), ENGINE_SLICE_NS)
        worker.call(lambda: b.tick(time.monotonic()))  # the same thread again: nothing more
        assert attrs(worker.tid).runtime_ns == ENGINE_SLICE_NS
    finally:
        b.stop()
    assert attrs(worker.tid).runtime_ns == BASE_SLICE

    SYS.set(worker.tid, SchedAttr(SCHED_OTHER, nice_of(worker.tid), 3_000_000))
    b = EevdfBackend(cover_interval_s=0, engine_slice_ns=ENGINE_SLICE_NS)
    b.start()
    try:
        worker.call(lambda: b.apply({}, []))
        assert attrs(worker.tid).runtime_ns == 3_000_000
    finally:
        b.stop()
    assert attrs(worker.tid).runtime_ns == 3_000_000
