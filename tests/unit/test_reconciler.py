"""The reconciler: desired table, scope, precedence per task, diff, TID reuse, scans, events, failures."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.backends.base import (
    ApplyResult,
    BackendError,
    Entry,
    EntryKey,
    KeyKind,
    MapFullError,
    TaskGoneError,
)
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import PolicySet
from gthulhu_node.outbox import RETRY_INITIAL_S, RETRY_MAX_S, FailureReason
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.events import EventKind, ProcEvent
from gthulhu_node.tasks.procfs import Snapshot, Task, snapshot
from tests.unit.fakeproc import FakeProc
from tests.unit.recount import check_invariants, intent_stats

VLLM = "^EngineCore(_DP[0-9]+)?$"


def tid(n: int) -> EntryKey:
    return EntryKey(KeyKind.TID, n)


def tgid(n: int) -> EntryKey:
    return EntryKey(KeyKind.TGID, n)


def policy(*items: tuple[str, dict[str, Any]]) -> PolicySet:
    out = []
    for key, fields in items:
        doc = {"id": key.split("/")[1], "commandRegex": VLLM, "priority": 10, **fields}
        out.append((key, Intent.model_validate(doc)))
    return PolicySet.build(out)


@pytest.fixture
def proc(tmp_path: Path) -> FakeProc:
    return FakeProc(tmp_path / "proc")


def make(proc: FakeProc, backend: DryRunBackend | None = None, **kw: Any) -> tuple[Reconciler, DryRunBackend]:
    b = backend or DryRunBackend()
    b.start()
    return Reconciler(b, proc_root=proc.root, **kw), b


def ev(kind: EventKind, t: int, g: int, comm: str | None = None, ts: int = 0) -> ProcEvent:
    return ProcEvent(kind, t, g, ts, comm)


def test_thread_scope_writes_one_tid_entry_per_matching_thread(proc: FakeProc) -> None:
    proc.add(100, 100, "python3.12", 50)
    proc.add(100, 101, "EngineCore_DP0", 51)
    proc.add(100, 102, "EngineCore_DP1", 52)
    proc.add(100, 103, "tokenizer", 53)
    r, b = make(proc)
    r.set_policy(policy(("local/vllm", {"priority": 10, "executionTime": 2_000_000})))
    r.rescan()
    assert b.table == {tid(101): Entry(10, 2_000_000, 51), tid(102): Entry(10, 2_000_000, 52)}
    assert {(m.tid, m.intent_key, m.entry, m.applied) for m in r.matches()} == {
        (101, "local/vllm", "tid:101", True),
        (102, "local/vllm", "tid:102", True),
    }
    st = intent_stats(r)["local/vllm"]
    assert (st.matched_tasks, st.applied_tasks, st.lost_tasks) == (2, 2, 0)


def test_overlap_one_winner_per_task_and_loser_names_it(proc: FakeProc) -> None:
    proc.add(100, 101, "EngineCore_DP0")
    proc.add(100, 102, "EngineCore")
    r, b = make(proc)
    r.rescan()
    r.set_policy(
        policy(
            ("local/all", {"commandRegex": "EngineCore", "priority": 7, "executionTime": 1_000_000}),
            ("manager/dp", {"commandRegex": "_DP[0-9]$", "priority": 5}),  # stronger: 5 before 7
        )
    )
    assert b.table == {tid(101): Entry(5, 0, 100), tid(102): Entry(7, 1_000_000, 100)}
    stats = intent_stats(r)
    assert stats["local/all"].overlaps == {"manager/dp": 1}
    assert (stats["local/all"].matched_tasks, stats["local/all"].lost_tasks) == (2, 1)
    assert stats["manager/dp"].overlaps == {}


def test_process_scope_covers_the_process_through_its_tgid(proc: FakeProc) -> None:
    proc.add(200, 200, "python3.12", 77)
    proc.add(200, 201, "EngineCore_DP0", 78)
    proc.add(200, 202, "tokenizer", 79)
    r, b = make(proc)
    r.set_policy(policy(("local/p", {"scope": "process", "priority": 3})))
    r.rescan()
    # one TGID entry with the leader's start time, no TID entries
    assert b.table == {tgid(200): Entry(3, 0, 77)}
    ms = {m.tid: m for m in r.matches()}
    assert set(ms) == {200, 201, 202}
    assert all(m.entry == "tgid:200" and m.scope == "process" and m.applied for m in ms.values())
    # a thread created later needs no write: the kernel resolves it through the TGID entry
    batches = b.batches
    proc.add(200, 203, "python3.12", 90)
    r.handle_events([ev(EventKind.FORK, 203, 200)])
    assert b.batches == batches
    assert 203 in {m.tid for m in r.matches()}


def test_process_scope_vs_thread_scope_precedence(proc: FakeProc) -> None:
    proc.add(300, 300, "python3.12", 10)
    proc.add(300, 301, "EngineCore_DP0", 11)
    proc.add(300, 302, "EngineCore_DP1", 12)
    proc.add(300, 303, "worker", 13)
    r, b = make(proc)
    r.rescan()
    r.set_policy(
        policy(
            ("local/proc", {"commandRegex": "^python", "scope": "process", "priority": 5}),
            ("local/dp0", {"commandRegex": "_DP0$", "priority": 2}),  # beats the process intent
            ("local/dp1", {"commandRegex": "_DP1$", "priority": 9}),  # loses to it
        )
    )
    assert b.table == {tgid(300): Entry(5, 0, 10), tid(301): Entry(2, 0, 11)}
    owner = {m.tid: m.intent_key for m in r.matches()}
    assert owner == {300: "local/proc", 301: "local/dp0", 302: "local/proc", 303: "local/proc"}
    stats = intent_stats(r)
    assert stats["local/dp1"].overlaps == {"local/proc": 1}
    assert stats["local/proc"].overlaps == {"local/dp0": 1}


class NoFallbackBackend(DryRunBackend):
    """A backend that cannot cover a process's threads through its TGID entry (as the EEVDF one)."""

    process_fallback = False


def test_process_scope_becomes_tid_entries_for_a_backend_without_a_process_fallback(proc: FakeProc) -> None:
    proc.add(200, 200, "python3.12", 77)
    proc.add(200, 201, "EngineCore_DP0", 78)
    proc.add(200, 202, "tokenizer", 79)
    r, b = make(proc, NoFallbackBackend())
    r.set_policy(policy(("local/p", {"scope": "process", "priority": 3})))
    r.rescan()
    # a TID entry per thread, each with its own start time, and no TGID entry
    assert b.table == {tid(200): Entry(3, 0, 77), tid(201): Entry(3, 0, 78), tid(202): Entry(3, 0, 79)}
    assert all(m.entry == f"tid:{m.tid}" and m.applied for m in r.matches())
    # a thread created later is written on its fork event, and removed on its exit event
    proc.add(200, 203, "python3.12", 90)
    r.handle_events([ev(EventKind.FORK, 203, 200)])
    assert b.table[tid(203)] == Entry(3, 0, 90)
    r.handle_events([ev(EventKind.EXIT, 203, 200)])
    assert tid(203) not in b.table
    # the matching thread leaves: nothing of the process is covered any more
    r.handle_events([ev(EventKind.COMM, 201, 200, "idle")])
    assert b.table == {}


def test_process_entry_follows_the_matching_thread_rename_and_exit(proc: FakeProc) -> None:
    proc.add(400, 400, "python3.12", 5)
    proc.add(400, 401, "EngineCore_DP0", 6)
    r, b = make(proc)
    r.set_policy(policy(("local/p", {"scope": "process", "priority": 4})))
    r.rescan()
    assert tgid(400) in b.table
    r.handle_events([ev(EventKind.COMM, 401, 400, "idle")])
    assert b.table == {}
    r.handle_events([ev(EventKind.COMM, 401, 400, "EngineCore_DP0")])
    assert b.table == {tgid(400): Entry(4, 0, 5)}
    r.handle_events([ev(EventKind.EXIT, 401, 400)])
    assert b.table == {}
    assert r.matches() == []


def test_noop_intent_matches_but_writes_nothing(proc: FakeProc) -> None:
    proc.add(100, 101, "EngineCore_DP0")
    r, b = make(proc)
    r.rescan()
    r.set_policy(policy(("local/noop", {"priority": 0, "executionTime": 0})))
    assert b.table == {}
    [m] = r.matches()
    assert (m.intent_key, m.entry, m.priority) == ("local/noop", "", 0)
    st = intent_stats(r)["local/noop"]
    assert st.noop and st.applied_tasks == 1


def test_events_fork_comm_exit_in_order(proc: FakeProc) -> None:
    proc.add(500, 500, "python3.12", 1)
    r, b = make(proc)
    r.set_policy(policy(("local/vllm", {"priority": 8})))
    r.rescan()
    proc.add(500, 501, "python3.12", 42)  # a new thread starts with its creator's name
    r.handle_events([ev(EventKind.FORK, 501, 500)])
    assert b.table == {}
    proc.rename(500, 501, "EngineCore_DP0")
    r.handle_events([ev(EventKind.COMM, 501, 500, "EngineCore_DP0")])
    assert b.table == {tid(501): Entry(8, 0, 42)}
    r.handle_events([ev(EventKind.COMM, 501, 500, "renamed")])
    assert b.table == {}
    r.handle_events([ev(EventKind.COMM, 501, 500, "EngineCore_DP1")])
    assert b.table == {tid(501): Entry(8, 0, 42)}
    proc.remove(500, 501)
    r.handle_events([ev(EventKind.EXIT, 501, 500)])
    assert b.table == {}
    assert [h[0] for h in b.history] == ["U", "D", "U", "D"]


def test_fork_comm_exit_in_one_batch_leaves_nothing(proc: FakeProc) -> None:
    proc.add(500, 500, "python3.12", 1)
    proc.add(500, 502, "EngineCore_DP0", 2)
    r, b = make(proc)
    r.set_policy(policy(("local/vllm", {})))
    r.handle_events(
        [
            ev(EventKind.FORK, 502, 500),
            ev(EventKind.COMM, 502, 500, "EngineCore_DP0"),
            ev(EventKind.EXIT, 502, 500),
        ]
    )
    assert b.table == {} and r.desired() == {}


def test_fork_of_a_task_already_gone_is_ignored(proc: FakeProc) -> None:
    r, b = make(proc)
    r.set_policy(policy(("local/vllm", {})))
    r.handle_events([ev(EventKind.FORK, 999, 998), ev(EventKind.EXIT, 999, 998)])
    assert b.table == {} and r.tasks() == {}


def test_tid_reuse_is_a_new_task(proc: FakeProc) -> None:
    proc.add(600, 600, "python3.12", 1)
    proc.add(600, 601, "EngineCore_DP0", 10)
    r, b = make(proc)
    r.set_policy(policy(("local/vllm", {})))
    r.rescan()
    assert b.table[tid(601)].start_time == 10
    # the thread died (exit event missed) and its TID came back as another matching thread
    proc.remove(600, 601)
    proc.add(600, 601, "EngineCore_DP0", 20)
    r.rescan()
    assert b.table == {tid(601): Entry(10, 0, 20)}
    # ... and as a non-matching one: its entry must go even though the name was never renamed by an event
    proc.remove(600, 601)
    proc.add(600, 601, "other", 30)
    r.handle_events([ev(EventKind.FORK, 601, 600)])
    assert b.table == {}


def test_pid_reuse_with_exits_lost_is_a_new_process(proc: FakeProc) -> None:
    """A process whose exits were all lost, its PID then reused by a new matching process: the TGID entry
    carries the new leader's start time (the scheduler ignores one with the dead process's). Found by the
    model test (test_reconciler_model.py): the dead process's other thread kept the process's match, so the
    entry was never rewritten."""
    proc.add(10, 10, "EngineCore_DP0", 1)
    proc.add(10, 11, "EngineCore_DP0", 2)
    r, b = make(proc)
    r.set_policy(policy(("local/p", {"scope": "process", "priority": 3})))
    r.rescan()
    assert b.table == {tgid(10): Entry(3, 0, 1)}
    proc.remove(10)
    proc.add(10, 10, "EngineCore_DP0", 3)
    r.handle_events([ev(EventKind.FORK, 10, 10)])
    assert b.table == {tgid(10): Entry(3, 0, 3)}
    assert {m.tid for m in r.matches()} == {10}


def test_incomplete_snapshot_never_removes(proc: FakeProc) -> None:
    proc.add(700, 700, "EngineCore", 1)
    proc.add(701, 701, "EngineCore", 2)
    r, b = make(proc)
    r.set_policy(policy(("local/vllm", {})))
    r.rescan()
    assert set(b.table) == {tid(700), tid(701)}
    partial = Snapshot(tasks={700: Task(700, 700, "EngineCore", 1)}, complete=False, errors=1)
    r.apply_snapshot(partial)
    assert set(b.table) == {tid(700), tid(701)}
    assert r.stats().scans_incomplete == 1
    complete = Snapshot(tasks={700: Task(700, 700, "EngineCore", 1)}, complete=True)
    r.apply_snapshot(complete)
    assert set(b.table) == {tid(700)}


def test_scan_counts_unreadable_entries_as_incomplete(proc: FakeProc) -> None:
    proc.add(800, 800, "EngineCore", 1)
    bad = proc.root / "801" / "task" / "801" / "stat"
    bad.mkdir(parents=True)  # reading a directory fails with EISDIR: an error, not a vanished task
    snap = snapshot(proc.root)
    assert not snap.complete and snap.errors == 1
    assert set(snap.tasks) == {800}


def test_exec_drops_the_other_threads(proc: FakeProc) -> None:
    proc.add(900, 900, "EngineCore", 1)
    proc.add(900, 901, "EngineCore_DP0", 2)
    r, b = make(proc)
    r.set_policy(policy(("local/vllm", {})))
    r.rescan()
    assert set(b.table) == {tid(900), tid(901)}
    proc.remove(900, 901)
    proc.rename(900, 900, "bash")
    r.handle_events([ev(EventKind.EXEC, 900, 900)])
    assert b.table == {}
    assert set(r.tasks()) == {900}


def test_policy_change_diffs_against_what_is_written(proc: FakeProc) -> None:
    proc.add(100, 101, "EngineCore_DP0", 5)
    proc.add(100, 102, "EngineCore_DP1", 6)
    r, b = make(proc)
    r.rescan()
    r.set_policy(policy(("local/a", {"priority": 10})))
    b.history.clear()
    r.set_policy(policy(("local/a", {"priority": 10}), ("local/b", {"commandRegex": "DP1", "priority": 8})))
    assert list(b.history) == [("U", tid(102), Entry(8, 0, 6))]  # only what changed
    r.set_policy(PolicySet.empty())
    assert b.table == {}


def test_map_full_shows_on_the_intent_and_is_retried(proc: FakeProc) -> None:
    proc.add(100, 101, "EngineCore_DP0", 5)
    proc.add(100, 102, "EngineCore_DP1", 6)
    r, b = make(proc, DryRunBackend(capacity=1))
    r.rescan()
    r.set_policy(policy(("local/vllm", {})))
    assert len(b.table) == 1
    st = intent_stats(r)["local/vllm"]
    assert st.write_failures == 1 and st.pending_failures == 1 and "full" in st.last_error
    assert r.stats().map_full == 1
    assert sum(m.applied for m in r.matches()) == 1
    written = next(iter(b.table))
    proc.remove(100, written.id)
    r.handle_events([ev(EventKind.EXIT, written.id, 100)])
    r.rescan()  # the next full diff retries the failed key
    assert len(b.table) == 1 and written not in b.table
    assert intent_stats(r)["local/vllm"].pending_failures == 0


class GoneBackend(DryRunBackend):
    """Refuses one key as gone, like a real backend whose task exited between event and write."""

    def __init__(self, gone: EntryKey) -> None:
        super().__init__()
        self.gone = gone

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        rest = {k: v for k, v in upserts.items() if k != self.gone}
        result = super().apply(rest, deletes)
        if self.gone in upserts:
            result.failed[self.gone] = TaskGoneError(f"{self.gone}: gone")
        return result


def test_task_gone_drops_the_entry_without_failing_the_intent(proc: FakeProc) -> None:
    proc.add(100, 101, "EngineCore_DP0", 5)
    r, b = make(proc, GoneBackend(tid(101)))
    r.rescan()
    r.set_policy(policy(("local/vllm", {})))
    assert r.desired() == {} and b.table == {}
    assert intent_stats(r)["local/vllm"].write_failures == 0
    assert r.stats().tasks_gone == 1


def test_resync_after_backend_restart(proc: FakeProc) -> None:
    proc.add(100, 101, "EngineCore_DP0", 5)
    r, b = make(proc)
    r.rescan()
    r.set_policy(policy(("local/vllm", {})))
    b.eject("watchdog")
    b.start()
    assert b.table == {}
    r.resync()
    assert b.table == {tid(101): Entry(10, 0, 5)}


def test_hold_writes_keeps_changes_until_released(proc: FakeProc) -> None:
    proc.add(100, 101, "EngineCore_DP0", 5)
    r, b = make(proc)
    r.rescan()
    r.backend.hold()
    r.set_policy(policy(("local/vllm", {})))
    assert b.table == {}
    r.backend.release()
    r.flush()
    assert b.table == {tid(101): Entry(10, 0, 5)}


def test_latency_is_measured_from_the_event_timestamp(proc: FakeProc) -> None:
    import time

    proc.add(100, 101, "python3.12", 5)
    seen: list[float] = []
    r, _b = make(proc, on_latency=seen.append)
    r.set_policy(policy(("local/vllm", {})))
    r.rescan()
    t0 = time.monotonic_ns() - 3_000_000  # the rename happened 3 ms ago
    r.handle_events([ev(EventKind.COMM, 101, 100, "EngineCore", ts=t0)])
    assert len(seen) == 1 and 0.003 <= seen[0] < 10
    r.set_policy(policy(("local/vllm", {"priority": 12})))  # a write no event caused: no latency
    assert len(seen) == 1


def test_pod_selector_matches_only_threads_of_that_pod(proc: FakeProc) -> None:
    uid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    proc.add(100, 100, "EngineCore", 1)
    proc.set_cgroup(100, f"0::/kubepods/burstable/pod{uid}/abc\n")
    proc.add(200, 200, "EngineCore", 2)
    proc.set_cgroup(200, "0::/system.slice/vllm.service\n")
    r, b = make(proc)
    r.rescan()
    r.set_policy(policy(("manager-pods/x", {"podUID": uid})))
    assert set(b.table) == {tid(100)}


# ---- who may be boosted (issue 18 item 5) -----------------------------------------------------------


@pytest.fixture
def owners(proc: FakeProc) -> FakeProc:
    """EngineCore threads in three processes: root's, uid 1000's (in a service cgroup), nobody's."""
    proc.add(100, 100, "EngineCore", 1)
    proc.set_owner(100, 0, "/usr/bin/python3.12", "0::/system.slice/vllm.service\n")
    proc.add(200, 200, "EngineCore", 2)
    proc.set_owner(200, 1000, "/opt/vllm/bin/python3", "0::/system.slice/vllm-user.service\n")
    proc.add(300, 300, "EngineCore", 3)
    proc.set_owner(300, 65534, "/usr/bin/python3.12", "0::/user.slice/user-65534.slice/session-1.scope\n")
    proc.add(400, 400, "EngineCore", 4)  # no status file: who it is cannot be read
    return proc


def named_only(*items: tuple[str, dict[str, Any]]) -> PolicySet:
    built = policy(*items)
    return PolicySet(built.ordered, named_only=True)


@pytest.mark.parametrize(
    ("fields", "matched"),
    [
        ({}, {100, 200, 300, 400}),  # today's default: any user's thread named EngineCore
        ({"users": ["1000"]}, {200}),
        ({"users": ["root", 65534]}, {100, 300}),
        ({"cgroupRegex": "^/system\\.slice/"}, {100, 200}),
        ({"executableRegex": "^/usr/bin/python"}, {100, 300}),  # not a boundary: nobody runs it too
        ({"users": ["1000"], "executableRegex": "^/usr/bin/"}, set()),  # selectors combine with AND
        ({"users": ["no-such-user-here"]}, set()),
    ],
)
def test_owner_selectors_restrict_who_is_boosted(owners: FakeProc, fields: dict[str, Any],
                                                 matched: set[int]) -> None:
    r, b = make(owners)
    r.rescan()
    r.set_policy(policy(("local/vllm", fields)))
    assert {k.id for k in b.table} == matched


@pytest.mark.parametrize(
    ("fields", "matched"),
    [
        ({}, {100}),  # named_only: a name-only intent boosts root's threads only (nobody's attack fails)
        ({"users": ["1000"]}, {200}),
        ({"cgroupRegex": "^/system\\.slice/"}, {100, 200}),
        ({"executableRegex": "python"}, {100}),  # an executable does not name a user or cgroup
    ],
)
def test_named_only_boosts_unprivileged_tasks_only_when_their_user_or_cgroup_is_named(
    owners: FakeProc, fields: dict[str, Any], matched: set[int]
) -> None:
    r, b = make(owners)
    r.rescan()
    r.set_policy(named_only(("local/vllm", fields)))
    assert {k.id for k in b.table} == matched


@pytest.mark.parametrize("event", [EventKind.UID, EventKind.EXEC])
def test_owner_selectors_follow_a_process_that_changes_user(owners: FakeProc, event: EventKind) -> None:
    """Issue 38 item 7: root's process 100 is boosted under named_only, then becomes nobody's (setresuid,
    then maybe execve with the same PID). Before, the owner read at the first match was kept for the
    process's life, so it stayed boosted; now the uid and exec events make it read again."""
    r, b = make(owners)
    r.rescan()
    r.set_policy(named_only(("local/vllm", {})))
    assert {k.id for k in b.table} == {100}
    (owners.root / "100" / "status").write_text("Name:\tx\nUid:\t65534\t65534\t65534\t65534\n")
    r.handle_events([ev(event, 100, 100, ts=5)])
    assert {k.id for k in b.table} == set()
    (owners.root / "300" / "status").write_text("Name:\tx\nUid:\t0\t0\t0\t0\n")  # and the other way
    r.handle_events([ev(event, 300, 300, ts=6)])
    assert {k.id for k in b.table} == {300}
    check_invariants(r)


def test_unreadable_cgroup_is_not_remembered_as_no_pod(proc: FakeProc) -> None:
    """Before: any OSError reading /proc/<pid>/cgroup (EMFILE under an fd flood) was cached as "in no
    pod", so that process never got its pod's intent while it lived."""
    uid = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
    proc.add(100, 100, "EngineCore", 1)
    (proc.root / "100" / "cgroup").mkdir()  # reading it fails with EISDIR: not "gone", not an answer
    r, b = make(proc)
    r.rescan()
    r.set_policy(policy(("manager-pods/x", {"podUID": uid})))
    assert set(b.table) == set() and r.stats().owner_read_errors == 1
    (proc.root / "100" / "cgroup").rmdir()
    proc.set_cgroup(100, f"0::/kubepods/burstable/pod{uid}/abc\n")
    r.set_policy(policy(("manager-pods/x", {"podUID": uid, "priority": 11})))
    assert set(b.table) == {tid(100)}


def test_a_latency_listener_added_later_is_called_with_the_first(proc: FakeProc) -> None:
    """The service adds the metrics histogram after the engine started, beside the constructor's
    listener, without replacing the reconciler's attribute from outside."""
    import time

    proc.add(100, 101, "python3.12", 5)
    first: list[float] = []
    later: list[float] = []
    r, _b = make(proc, on_latency=first.append)
    r.add_latency_listener(later.append)
    r.set_policy(policy(("local/vllm", {})))
    r.rescan()
    r.handle_events([ev(EventKind.COMM, 101, 100, "EngineCore", ts=time.monotonic_ns())])
    assert len(first) == len(later) == 1 and first == later


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RefusingBackend(DryRunBackend):
    """Refuses upserts of the keys in `refuse` with the given error, and (while `down`) every batch."""

    def __init__(self, error: BackendError) -> None:
        super().__init__()
        self.error = error
        self.refuse: set[EntryKey] = set()
        self.down = False
        self.attempts = 0

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        if self.down:
            raise self.error
        refused = {k for k in upserts if k in self.refuse}
        self.attempts += len(refused)
        result = super().apply({k: v for k, v in upserts.items() if k not in refused}, deletes)
        result.failed.update({k: self.error for k in refused})
        return result


def refused_vllm(proc: FakeProc, error: BackendError, clock: Clock) -> tuple[Reconciler, RefusingBackend]:
    """One EngineCore thread, one intent for it, and a backend that refuses its TID entry."""
    proc.add(100, 101, "EngineCore_DP0", 5)
    b = RefusingBackend(error)
    b.refuse.add(tid(101))
    r, _b = make(proc, b, clock=clock)
    r.rescan()
    r.set_policy(policy(("local/vllm", {})))
    return r, b


def test_a_refused_key_is_retried_on_its_own_with_doubling_backoff(proc: FakeProc) -> None:
    clock = Clock()
    r, b = refused_vllm(proc, MapFullError("tid:101: map is full"), clock)
    assert b.attempts == 1 and r.failures() == {tid(101): FailureReason.MAP_FULL}
    assert r.next_retry_at() == pytest.approx(clock.now + RETRY_INITIAL_S)
    r.flush()
    assert b.attempts == 1  # not due yet: no write
    gaps = []
    for _ in range(12):
        due = r.next_retry_at()
        gaps.append(round(due - clock.now, 3))
        clock.now = due
        r.flush()
    assert b.attempts == 13
    assert gaps[:5] == [0.1, 0.2, 0.4, 0.8, 1.6] and max(gaps) == RETRY_MAX_S == gaps[-1]
    b.refuse.clear()  # room again: the next retry writes it, with no rescan and no event
    clock.now = r.next_retry_at()
    r.flush()
    assert b.table == {tid(101): Entry(10, 0, 5)} and r.failures() == {} and r.next_retry_at() == math.inf
    st = intent_stats(r)["local/vllm"]
    assert st.pending_failures == 0 and st.write_failures == 13 and r.stats().write_retries == 13


class CrashingBackend(DryRunBackend):
    """Raises an exception that is no BackendError (a bug in a backend) while `crash` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.crash = True

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        if self.crash:
            raise RuntimeError("bug in the backend")
        return super().apply(upserts, deletes)


def test_an_unexpected_backend_exception_is_a_refusal_retried_per_key(proc: FakeProc) -> None:
    """Before: the exception went through flush to the engine, and the keys taken for that write were
    not written again until the next rescan (30 s)."""
    clock = Clock()
    proc.add(100, 101, "EngineCore_DP0", 5)
    b = CrashingBackend()
    r, _b = make(proc, b, clock=clock)
    r.rescan()
    r.set_policy(policy(("local/vllm", {})))  # must not raise
    assert r.failures() == {tid(101): FailureReason.BACKEND}
    assert "RuntimeError: bug in the backend" in intent_stats(r)["local/vllm"].last_error
    b.crash = False
    clock.now = r.next_retry_at()
    r.flush()
    assert b.table == {tid(101): Entry(10, 0, 5)} and r.failures() == {}


def test_a_held_backend_is_not_retried(proc: FakeProc) -> None:
    clock = Clock()
    r, b = refused_vllm(proc, BackendError("tid:101: busy"), clock)
    r.backend.hold()
    assert r.next_retry_at() == math.inf
    clock.now += 60
    r.flush()
    assert b.attempts == 1


def test_failures_carry_a_typed_reason_not_only_text(proc: FakeProc) -> None:
    """Status decides "map full" from the reason: a backend's message that says "full" about something
    else is not a full map, and a map-full error is one whatever its words."""
    r, b = refused_vllm(proc, BackendError("journal disk full"), Clock())
    st = intent_stats(r)["local/vllm"]
    assert st.pending_reasons == {FailureReason.BACKEND: 1} and st.last_reason is FailureReason.BACKEND
    b.error = MapFullError("no room")
    r.rescan()
    st = intent_stats(r)["local/vllm"]
    assert st.pending_reasons == {FailureReason.MAP_FULL: 1} and st.last_error == "no room"
    assert r.stats().map_full == 1


@pytest.mark.parametrize("then", ["policy change", "exit"])
def test_a_refused_delete_is_kept_until_the_backend_takes_it(proc: FakeProc, then: str) -> None:
    """Found by the model test: a policy change (the key is in neither the old nor the new desired table)
    or the task's exit forgot a key whose delete the backend had refused, so the backend kept the entry
    until the next rescan."""
    clock = Clock()
    r, b = refused_vllm(proc, BackendError("busy"), clock)
    b.refuse.clear()
    r.rescan()
    assert b.table == {tid(101): Entry(10, 0, 5)}
    b.down = True
    if then == "policy change":
        proc.remove(100)
        r.rescan()
        r.set_policy(PolicySet.empty())
    else:
        r.handle_events([ev(EventKind.COMM, 101, 100, "tokenizer")])  # out of the pattern: delete refused
        r.handle_events([ev(EventKind.EXIT, 101, 100)])
    assert r.tasks() == {} and r.failures() == {tid(101): FailureReason.BACKEND}
    b.down = False
    clock.now += 60
    r.flush()
    assert b.table == {} and r.applied() == {} and r.failures() == {}


def test_produced_counts_follow_a_process_scope_intent_that_a_thread_exit_leaves(proc: FakeProc) -> None:
    """A thread's exit that leaves a process-scope intent unmatched in its process, while the process's
    winner stays: the other threads no longer count as matched by (and lost to) that intent. The produced
    figures (kept as tasks change) must say so, as a pass over the tables does."""
    proc.add(100, 100, "worker", 50)
    proc.add(100, 101, "python3", 51)
    r, _ = make(proc)
    r.set_policy(policy(("local/p-worker", {"commandRegex": "^worker", "priority": 10, "scope": "process"}),
                        ("local/p-python", {"commandRegex": "^python", "priority": 5, "scope": "process"})))
    r.rescan()
    assert r.intent_figures()["local/p-python"].matched_tasks == 2
    proc.remove(100, 101)
    r.handle_events([ev(EventKind.EXIT, 101, 100)])
    check_invariants(r)
    figures = r.intent_figures()
    assert dict(figures) == intent_stats(r)
    assert figures["local/p-python"].matched_tasks == 0
    assert figures["local/p-worker"].applied_tasks == 1
