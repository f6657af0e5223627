"""The reconciler against a simple model: random processes, threads, renames, exits, execs, lost events,
policy changes and backend refusals, checked after every step.

The model knows the true task table (what the fake /proc holds) and computes the desired entries from
scratch with matching.py's precedence (no incremental bookkeeping); the reconciler must agree with it
whenever it has seen every change (events delivered, or a full rescan after lost ones), and must never
believe the backend holds anything it does not. `Reconciler.check_invariants` asserts its own structures'
invariants after every step.

Status is produced, not recomputed (gthulhu_node/feed.py): `Reconciler.intent_figures` builds per-intent
figures from counts the reconciler keeps as tasks are matched and entries written, and
`Reconciler.task_rows` rebuilds only the task rows that changed. The `publish` rule (at
random gaps, as the engine publishes after some loop turns and not others) and, in
`PublishedEveryStepModel`, an invariant after every step check that what it produces equals
`intent_stats` and `matches`, the same computed from scratch from the tables.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from gthulhu_node.backends.base import ApplyResult, BackendError, Entry, EntryKey, KeyKind, MapFullError
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import CompiledIntent, PolicySet, best
from gthulhu_node.outbox import RETRY_MAX_S
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.events import EventKind, ProcEvent
from tests.unit.fakeproc import FakeProc
from tests.unit.recount import check_invariants, intent_stats

COMMS = ("EngineCore_DP0", "EngineCore_DP1", "worker", "python3", "idle")
# Thread and process scope, overlapping patterns, equal strategies (a TGID entry covers a thread), noops.
POOL: dict[str, dict[str, Any]] = {
    # same strategy as p-worker and a key that ranks first: wins EngineCore threads, yet the TGID covers them
    "a-engine": {"commandRegex": "^EngineCore", "priority": 10},
    "t-dp1": {"commandRegex": "DP1$", "priority": 12, "executionTime": 1_000_000},
    "p-python": {"commandRegex": "^python", "priority": 5, "scope": "process"},
    "p-worker": {"commandRegex": "^(worker|EngineCore)", "priority": 10, "scope": "process"},
    "t-noop": {"commandRegex": "DP0|idle", "priority": 0},
    "p-noop": {"commandRegex": "^idle", "priority": 0, "scope": "process"},
}
TIDS = range(10, 30)
# What happens to a change's event: read at once (most), left for a later batch, or lost (one in six).
FATE = st.sampled_from(("now", "now", "now", "now", "batch", "lost"))


def build(names: Iterable[str]) -> PolicySet:
    return PolicySet.build(
        [(f"local/{n}", Intent.model_validate({"id": n, **POOL[n]})) for n in sorted(names)]
    )


@dataclass(frozen=True)
class T:
    tgid: int
    comm: str
    start: int


def model_winners(policy: PolicySet, tasks: Mapping[int, T]) -> tuple[dict[int, CompiledIntent],
                                                                       dict[EntryKey, Entry],
                                                                       dict[str, tuple[int, int, int]]]:
    """Each task's winner, the desired table, and per intent (matched, applied, lost), from scratch."""
    procs: dict[int, list[int]] = {}
    for tid, t in tasks.items():
        procs.setdefault(t.tgid, []).append(tid)
    winners: dict[int, CompiledIntent] = {}
    desired: dict[EntryKey, Entry] = {}
    counts = {c.key: [0, 0, 0] for c in policy.ordered}
    for tgid, tids in procs.items():
        pmatch = {c for tid in tids for c in policy.match(tasks[tid].comm).process}
        pw = best(pmatch)
        if pw is not None and not pw.is_noop:
            desired[EntryKey(KeyKind.TGID, tgid)] = Entry(pw.priority, pw.slice_ns, tasks[tgid].start)
        for tid in tids:
            thread = policy.match(tasks[tid].comm).thread
            w = best((thread[0] if thread else None, pw))
            if w is None:
                continue
            winners[tid] = w
            for c in {*thread, *pmatch}:
                counts[c.key][0] += 1
                counts[c.key][1 if c is w else 2] += 1
            covered = pw is not None and not pw.is_noop and (
                pw is w or (pw.priority, pw.slice_ns) == (w.priority, w.slice_ns))
            if not w.is_noop and not covered:
                desired[EntryKey(KeyKind.TID, tid)] = Entry(w.priority, w.slice_ns, tasks[tid].start)
    return winners, desired, {k: (m, a, lost) for k, (m, a, lost) in counts.items()}


class Backend(DryRunBackend):
    """Refuses upserts of chosen ids as a full map, or (while `down`) every batch."""

    def __init__(self) -> None:
        super().__init__()
        self.refuse: set[int] = set()
        self.down = False

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        if self.down:
            raise BackendError("backend is busy")
        refused = {k for k in upserts if k.id in self.refuse}
        result = super().apply({k: v for k, v in upserts.items() if k not in refused}, deletes)
        result.failed.update({k: MapFullError(f"{k}: full") for k in refused})
        return result


class ReconcilerModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="gn-model-"))
        self.proc = FakeProc(self.dir / "proc")
        self.now = 1000.0
        self.backend = Backend()
        self.backend.start()
        self.r = Reconciler(self.backend, proc_root=self.proc.root, clock=lambda: self.now)
        self.tasks: dict[int, T] = {}
        self.policy = PolicySet.empty()
        self.queued: list[ProcEvent] = []  # events the kernel sent that the reconciler has not read yet
        self.stale = False  # a change happened whose event was lost: the next read rescans
        self.clock_ns = 0
        self.starts = 0

    def teardown(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- the world ------------------------------------------------------------------------------

    def _send(self, ev: ProcEvent, fate: str) -> None:
        if fate == "lost":
            self.stale = True
            return
        self.clock_ns += 1
        self.queued.append(ev)
        if fate == "now":
            self.deliver()

    def _add(self, tgid: int, tid: int, comm: str, fate: str) -> None:
        self.starts += 1
        self.tasks[tid] = T(tgid, comm, self.starts)
        self.proc.add(tgid, tid, comm, self.starts)
        self._send(ProcEvent(EventKind.FORK, tid, tgid, self.clock_ns, None), fate)

    @initialize(names=st.sets(st.sampled_from(sorted(POOL))))
    def start(self, names: set[str]) -> None:
        self.policy = build(names)
        self.r.set_policy(self.policy)

    @rule(data=st.data(), comm=st.sampled_from(COMMS), fate=FATE)
    def new_process(self, data: st.DataObject, comm: str, fate: str) -> None:
        free = [t for t in TIDS if t not in self.tasks]
        if free:
            tid = data.draw(st.sampled_from(free))
            self._add(tid, tid, comm, fate)

    @precondition(lambda self: self.tasks)
    @rule(data=st.data(), comm=st.sampled_from(COMMS), fate=FATE)
    def new_thread(self, data: st.DataObject, comm: str, fate: str) -> None:
        free = [t for t in TIDS if t not in self.tasks and not (self.proc.root / str(t)).exists()]
        if free:
            tgid = data.draw(st.sampled_from(sorted({t.tgid for t in self.tasks.values()})))
            self._add(tgid, data.draw(st.sampled_from(free)), comm, fate)

    @precondition(lambda self: self.tasks)
    @rule(data=st.data(), comm=st.sampled_from(COMMS), fate=FATE)
    def rename(self, data: st.DataObject, comm: str, fate: str) -> None:
        tid = data.draw(st.sampled_from(sorted(self.tasks)))
        t = self.tasks[tid]
        self.tasks[tid] = T(t.tgid, comm, t.start)
        self.proc.rename(t.tgid, tid, comm)
        self._send(ProcEvent(EventKind.COMM, tid, t.tgid, self.clock_ns, comm), fate)

    @precondition(lambda self: any(tid != t.tgid for tid, t in self.tasks.items()))
    @rule(data=st.data(), fate=FATE)
    def thread_exits(self, data: st.DataObject, fate: str) -> None:
        tid = data.draw(st.sampled_from(sorted(tid for tid, t in self.tasks.items() if tid != t.tgid)))
        t = self.tasks.pop(tid)
        self.proc.remove(t.tgid, tid)
        self._send(ProcEvent(EventKind.EXIT, tid, t.tgid, self.clock_ns, None), fate)

    @precondition(lambda self: self.tasks)
    @rule(data=st.data(), fate=FATE)
    def process_exits(self, data: st.DataObject, fate: str) -> None:
        tgid = data.draw(st.sampled_from(sorted({t.tgid for t in self.tasks.values()})))
        self.proc.remove(tgid)
        for tid in sorted(tid for tid, t in self.tasks.items() if t.tgid == tgid):
            del self.tasks[tid]
            self._send(ProcEvent(EventKind.EXIT, tid, tgid, self.clock_ns, None), fate)

    @precondition(lambda self: self.tasks)
    @rule(data=st.data(), comm=st.sampled_from(COMMS), fate=FATE)
    def process_execs(self, data: st.DataObject, comm: str, fate: str) -> None:
        """The other threads vanish without exit events; the leader carries the new program's name."""
        tgid = data.draw(st.sampled_from(sorted({t.tgid for t in self.tasks.values()})))
        for tid in [tid for tid, t in self.tasks.items() if t.tgid == tgid and tid != tgid]:
            del self.tasks[tid]
            self.proc.remove(tgid, tid)
        self.tasks[tgid] = T(tgid, comm, self.tasks[tgid].start)
        self.proc.rename(tgid, tgid, comm)
        self._send(ProcEvent(EventKind.EXEC, tgid, tgid, self.clock_ns, None), fate)

    # ---- the agent -------------------------------------------------------------------------------

    @rule()
    def deliver(self) -> None:
        """The engine reads every pending event as one batch; when the kernel dropped some, it learns so
        from that read (ENOBUFS) and rescans at once, as `Engine` does."""
        batch, self.queued = self.queued, []
        self.r.handle_events(batch)
        if self.stale:
            self.r.note_events_lost()
            self.rescan()

    @rule()
    def rescan(self) -> None:
        self.r.handle_events(self.queued)
        self.queued = []
        self.r.rescan()
        self.stale = False

    @rule(names=st.sets(st.sampled_from(sorted(POOL))))
    def set_policy(self, names: set[str]) -> None:
        self.policy = build(names)
        self.r.set_policy(self.policy)

    @rule(ids=st.sets(st.sampled_from(TIDS), max_size=4))
    def backend_refuses_some(self, ids: set[int]) -> None:
        self.backend.refuse = ids

    @rule()
    def backend_refuses_everything(self) -> None:
        self.backend.down = True

    @rule(seconds=st.sampled_from((0.05, 0.1, 0.5, 3.0, RETRY_MAX_S)))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.r.flush()  # what the engine does when it wakes up

    @rule()
    def backend_recovers(self) -> None:
        """Once the backend takes everything, retries alone (no rescan, no event) make it hold the table."""
        self.backend.refuse, self.backend.down = set(), False
        self.now += RETRY_MAX_S
        self.r.flush()
        assert self.r.failures() == {}
        assert self.backend.table == self.r.applied() == self.r.desired()

    @rule()
    def publish(self) -> None:
        """What the engine publishes (after any number of steps since its last publication) is what a
        pass over the tables gives, every field: counts, overlaps, failures, refused and unwritten, and
        every task row (its winner, the key carrying it, whether the backend holds it)."""
        self._check_produced()

    def _check_produced(self) -> None:
        produced = dict(self.r.intent_figures())
        assert produced == intent_stats(self.r)
        assert dict(self.r.task_rows()) == {m.tid: m for m in self.r.matches()}

    # ---- checks ----------------------------------------------------------------------------------

    @invariant()
    def structures_hold(self) -> None:
        check_invariants(self.r)

    @invariant()
    def applied_is_what_the_backend_holds(self) -> None:
        assert self.r.applied() == self.backend.table

    @invariant()
    def agrees_with_the_model_once_caught_up(self) -> None:
        if self.queued or self.stale:
            return
        winners, desired, counts = model_winners(self.policy, self.tasks)
        assert {tid: (t.tgid, t.comm, t.start_time) for tid, t in self.r.tasks().items()} == {
            tid: (t.tgid, t.comm, t.start) for tid, t in self.tasks.items()}
        assert self.r.desired() == desired
        assert {m.tid: m.intent_key for m in self.r.matches()} == {t: w.key for t, w in winners.items()}
        stats = intent_stats(self.r)
        assert {k: (s.matched_tasks, s.applied_tasks, s.lost_tasks) for k, s in stats.items()} == counts
        failed = self.r.failures()
        for key, entry in desired.items():
            assert self.backend.table.get(key) == entry or key in failed
        pending = {k: s.pending_failures for k, s in stats.items() if s.pending_failures}
        owners: dict[str, int] = {}
        for key in failed:
            if key in desired:
                w = self._owner_of(key, winners)
                owners[w] = owners.get(w, 0) + 1
        assert pending == owners

    def _owner_of(self, key: EntryKey, winners: Mapping[int, CompiledIntent]) -> str:
        if key.kind is KeyKind.TID:
            return winners[key.id].key
        comms = {t.comm for t in self.tasks.values() if t.tgid == key.id}
        pmatch = {c for comm in comms for c in self.policy.match(comm).process}
        w = best(pmatch)
        assert w is not None
        return w.key


class SlicedReconcilerModel(ReconcilerModel):
    """The same world with the engine's budget at its smallest (0 s): a policy change rematches one process
    per `step` and every flush writes one key, so events and policy changes land mid-rematch and
    mid-write. The reconciler must agree with the model once `settled`, and `when_settled` (what the agent
    waits for before it calls a policy in effect) must never fire while an entry is neither written nor
    refused."""

    def __init__(self) -> None:
        super().__init__()
        self.r.budget_s = 0.0
        self.fired = 0

    def _settle(self) -> None:
        for _ in range(10_000):
            if self.r.settled:
                return
            self.r.step()
        raise AssertionError("the reconciler never settled")

    @rule()
    def step(self) -> None:
        """One engine loop turn with nothing else to do."""
        self.r.step()

    @rule()
    def settle(self) -> None:
        self._settle()

    @rule()
    def wait_until_settled(self) -> None:
        fired_before = self.fired

        def check() -> None:
            assert self.r.settled
            failed = self.r.failures()
            for key, entry in self.r.desired().items():
                assert self.backend.table.get(key) == entry or key in failed, key
            self.fired += 1

        self.r.when_settled(check)
        self._settle()
        assert self.fired == fired_before + 1

    @rule()
    def backend_recovers(self) -> None:
        self.backend.refuse, self.backend.down = set(), False
        self.now += RETRY_MAX_S
        self.r.flush()
        self._settle()
        assert self.r.failures() == {}
        assert self.backend.table == self.r.applied() == self.r.desired()

    @invariant()
    def agrees_with_the_model_once_caught_up(self) -> None:
        if self.r.settled:
            super().agrees_with_the_model_once_caught_up()


class PublishedEveryStepModel(SlicedReconcilerModel):
    """The sliced world with status produced after every step, mid-rematch and mid-write included."""

    @invariant()
    def produced_status_is_status_from_scratch(self) -> None:
        self._check_produced()


ReconcilerModel.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_reconciler_against_the_model = ReconcilerModel.TestCase
SlicedReconcilerModel.TestCase.settings = ReconcilerModel.TestCase.settings
test_sliced_reconciler_against_the_model = SlicedReconcilerModel.TestCase
PublishedEveryStepModel.TestCase.settings = ReconcilerModel.TestCase.settings
test_status_produced_every_step_against_scratch = PublishedEveryStepModel.TestCase
