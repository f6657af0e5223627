"""The engine thread: submitted work, rescans, periodic hooks, and reload of an ejected backend.

These run without proc events (use_events=False) over a fake /proc; tests/host/ covers real events.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import pytest

from gthulhu_node.backends.base import (
    ApplyResult,
    BackendHealth,
    BackendState,
    BackendUnavailable,
    Entry,
    EntryKey,
    KeyKind,
    MapFullError,
)
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.engine import Engine, EngineStopped
from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from tests.unit.fakeproc import FakeProc

DEADLINE_S = 20.0


def wait_for(cond: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached before the deadline")
        time.sleep(0.01)


def vllm() -> PolicySet:
    doc = {"id": "vllm", "commandRegex": "^EngineCore", "priority": 10}
    return PolicySet.build([("local/vllm", Intent.model_validate(doc))])


class FlakyBackend(DryRunBackend):
    """Fails to start `failures` times after its first start (a scheduler that cannot be reloaded yet)."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        if self.starts > 1 and self.failures > 0:
            self.failures -= 1
            raise BackendUnavailable("not yet")
        super().start()


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    p = FakeProc(tmp_path / "proc")
    p.add(1, 1, "init", 1)
    return p


def make_engine(proc: FakeProc, backend: DryRunBackend, **kw: float) -> Engine:
    backend.start()
    r = Reconciler(backend, proc_root=proc.root)
    return Engine(r, use_events=False, **kw)  # type: ignore[arg-type]


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.close()


def test_submit_runs_on_the_engine_thread(proc: FakeProc, engines: list[Engine]) -> None:
    e = make_engine(proc, DryRunBackend())
    engines.append(e)
    e.start()
    assert e.call(lambda r: threading.current_thread().name) == "gthulhu-engine"
    assert e.call(lambda r: len(r.tasks())) == 1
    with pytest.raises(ZeroDivisionError):
        e.call(lambda r: 1 // 0)
    e.stop()
    with pytest.raises(EngineStopped):
        e.call(lambda r: None)


def test_policy_and_rescans_reach_the_backend(proc: FakeProc, engines: list[Engine]) -> None:
    b = DryRunBackend()
    e = make_engine(proc, b, rescan_interval_s=0.05)
    engines.append(e)
    e.start()
    e.call(lambda r: r.set_policy(vllm()))
    proc.add(50, 50, "EngineCore", 3)
    wait_for(lambda: EntryKey(KeyKind.TID, 50) in b.table)  # periodic rescan
    proc.remove(50)
    e.request_rescan()
    wait_for(lambda: b.table == {})


def test_periodic_hooks_run_and_failures_do_not_stop_the_engine(
    proc: FakeProc, engines: list[Engine]
) -> None:
    e = make_engine(proc, DryRunBackend())
    engines.append(e)
    e.start()
    calls: list[str] = []

    def boom() -> None:
        raise RuntimeError("hook failed")

    e.add_periodic("watchdog", 0.02, lambda: calls.append(threading.current_thread().name))
    e.add_periodic("broken", 0.02, boom)
    wait_for(lambda: len(calls) >= 3 and e.stats().hook_failures >= 3)
    assert set(calls) == {"gthulhu-engine"}
    assert e.call(lambda r: "alive") == "alive"


def test_ejected_backend_is_reloaded_with_backoff_and_resynced(proc: FakeProc, engines: list[Engine]) -> None:
    proc.add(60, 60, "EngineCore", 4)
    b = FlakyBackend(failures=2)
    e = make_engine(proc, b, health_interval_s=0.02, reload_backoff_initial_s=0.05, reload_backoff_max_s=0.1)
    engines.append(e)
    e.start()
    e.call(lambda r: r.set_policy(vllm()))
    assert EntryKey(KeyKind.TID, 60) in b.table
    b.eject("watchdog timeout: gthulhu[60] failed to run for 30s")
    wait_for(lambda: e.stats().backend.reloads == 1)
    st = e.stats()
    assert st.backend.ejections == 1 and st.backend.reload_failures == 2
    assert "watchdog" in st.backend.last_ejection_reason
    wait_for(lambda: EntryKey(KeyKind.TID, 60) in b.table)
    assert e.call(lambda r: r.stats().resyncs) == 1


class StopsLikeTheScheduler(FlakyBackend):
    """Reports STOPPED once stopped, whatever stopped it, as the sched_ext backend does (it detaches the
    ejected instance and holds none); the dry run keeps saying EJECTED."""

    def stop(self) -> None:
        super().stop()
        self._state = BackendState.STOPPED


def test_a_backend_that_cannot_be_reloaded_still_reads_as_ejected_with_the_kernels_reason(
    proc: FakeProc, engines: list[Engine]
) -> None:
    """What metrics and the Ejected alert read (the reconciler's backend, on the engine thread) between
    failed reloads. Before the fix the reload's stop left the backend reporting STOPPED, so a scheduler
    kept out by another one showed as stopped and the Ejected alert never fired (lab VM, 2026-12-02)."""
    b = StopsLikeTheScheduler(failures=1_000)
    e = make_engine(proc, b, health_interval_s=0.02, reload_backoff_initial_s=30, reload_backoff_max_s=30,
                    refresh_s=0.02)
    engines.append(e)
    e.start()
    b.eject("disabled by sysrq-S")
    wait_for(lambda: e.stats().backend.reload_failures == 1)
    ejected = BackendHealth(BackendState.EJECTED, "disabled by sysrq-S")
    assert e.call(lambda r: r.backend.health()) == ejected
    assert e.stats().backend.state == "ejected"
    # what metrics read: the published frame, refreshed every refresh_s
    first = e.feed.latest()
    assert e.feed.wait_newer(first.version, DEADLINE_S).health == ejected


def giving_up_engine(
    proc: FakeProc, b: DryRunBackend, replacement: DryRunBackend, reasons: list[str], ejection_limit: int
) -> Engine:
    """An engine over `b` that hands over to `replacement` after `ejection_limit` ejections in a minute
    (the reasons it was given land in `reasons`)."""

    def give_up(why: str) -> DryRunBackend:
        reasons.append(why)
        replacement.start()
        return replacement

    b.start()
    r = Reconciler(b, proc_root=proc.root)
    return Engine(r, use_events=False, health_interval_s=0.02, reload_backoff_initial_s=0.01,
                  ejection_limit=ejection_limit, ejection_window_s=60.0, on_give_up=give_up)


def test_a_backend_ejected_too_often_is_replaced_not_reloaded_forever(
    proc: FakeProc, engines: list[Engine]
) -> None:
    """Before the limit the engine reloaded an ejected scheduler forever; now the third ejection within
    the window hands the node to the replacement, which gets every entry."""
    proc.add(60, 60, "EngineCore", 4)
    b = FlakyBackend(failures=0)
    replacement = DryRunBackend()
    reasons: list[str] = []
    e = giving_up_engine(proc, b, replacement, reasons, ejection_limit=3)
    engines.append(e)
    r = e.reconciler
    e.start()
    e.call(lambda r: r.set_policy(vllm()))
    for n in (1, 2):
        b.eject(f"disabled by sysrq-S ({n})")
        wait_for(lambda n=n: e.stats().backend.reloads == n)  # type: ignore[misc]
    assert not reasons and r.backend.current is b
    b.eject("disabled by sysrq-S (3)")
    wait_for(lambda: bool(e.stats().backend.gave_up_reason))
    assert r.backend.current is replacement
    assert len(reasons) == 1 and "3 ejections within 60 s" in reasons[0] and "(3)" in reasons[0]
    assert e.stats().backend.reloads == 2 and b.starts == 3
    wait_for(lambda: EntryKey(KeyKind.TID, 60) in replacement.table)


def test_ejections_spread_wider_than_the_window_do_not_give_up(proc: FakeProc, engines: list[Engine]) -> None:
    b = FlakyBackend(failures=0)
    b.start()
    r = Reconciler(b, proc_root=proc.root)
    e = Engine(r, use_events=False, health_interval_s=0.02, reload_backoff_initial_s=0.01,
               ejection_limit=2, ejection_window_s=0.3, on_give_up=lambda why: DryRunBackend())
    engines.append(e)
    e.start()
    for n in (1, 2, 3):
        b.eject("watchdog")
        wait_for(lambda n=n: e.stats().backend.reloads == n)  # type: ignore[misc]
        time.sleep(0.4)
    assert r.backend.current is b and not e.stats().backend.gave_up_reason


class TickingBackend(DryRunBackend):
    """Records its ticks and which thread ran them; like the EEVDF backend, it has no process fallback."""

    process_fallback = False

    def __init__(self) -> None:
        super().__init__()
        self.tick_threads: list[str] = []

    def tick(self, now: float) -> None:
        self.tick_threads.append(threading.current_thread().name)


def test_a_running_backend_gets_its_tick_on_the_engine_thread(proc: FakeProc, engines: list[Engine]) -> None:
    b = TickingBackend()
    e = make_engine(proc, b, health_interval_s=0.01)
    engines.append(e)
    e.start()
    wait_for(lambda: len(b.tick_threads) >= 3)
    assert set(b.tick_threads) == {"gthulhu-engine"}


def test_a_replacement_without_process_fallback_gets_process_scope_as_tid_entries(
    proc: FakeProc, engines: list[Engine]
) -> None:
    """sched_ext given up for eevdf: the TGID entry it held becomes a TID entry per thread."""
    proc.add(70, 70, "python3", 4)
    proc.add(70, 71, "EngineCore", 5)
    b = FlakyBackend(failures=0)
    replacement = TickingBackend()
    e = giving_up_engine(proc, b, replacement, [], ejection_limit=1)
    engines.append(e)
    r = e.reconciler
    e.start()
    doc = {"id": "p", "commandRegex": "^EngineCore", "priority": 10, "scope": "process"}
    e.call(lambda r: r.set_policy(PolicySet.build([("local/p", Intent.model_validate(doc))])))
    assert set(b.table) == {EntryKey(KeyKind.TGID, 70)}
    b.eject("disabled by sysrq-S")
    wait_for(lambda: r.backend.current is replacement and len(replacement.table) == 2)
    held = e.call(lambda r: r.backend.read_back())
    assert set(held) == {EntryKey(KeyKind.TID, 70), EntryKey(KeyKind.TID, 71)}


class SlowToReload(DryRunBackend):
    """Its reloads wait until the test lets them go, as a scheduler load that takes seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.starts: list[str] = []
        self.in_start = threading.Event()
        self.go = threading.Event()

    def start(self) -> None:
        self.starts.append(threading.current_thread().name)
        if len(self.starts) > 1:
            self.in_start.set()
            assert self.go.wait(DEADLINE_S)
        super().start()


def test_a_reload_runs_off_the_engine_thread_which_keeps_answering(
    proc: FakeProc, engines: list[Engine]
) -> None:
    proc.add(60, 60, "EngineCore", 4)
    b = SlowToReload()
    e = make_engine(proc, b, health_interval_s=0.02, reload_backoff_initial_s=0.01)
    engines.append(e)
    e.start()
    e.call(lambda r: r.set_policy(vllm()))
    b.eject("disabled by sysrq-S")
    assert b.in_start.wait(DEADLINE_S)
    # mid-reload, the engine thread still runs submitted work, and none of it reaches the backend
    assert e.call(lambda r: r.backend.reloading, timeout=5)  # the stand-in answers
    health = e.call(lambda r: r.backend.health(), timeout=5)
    assert health == BackendHealth(BackendState.EJECTED, "disabled by sysrq-S")
    assert e.call(lambda r: r.backend.counters(), timeout=5) == {}
    b.go.set()
    wait_for(lambda: e.stats().backend.reloads == 1)
    assert b.starts[1] == "gthulhu-backend-reload"
    current, reloading = e.call(lambda r: (r.backend.current, r.backend.reloading))
    assert current is b and not reloading
    wait_for(lambda: EntryKey(KeyKind.TID, 60) in b.table)


def wait_health(e: Engine, state: BackendState) -> BackendHealth:
    """The first published frame whose backend health is in `state` (fails if none comes in time)."""
    frame = e.feed.latest()
    while frame.health is None or frame.health.state is not state:
        newer = e.feed.wait_newer(frame.version, DEADLINE_S)
        assert newer.version > frame.version, f"still {frame.health}, never {state.value}"
        frame = newer
    return frame.health


def test_frames_show_the_backend_ejected_then_running_at_once_not_at_the_next_refresh(
    proc: FakeProc, engines: list[Engine]
) -> None:
    """Backend figures go into frames every refresh_s, and also whenever the engine swaps the backend
    (ejection, reload, give-up). Before, metrics could say running for up to refresh_s after an ejection
    and ejected for as long after a reload (found by review). With refresh_s an hour, the old engine never
    shows the ejection."""
    b = SlowToReload()
    e = make_engine(proc, b, health_interval_s=0.02, reload_backoff_initial_s=0.01, refresh_s=3600)
    engines.append(e)
    e.start()
    b.eject("disabled by sysrq-S")
    assert b.in_start.wait(DEADLINE_S)
    assert wait_health(e, BackendState.EJECTED).reason == "disabled by sysrq-S"
    b.go.set()
    wait_health(e, BackendState.RUNNING)


class RefuseOnce(DryRunBackend):
    """Refuses the first upsert of every key as a full map (room frees up at once after)."""

    def __init__(self) -> None:
        super().__init__()
        self.refused: set[EntryKey] = set()

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        first = {k for k in upserts if k not in self.refused}
        self.refused |= first
        result = super().apply({k: v for k, v in upserts.items() if k not in first}, deletes)
        result.failed.update({k: MapFullError(f"{k}: full") for k in first})
        return result


def test_a_refused_write_is_retried_by_the_engine_before_the_next_rescan(
    proc: FakeProc, engines: list[Engine]
) -> None:
    proc.add(50, 50, "EngineCore", 3)
    b = RefuseOnce()
    # nothing else wakes the engine: no rescan, no health check, no events
    e = make_engine(proc, b, rescan_interval_s=3600.0, health_interval_s=3600.0)
    engines.append(e)
    e.start()
    t0 = time.monotonic()
    e.call(lambda r: r.set_policy(vllm()))
    assert EntryKey(KeyKind.TID, 50) in b.refused
    wait_for(lambda: EntryKey(KeyKind.TID, 50) in b.table)
    assert time.monotonic() - t0 < DEADLINE_S < 3600.0 and e.call(lambda r: r.stats().scans) == 1


class SlowBackend(DryRunBackend):
    """Takes `per_key_s` per written key (EEVDF writes each thread with a syscall or two); records the
    size of every batch (`sizes`)."""

    def __init__(self, per_key_s: float) -> None:
        super().__init__()
        self.per_key_s = per_key_s
        self.sizes: list[int] = []

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        deletes = list(deletes)
        self.sizes.append(len(upserts) + len(deletes))
        time.sleep(self.per_key_s * (len(upserts) + len(deletes)))
        return super().apply(upserts, deletes)


def test_a_long_policy_write_leaves_the_engine_free_between_slices(
    proc: FakeProc, engines: list[Engine]
) -> None:
    """Writing 100 entries at 2 ms each is split across loop turns: work submitted after the policy change
    runs while entries are still being written (before, the whole write ran inside the change), and the
    policy is in effect (`when_settled`) only once every entry is written."""
    for tid in range(100, 200):
        proc.add(tid, tid, "EngineCore", tid)
    backend = SlowBackend(0.002)
    engine = make_engine(proc, backend, slice_s=0.005)
    engines.append(engine)
    engine.start()
    engine.submit(lambda r: r.set_policy(vllm()))
    written_then = engine.call(lambda r: (r.settled, len(r.applied())))
    assert written_then[0] is False and written_then[1] < 100
    engine.when_settled().result(DEADLINE_S)
    assert len(backend.table) == 100
    assert engine.call(lambda r: r.applied() == r.desired() and r.settled)
    assert len(backend.sizes) > 3 and max(backend.sizes) < 100


def test_status_reads_pending_while_entries_are_being_written(
    proc: FakeProc, engines: list[Engine]
) -> None:
    """An intent whose entries are not all written yet is not reported as in effect: its published figures
    say how many are unwritten, until the last is written."""
    for tid in range(100, 160):
        proc.add(tid, tid, "EngineCore", tid)
    engine = make_engine(proc, SlowBackend(0.002), slice_s=0.005, publish_interval_s=0.0)
    engines.append(engine)
    engine.start()
    engine.submit(lambda r: r.set_policy(vllm()))
    frame = engine.feed.latest()
    while not (frame.intents.get("local/vllm") and frame.intents["local/vllm"].unwritten):
        newer = engine.feed.wait_newer(frame.version, DEADLINE_S)
        assert newer.version > frame.version, "no frame showed the write under way"
        frame = newer
    assert 0 < frame.intents["local/vllm"].unwritten <= 60 and not frame.settled
    engine.when_settled().result(DEADLINE_S)
    st = engine.feed.latest().intents["local/vllm"]
    assert st.unwritten == 0 and st.applied_tasks == 60
    assert engine.feed.latest().settled


def test_status_is_published_by_the_engine_without_being_asked(proc: FakeProc, engines: list[Engine]) -> None:
    """The engine produces status as it changes (gthulhu_node/feed.py): a new task found by a rescan and
    a policy in effect show in the feed with nothing run on the engine thread for the reader."""
    proc.add(100, 100, "EngineCore", 50)
    engine = make_engine(proc, DryRunBackend(), publish_interval_s=0.01)
    engines.append(engine)
    engine.start()
    assert engine.feed.latest().version >= 1  # published before start() returned
    engine.submit(lambda r: r.set_policy(vllm()))
    engine.when_settled().result(DEADLINE_S)
    frame = engine.feed.latest()  # published before the settle was told: includes the policy
    assert frame.intents["local/vllm"].applied_tasks == 1
    assert [(m.tid, m.intent_key, m.applied) for m in frame.matches.values()] == [(100, "local/vllm", True)]
    proc.add(100, 101, "EngineCore", 51)
    engine.request_rescan()
    while frame.intents["local/vllm"].applied_tasks < 2:
        newer = engine.feed.wait_newer(frame.version, DEADLINE_S)
        assert newer.version > frame.version, "no frame published after the rescan"
        frame = newer
    assert set(frame.matches) == {100, 101} and all(m.applied for m in frame.matches.values())
    assert frame.reconciler.matched_tasks == 2


@pytest.mark.timeout(60)
def test_the_feed_refreshes_backend_figures_without_changes(proc: FakeProc, engines: list[Engine]) -> None:
    """Nothing changes in the tables, yet the backend's counters move: a frame follows every refresh_s."""
    engine = make_engine(proc, DryRunBackend(), refresh_s=0.05)
    engines.append(engine)
    engine.start()
    first = engine.feed.latest()
    later = engine.feed.wait_newer(first.version + 2, DEADLINE_S)
    assert later.version > first.version + 2 and later.health is not None
    engine.close()
    # an hour: a feed left open would hold this wait past the test's timeout
    assert engine.feed.wait_newer(later.version + 1000, 3600).version < later.version + 1000
