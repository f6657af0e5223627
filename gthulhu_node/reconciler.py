"""The reconciler: its inputs put together on one thread (the engine's), over three parts that each own
one thing (docs/watching.md, docs/design.md):
- the task table (gthulhu_node/task_table.py): tasks, matching and winners, no I/O of its own (the reads
  it needs come through `ProcFiles`, below);
- the writer (gthulhu_node/writer.py): desired against applied, the retry queue, the time budget; it
  holds the supervised backend (gthulhu_node/backends/supervisor.py) for life;
- the status projection (gthulhu_node/status_projection.py): figures and task rows, fed by the two.

Inputs: a policy set (`set_policy`, a full recompute), full /proc snapshots (`apply_snapshot`, the ground
truth) and proc connector events (`handle_events`, the fast path). Each ends in the same diff, written as
one batch. Exits remove entries at once; an incomplete snapshot never removes anything. Per-key write
failures: a refused key keeps a typed `FailureReason` (shown on the owning intent's status) and is retried
on its own with exponential backoff (gthulhu_node/outbox.py), and at every full diff; TaskGoneError drops
the entry (the exit event follows).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gthulhu_node.backends.base import ApplyResult, Backend, Entry, EntryKey, KeyKind
from gthulhu_node.backends.supervisor import Checked, SupervisedBackend
from gthulhu_node.matching import Owner, PolicySet, read_owner, read_pod_uid
from gthulhu_node.outbox import FailureReason
from gthulhu_node.status_projection import IntentStats, Match
from gthulhu_node.task_table import TaskTable
from gthulhu_node.tasks.events import EventKind, ProcEvent
from gthulhu_node.tasks.procfs import Snapshot, Task, read_task, snapshot
from gthulhu_node.writer import EntryView, Writer, WriterStats

log = structlog.get_logger(__name__)

_EVENT_NAMES = {k: k.name.lower() for k in EventKind}


@dataclass(slots=True)
class ReconcilerStats(WriterStats):
    """Counters for metrics (read at scrape time through `Reconciler.stats()`): the writer's and the task
    table's. Reaction latencies are not here: they go to the latency listeners (the metrics' histogram)
    only."""

    events: dict[str, int] = field(default_factory=lambda: {k.name.lower(): 0 for k in EventKind})
    events_lost: int = 0
    event_read_errors: int = 0
    scans: int = 0
    scans_incomplete: int = 0
    scan_errors: int = 0
    scan_duration_last_s: float = 0.0
    scan_duration_total_s: float = 0.0
    tasks: int = 0
    processes: int = 0
    matched_tasks: int = 0
    entries_desired: int = 0
    entries_applied: int = 0
    tasks_vanished: int = 0  # an event named a task that was gone before its /proc entry could be read
    # /proc/<tgid>/{cgroup,status} unreadable for a reason other than the process being gone: selectors
    # that ask failed closed, and the read is tried again at the next match
    owner_read_errors: int = 0
    resyncs: int = 0
    policy_updates: int = 0



class Reconciler:
    """The inputs, in order, over the task table, the writer and the status projection. Not thread-safe:
    the engine thread owns it. `check_invariants` asserts each part's invariants, and that the
    projection's counts equal the table's from-scratch recount (`intent_stats`). The counters in
    `_stats` are history, not state. Settle callbacks (`when_settled`) run once no rematch is left and
    nothing is left to write; latency listeners are the writer's."""

    def __init__(
        self,
        backend: Backend,
        *,
        policy: PolicySet | None = None,
        proc_root: Path = Path("/proc"),
        on_latency: Callable[[float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        # held for life: every change of backend (reload, give-up, the stand-in) happens inside it
        self._writer = Writer(
            backend if isinstance(backend, SupervisedBackend) else SupervisedBackend(backend),
            clock=clock, on_latency=on_latency,
        )
        self.proc_root = proc_root
        self._clock = clock
        self._table = TaskTable(policy or PolicySet.empty(), ProcFiles(proc_root), self._writer, clock)
        self._status = self._table.status
        self._stats = ReconcilerStats()
        self._revision = 0  # inputs seen; `revision` adds the writer's batches
        # Called on this thread when the reconciler settles with callbacks waiting, before them: the
        # engine publishes status there, so whoever waited for the settle reads status that includes it.
        self.before_settled: Callable[[], None] | None = None
        self._on_settled: list[Callable[[], None]] = []

    # ---- inputs -------------------------------------------------------------------------------------

    @property
    def policy(self) -> PolicySet:
        return self._table.policy

    @property
    def backend(self) -> SupervisedBackend:
        """The one backend, held (by the writer) for life: reloads and replacements happen inside it."""
        return self._writer.backend

    @property
    def revision(self) -> int:
        """Grows when an input or a write may have changed the tables: the engine publishes then (feed.py)."""
        return self._revision + self._table.rematched + self._writer.stats.batches

    @property
    def budget_s(self) -> float | None:
        """None: a change finishes in the call (tests, preview). The engine sets a few ms: its thread feeds
        the watchdog, so a rematch and a long write go in slices of this much, one per loop turn (`step`)."""
        return self._writer.budget_s

    @budget_s.setter
    def budget_s(self, seconds: float | None) -> None:
        self._writer.budget_s = seconds

    @property
    def hold_writes(self) -> bool:
        """Down (ejected, reloading) or held (SupervisedBackend.held): nothing written until `resync`."""
        return self.backend.held

    def backend_changed(self, checked: Checked) -> None:
        """After the supervisor's health check: a backend running again (reloaded, or a replacement) gets
        every entry written again; a replacement that covers processes differently (TGID entries or a
        TID entry per thread) gets every process rematched first."""
        if checked is Checked.REPLACED_OTHER_SCOPE:
            self._restale(self.policy)
            self._table.rematch(self._clock() + self.budget_s if self.budget_s is not None else math.inf)
        if checked in (Checked.RELOADED, Checked.REPLACED, Checked.REPLACED_OTHER_SCOPE):
            self.resync()

    def set_policy(self, policy: PolicySet) -> ApplyResult:
        """Replace the policy set and recompute every task's strategy, then write the difference.

        Without a `budget_s` all of it happens in this call. With one, this call does the first slice and
        `step` the rest; until then each process keeps the strategies of the policy it was matched with
        (`settled` is False), and a process an event touches is rematched first."""
        self._restale(policy)
        if self.budget_s is None:
            self._table.rematch(math.inf)
            return self.flush()
        return self.step()

    def _restale(self, policy: PolicySet) -> None:
        """Take `policy`: every process keeps its winners under the old one until rematched."""
        self._table.take_policy(policy)
        self._stats.policy_updates += 1
        self._revision += 1
        self._status.all_touched = True
        self._writer.forget_intents_but(policy.by_key)
        self._writer.retry_refused_now()  # under the new policy, not after their backoff

    @property
    def settled(self) -> bool:
        """No rematch in progress and nothing left to write (or writes held): what the tables say is what
        the backend holds, apart from refused keys."""
        return not self._table.stale and (not self._writer.dirty or self.hold_writes)

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on this thread once `settled` (now if it is), in the order registered."""
        self._on_settled.append(callback)
        self._notify_settled()

    def step(self) -> ApplyResult:
        """One slice of pending work: rematch processes for up to `budget_s`, then write for up to as long
        (the engine calls this every loop turn while `settled` is False)."""
        budget = self.budget_s
        if self._table.stale:
            self._table.rematch(self._clock() + budget if budget is not None else math.inf)
        return self.flush()

    def _notify_settled(self) -> None:
        if self._on_settled and self.settled:
            if self.before_settled is not None:
                self.before_settled()
            callbacks, self._on_settled = self._on_settled, []
            for cb in callbacks:
                try:
                    cb()
                except Exception as exc:  # one listener's failure must not stop the others or the engine
                    log.exception("settled_callback_failed", error=str(exc))

    def apply_snapshot(self, snap: Snapshot) -> ApplyResult:
        """Make the task table agree with a full scan, then diff everything and write.

        Only a complete snapshot removes tasks it did not see (or saw with another start time).
        """
        st = self._stats
        st.scans += 1
        self._revision += 1
        st.scan_errors += snap.errors
        st.scan_duration_last_s = snap.duration_s
        st.scan_duration_total_s += snap.duration_s
        table = self._table
        if snap.complete:
            seen, threads = snap.tasks, table.threads
            for tid in [t for t, th in threads.items() if (s := seen.get(t)) is None or s != th.task]:
                new = seen.get(tid)
                old = threads[tid].task
                if new is None or new.start_time != old.start_time or new.tgid != old.tgid:
                    table.remove(tid, 0)
        else:
            st.scans_incomplete += 1
            log.warning("proc_scan_incomplete", errors=snap.errors, tasks=len(snap.tasks))
        for task in snap.tasks.values():
            table.put(task, 0)
        self._writer.mark_all_dirty()
        return self.flush()

    def rescan(self) -> ApplyResult:
        """Take a full snapshot of `proc_root` and apply it."""
        return self.apply_snapshot(snapshot(self.proc_root))

    def handle_events(self, events: Iterable[ProcEvent]) -> ApplyResult:
        """Apply events in order, then write everything they changed as one batch."""
        counts = self._stats.events
        table = self._table
        threads, procs = table.threads, table.procs
        reowned: dict[int, int] = {}  # tgid -> event time: processes whose owner must be read again
        self._revision += 1
        for ev in events:
            kind = ev.kind
            counts[_EVENT_NAMES[kind]] += 1
            if kind is EventKind.EXIT:
                th = threads.get(ev.tid)
                if th is not None and th.task.tgid == ev.tgid:
                    table.remove(ev.tid, ev.timestamp_ns)
            elif kind is EventKind.COMM:
                th = threads.get(ev.tid)
                if th is not None and th.task.tgid == ev.tgid and ev.comm is not None:
                    old = th.task
                    if old.comm != ev.comm:
                        table.put(Task(old.tgid, old.tid, ev.comm, old.start_time), ev.timestamp_ns)
                else:
                    table.read_and_put(ev.tgid, ev.tid, ev.timestamp_ns)
            elif kind is EventKind.FORK:
                table.read_and_put(ev.tgid, ev.tid, ev.timestamp_ns)
            elif kind is EventKind.EXEC:
                # After exec a process has one thread, which holds the TGID; drop the others (the thread
                # that called exec changed its TID to the TGID without an exit event).
                proc = procs.get(ev.tgid)
                if proc is not None:
                    for tid in [t for t in proc.tids if t != ev.tgid]:
                        table.remove(tid, ev.timestamp_ns)
                    table.forget_owner(proc, ev.timestamp_ns, reowned)  # another executable, maybe user
                table.read_and_put(ev.tgid, ev.tgid, ev.timestamp_ns)
            elif kind is EventKind.UID:
                proc = procs.get(ev.tgid)
                if proc is not None:
                    table.forget_owner(proc, ev.timestamp_ns, reowned)
        for tgid, ts in reowned.items():
            if (proc := procs.get(tgid)) is not None and tgid not in table.stale:
                table.rematch_proc(proc, ts)
        return self.flush()

    def note_events_lost(self) -> None:
        """The event source dropped events; the engine rescans at once."""
        self._stats.events_lost += 1
        self._revision += 1

    def note_event_read_error(self) -> None:
        self._stats.event_read_errors += 1
        self._revision += 1

    def resync(self) -> ApplyResult:
        """Re-read what the backend holds (after a restart or reload) and write every difference."""
        self._stats.resyncs += 1
        self._revision += 1
        self._status.rows_all = True
        self._writer.read_back()
        return self.flush()

    # ---- outputs ------------------------------------------------------------------------------------

    def desired(self) -> dict[EntryKey, Entry]:
        return self._writer.desired()

    def applied(self) -> dict[EntryKey, Entry]:
        return self._writer.applied()

    def tasks(self) -> dict[int, Task]:
        return {tid: th.task for tid, th in self._table.threads.items()}

    def failures(self) -> dict[EntryKey, FailureReason]:
        """Keys the backend refused and that wait for their retry, with why."""
        return self._writer.failures()

    def explain_view(self, tid: int, tgid: int) -> tuple[dict[EntryKey, EntryView], str]:
        """For `explain`, O(1): the writer's view of the thread's TID and TGID keys, its winner's key."""
        th = self._table.threads.get(tid)
        keys = (EntryKey(KeyKind.TID, tid), EntryKey(KeyKind.TGID, tgid))
        return {k: self._writer.view(k) for k in keys}, th.winner.key if th and th.winner else ""

    def next_retry_at(self) -> float:
        """When the earliest refused key is due to be written again (monotonic seconds; inf if none).
        The engine wakes up then; any `flush` from that moment on writes it."""
        return self._writer.next_retry_at()

    def matches(self) -> list[Match]:
        """Every task some intent matched, with the one intent whose strategy it gets (from scratch)."""
        out = [row for tid in self._table.threads if (row := self._status.row(tid)) is not None]
        out.sort(key=lambda m: (m.tgid, m.tid))
        return out

    def task_rows(self) -> Mapping[int, Match]:
        """The rows of `matches` by TID, produced (StatusProjection.rows). The engine publishes them."""
        return self._status.rows()

    def intent_figures(self) -> Mapping[str, IntentStats]:
        """Per-intent figures equal to `intent_stats`'s, produced (StatusProjection.figures). The engine
        publishes them (gthulhu_node/feed.py); no record is changed once returned."""
        return self._status.figures(self.policy)

    def stats(self) -> ReconcilerStats:
        st = self._stats
        table = self._table
        st.tasks = len(table.threads)
        st.processes = len(table.procs)
        st.tasks_vanished, st.owner_read_errors = table.vanished, table.owner_read_errors
        st.matched_tasks = self._status.matched
        st.entries_desired, st.entries_applied = self._writer.sizes
        ws = self._writer.stats
        for name in WriterStats.__dataclass_fields__:
            setattr(st, name, getattr(ws, name))
        copy = ReconcilerStats(**{f: getattr(st, f) for f in ReconcilerStats.__dataclass_fields__})
        copy.events = dict(st.events)
        return copy

    def check_invariants(self) -> None:
        """Assert each part's invariants (tests call it after every step; tests/unit/recount.py adds
        that the projection's counts are what a pass over the task table gives)."""
        self._table.check_invariants()
        self._writer.check_invariants()

    # ---- writing ------------------------------------------------------------------------------------

    def flush(self) -> ApplyResult:
        """Write every dirty key, and every refused key whose retry is due, whose desired value differs
        from what the backend holds: as one batch, or with a `budget_s` in batches until about that long
        has passed (event-caused keys first; the rest stay dirty for the next `step`).

        Log lines about (un)matched tasks are emitted after the write, so rendering them never delays it.
        """
        try:
            return self._writer.flush()
        finally:
            if self._table.pending_logs:
                logs, self._table.pending_logs = self._table.pending_logs, []
                for event, fields in logs:
                    if event == "task_matched":
                        log.info(event, **fields)
                    else:
                        log.debug(event, **fields)
            self._notify_settled()

    def add_latency_listener(self, listener: Callable[[float], None]) -> None:
        """Also call `listener(seconds)` for every event-caused write (metrics' histogram). Thread-safe."""
        self._writer.add_latency_listener(listener)


@dataclass(frozen=True, slots=True)
class ProcFiles:
    """The task table's reads (task_table.ProcReader) from /proc under `root`."""

    root: Path

    def task(self, tgid: int, tid: int) -> Task | None:
        return read_task(tgid, tid, self.root)

    def owner(self, tgid: int) -> Owner | None:
        return read_owner(tgid, self.root)

    def pod_uid(self, tgid: int) -> str | None:
        return read_pod_uid(tgid, self.root)
