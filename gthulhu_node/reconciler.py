"""The reconciler: owns the desired strategy table and is the only writer to the backend (docs/watching.md).

Inputs, all on one thread (the engine's): a policy set (`set_policy`, a full recompute), full /proc
snapshots (`apply_snapshot`, the ground truth) and proc connector events (`handle_events`, the fast path).
Each ends in the same diff: the desired table {EntryKey -> Entry} against the reconciler's own view of what
the backend holds (`applied`, re-read from the backend by `resync` after a backend restart), written as one
batch.

Rules it implements:
- A task is (tid, start_time): a TID seen with another start time is a new task (the old one is gone).
- One task gets exactly one intent's strategy (matching.py's precedence), never a merge.
- scope=process: the strongest process-scope intent matching any thread of a process becomes that
  process's TGID entry, so threads it creates later are covered by the kernel at once. A thread whose own
  winner (its thread-scope matches and the process winner) gives something else gets a TID entry.
- Noop intents (priority 0, executionTime 0) match and win like any other but write nothing.
- Exits remove entries at once; an incomplete snapshot never removes anything.
- Per-key write failures: a refused key keeps a typed `FailureReason` (shown on the owning intent's status)
  and is retried on its own with exponential backoff (gthulhu_node/outbox.py), and at every full diff;
  TaskGoneError drops the entry (the exit event follows).
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
from gthulhu_node.matching import CompiledIntent, Owner, PolicySet, best, read_owner, read_pod_uid
from gthulhu_node.outbox import FailureReason
from gthulhu_node.status_projection import IntentCount, IntentStats, Match, StatusProjection
from gthulhu_node.tasks.events import EventKind, ProcEvent
from gthulhu_node.tasks.procfs import Snapshot, Task, read_task, snapshot
from gthulhu_node.writer import Writer, WriterStats

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


@dataclass(slots=True, eq=False)
class _Thread:
    task: Task
    winner: CompiledIntent | None = None  # the one intent whose strategy it gets (noop included)
    # the keys of the thread-scope intents it matched (eligible ones) when its winner was last computed
    cands: frozenset[str] = frozenset()
    # what this thread adds to the per-intent counts now: (every intent it matches, its winner's key)
    counted: tuple[frozenset[str], str] | None = None


@dataclass(slots=True, eq=False)
class _Proc:
    tgid: int
    tids: set[int] = field(default_factory=set)
    start_time: int | None = None  # the leader's, for the TGID entry
    # scope=process intents matched by this process's threads: intent key -> number of threads
    pmatch: dict[str, int] = field(default_factory=dict)
    winner: CompiledIntent | None = None
    pod: str | None = None  # normalized pod UID, read from /proc/<tgid>/cgroup when first needed
    pod_known: bool = False
    owner: Owner | None = None  # read from /proc/<tgid> when an intent first asks who the process is
    owner_known: bool = False


class Reconciler:
    """Tasks, matching and winners, turned into the writer's desired entries. Not thread-safe: the engine
    thread owns it.

    Its state (`check_invariants` asserts each part's invariant):
    - the task table, `_threads` (tid -> task and its winner) and `_procs` (tgid -> threads, process-scope
      match counts, process winner): every thread is in exactly its own process's `tids`, every process
      has a thread, and every winner is what matching.py's precedence gives for the current policy;
    - the writer (gthulhu_node/writer.py): the desired entries, exactly what the task table implies, what
      the backend holds, and the retry queue; it holds the supervised backend for life.
    The counters in `_stats` are history, not state.
    The status projection (gthulhu_node/status_projection.py) is fed as the table changes: each thread
    with a winner adds what it counts (`_Thread.counted`) and takes it back when matched again or
    removed, so status is produced (`intent_figures`, `task_rows`), not recomputed from scratch for every
    reader (`intent_stats` is that from-scratch reference; `check_invariants` asserts they agree).

    Latency listeners (`on_latency` and `add_latency_listener`) are the writer's (gthulhu_node/writer.py).
    """

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
        self._policy = policy or PolicySet.empty()
        self._threads: dict[int, _Thread] = {}
        self._procs: dict[int, _Proc] = {}
        self._stats = ReconcilerStats()
        self._status = StatusProjection(self._threads, self._procs, self._writer)
        self._revision = 0  # inputs seen; `revision` adds the writer's batches
        # Called on this thread when the reconciler settles with callbacks waiting, before them: the
        # engine publishes status there, so whoever waited for the settle reads status that includes it.
        self.before_settled: Callable[[], None] | None = None
        self._pending_logs: list[tuple[str, dict[str, object]]] = []
        # Processes whose winners were computed with an older policy than `_policy` (tgid -> that policy):
        # they keep its strategies until rematched, by `step` or before anything changes them.
        self._stale: dict[int, PolicySet] = {}
        self._on_settled: list[Callable[[], None]] = []

    # ---- inputs -------------------------------------------------------------------------------------

    @property
    def policy(self) -> PolicySet:
        return self._policy

    @property
    def backend(self) -> SupervisedBackend:
        """The one backend, held (by the writer) for life: reloads and replacements happen inside it."""
        return self._writer.backend

    @property
    def revision(self) -> int:
        """Grows whenever an input or a write may have changed what the tables say: the engine publishes
        status (gthulhu_node/feed.py) when it moved since the last publication."""
        return self._revision + self._writer.stats.batches

    @property
    def budget_s(self) -> float | None:
        """None: a policy change and a flush finish in the call (tests, preview). The engine sets a few
        milliseconds: its thread feeds the watchdog and answers callers, so a rematch and a long write
        are done in slices of about this much, one per loop turn (`step`), events handled in between."""
        return self._writer.budget_s

    @budget_s.setter
    def budget_s(self, seconds: float | None) -> None:
        self._writer.budget_s = seconds

    @property
    def hold_writes(self) -> bool:
        """The backend is down (ejected, reloading) or held: changes accumulate, nothing is written;
        `resync` writes everything once it is back (the supervisor decides: SupervisedBackend.held)."""
        return self.backend.held

    def backend_changed(self, checked: Checked) -> None:
        """After the supervisor's health check: a backend running again (reloaded, or a replacement) gets
        every entry written again; a replacement that covers processes differently (TGID entries or a
        TID entry per thread) gets every process rematched first."""
        if checked is Checked.REPLACED_OTHER_SCOPE:
            self._restale(self._policy)
            self._rematch(self._clock() + self.budget_s if self.budget_s is not None else math.inf)
        if checked in (Checked.RELOADED, Checked.REPLACED, Checked.REPLACED_OTHER_SCOPE):
            self.resync()

    def set_policy(self, policy: PolicySet) -> ApplyResult:
        """Replace the policy set and recompute every task's strategy, then write the difference.

        Without a `budget_s` all of it happens in this call. With one, this call does the first slice and
        `step` the rest; until then each process keeps the strategies of the policy it was matched with
        (`settled` is False), and a process an event touches is rematched first."""
        self._restale(policy)
        if self.budget_s is None:
            self._rematch(math.inf)
            return self.flush()
        return self.step()

    def _restale(self, policy: PolicySet) -> None:
        """Take `policy`: every process keeps its winners under the old one until rematched."""
        old = self._policy
        self._policy = policy
        self._stats.policy_updates += 1
        self._revision += 1
        self._status.all_touched = True
        self._writer.forget_intents_but(policy.by_key)
        stale = self._stale
        for tgid in self._procs:
            stale.setdefault(tgid, old)
        self._writer.retry_refused_now()  # under the new policy, not after their backoff

    @property
    def settled(self) -> bool:
        """No rematch in progress and nothing left to write (or writes held): what the tables say is what
        the backend holds, apart from refused keys."""
        return not self._stale and (not self._writer.dirty or self.hold_writes)

    def when_settled(self, callback: Callable[[], None]) -> None:
        """Call `callback()` on this thread once `settled` (now if it is), in the order registered."""
        self._on_settled.append(callback)
        self._notify_settled()

    def step(self) -> ApplyResult:
        """One slice of pending work: rematch processes for up to `budget_s`, then write for up to as long
        (the engine calls this every loop turn while `settled` is False)."""
        budget = self.budget_s
        if self._stale:
            self._rematch(self._clock() + budget if budget is not None else math.inf)
        return self.flush()

    def _rematch(self, deadline: float) -> None:
        stale, procs, clock = self._stale, self._procs, self._clock
        n = 0
        while stale:
            if n and clock() >= deadline:
                return
            tgid = next(iter(stale))
            self._rematch_proc(procs[tgid])
            self._revision += 1
            n += 1
        log.info("policy_applied", intents=len(self._policy), tasks=len(self._threads),
                 entries=self._writer.sizes[0])

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
        if snap.complete:
            seen = snap.tasks
            for tid in [t for t, th in self._threads.items() if (s := seen.get(t)) is None or s != th.task]:
                new = seen.get(tid)
                old = self._threads[tid].task
                if new is None or new.start_time != old.start_time or new.tgid != old.tgid:
                    self._remove_task(tid, 0)
        else:
            st.scans_incomplete += 1
            log.warning("proc_scan_incomplete", errors=snap.errors, tasks=len(snap.tasks))
        for task in snap.tasks.values():
            self._put_task(task, 0)
        self._writer.mark_all_dirty()
        return self.flush()

    def rescan(self) -> ApplyResult:
        """Take a full snapshot of `proc_root` and apply it."""
        return self.apply_snapshot(snapshot(self.proc_root))

    def handle_events(self, events: Iterable[ProcEvent]) -> ApplyResult:
        """Apply events in order, then write everything they changed as one batch."""
        counts = self._stats.events
        threads = self._threads
        reowned: dict[int, int] = {}  # tgid -> event time: processes whose owner must be read again
        self._revision += 1
        for ev in events:
            kind = ev.kind
            counts[_EVENT_NAMES[kind]] += 1
            if kind is EventKind.EXIT:
                th = threads.get(ev.tid)
                if th is not None and th.task.tgid == ev.tgid:
                    self._remove_task(ev.tid, ev.timestamp_ns)
            elif kind is EventKind.COMM:
                th = threads.get(ev.tid)
                if th is not None and th.task.tgid == ev.tgid and ev.comm is not None:
                    old = th.task
                    if old.comm != ev.comm:
                        self._put_task(Task(old.tgid, old.tid, ev.comm, old.start_time), ev.timestamp_ns)
                else:
                    self._read_and_put(ev.tgid, ev.tid, ev.timestamp_ns)
            elif kind is EventKind.FORK:
                self._read_and_put(ev.tgid, ev.tid, ev.timestamp_ns)
            elif kind is EventKind.EXEC:
                # After exec a process has one thread, which holds the TGID; drop the others (the thread
                # that called exec changed its TID to the TGID without an exit event).
                proc = self._procs.get(ev.tgid)
                if proc is not None:
                    for tid in [t for t in proc.tids if t != ev.tgid]:
                        self._remove_task(tid, ev.timestamp_ns)
                    self._forget_owner(proc, ev.timestamp_ns, reowned)  # another executable, maybe user
                self._read_and_put(ev.tgid, ev.tgid, ev.timestamp_ns)
            elif kind is EventKind.UID:
                proc = self._procs.get(ev.tgid)
                if proc is not None:
                    self._forget_owner(proc, ev.timestamp_ns, reowned)
        for tgid, ts in reowned.items():
            if (proc := self._procs.get(tgid)) is not None and tgid not in self._stale:
                self._rematch_proc(proc, ts)
        return self.flush()

    def _forget_owner(self, proc: _Proc, ts: int, reowned: dict[int, int]) -> None:
        """Who the process is may have changed (setuid, exec): the owner selectors are evaluated again,
        with a fresh read, for every thread of it. Without this a root process that named a thread, then
        dropped to nobody and exec'd, kept a boost `named_only` denies nobody (issue 38, item 7). The
        rematch is done once per process at the end of the batch (a setuid is one event per thread)."""
        if not proc.owner_known:
            return  # never read, nothing cached: the next match reads it
        proc.owner_known = False
        proc.owner = None
        if self._policy.has_owner_selectors:
            reowned[proc.tgid] = ts

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
        return {tid: th.task for tid, th in self._threads.items()}

    def failures(self) -> dict[EntryKey, FailureReason]:
        """Keys the backend refused and that wait for their retry, with why."""
        return self._writer.failures()

    def next_retry_at(self) -> float:
        """When the earliest refused key is due to be written again (monotonic seconds; inf if none).
        The engine wakes up then; any `flush` from that moment on writes it."""
        return self._writer.next_retry_at()

    def matches(self) -> list[Match]:
        """Every task some intent matched, with the one intent whose strategy it gets (from scratch)."""
        out = [row for tid in self._threads if (row := self._status.row(tid)) is not None]
        out.sort(key=lambda m: (m.tgid, m.tid))
        return out

    def task_rows(self) -> Mapping[int, Match]:
        """The rows of `matches` by TID, produced (StatusProjection.rows). The engine publishes them."""
        return self._status.rows()

    def intent_figures(self) -> Mapping[str, IntentStats]:
        """Per-intent figures equal to `intent_stats`'s, produced (StatusProjection.figures). The engine
        publishes them (gthulhu_node/feed.py); no record is changed once returned."""
        return self._status.figures(self._policy)

    def intent_stats(self) -> dict[str, IntentStats]:
        """Per-intent matched/applied/lost counts and overlaps, computed from the current tables."""
        current = self._policy
        result = {c.key: IntentStats(c.key, noop=c.is_noop) for c in current.ordered}
        stale = self._stale
        for th in self._threads.values():
            w = th.winner
            if w is None:
                continue
            proc = self._procs[th.task.tgid]
            # a process not yet rematched is counted as the policy it was matched with has it: that is
            # what the backend holds for it
            policy = stale.get(proc.tgid, current)
            candidates = set(self._eligible(policy.match(th.task.comm).thread, proc, policy))
            candidates.update(policy.by_key[k] for k in proc.pmatch)
            for c in candidates:
                s = result.get(c.key)
                if s is None:
                    continue
                s.matched_tasks += 1
                if c is w:
                    s.applied_tasks += 1
                else:
                    s.lost_tasks += 1
                    s.overlaps[w.key] = s.overlaps.get(w.key, 0) + 1
        for key, f in self._writer.failures_by_intent.items():
            if key in result:
                result[key].write_failures = f.count
                result[key].last_error = f.last_message
                result[key].last_reason = f.last_reason
        for _key, reason, owner in self._writer.refused():
            if owner in result:
                s = result[owner]
                s.pending_failures += 1
                s.pending_reasons[reason] = s.pending_reasons.get(reason, 0) + 1
        for owner in self._writer.unwritten():
            if owner in result:
                result[owner].unwritten += 1
        return result

    def stats(self) -> ReconcilerStats:
        st = self._stats
        st.tasks = len(self._threads)
        st.processes = len(self._procs)
        st.matched_tasks = self._status.matched
        st.entries_desired, st.entries_applied = self._writer.sizes
        ws = self._writer.stats
        for name in WriterStats.__dataclass_fields__:
            setattr(st, name, getattr(ws, name))
        copy = ReconcilerStats(**{f: getattr(st, f) for f in ReconcilerStats.__dataclass_fields__})
        copy.events = dict(st.events)
        return copy

    def check_invariants(self) -> None:
        """Assert the invariants the class docstring states (tests call it after every step)."""
        threads, procs = self._threads, self._procs
        for tid, th in threads.items():
            assert th.task.tid == tid and tid in procs[th.task.tgid].tids, tid
        for tgid, proc in procs.items():
            assert proc.tids and all(threads[t].task.tgid == tgid for t in proc.tids), tgid
        assert sum(len(p.tids) for p in procs.values()) == len(threads)
        assert self._stale.keys() <= procs.keys()
        for proc in procs.values():
            policy = self._stale.get(proc.tgid, self._policy)  # a stale process: the one it was matched with
            assert proc.winner is best(policy.by_key[k] for k in proc.pmatch), proc.tgid
            for tid in proc.tids:
                th = threads[tid]
                thread = self._eligible(policy.match(th.task.comm).thread, proc, policy)
                assert th.winner is best((thread[0] if thread else None, proc.winner)), tid
        self._writer.check_invariants()
        # the counts kept as tasks are matched are what a pass over the task table gives
        scratch = self.intent_stats()
        kept = self._status.counts
        for key, s in scratch.items():
            c = kept.get(key, IntentCount())
            assert (c.matched, c.applied, c.lost, c.overlaps) == (
                s.matched_tasks, s.applied_tasks, s.lost_tasks, s.overlaps), (key, c, s)
        assert all(c.matched > 0 for c in kept.values()), kept
        assert self._status.matched == sum(1 for th in threads.values() if th.winner is not None)

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
            if self._pending_logs:
                logs, self._pending_logs = self._pending_logs, []
                for event, fields in logs:
                    if event == "task_matched":
                        log.info(event, **fields)
                    else:
                        log.debug(event, **fields)
            self._notify_settled()

    def add_latency_listener(self, listener: Callable[[float], None]) -> None:
        """Also call `listener(seconds)` for every event-caused write (metrics' histogram). Thread-safe."""
        self._writer.add_latency_listener(listener)

    # ---- the task table -----------------------------------------------------------------------------

    def _read_and_put(self, tgid: int, tid: int, ts: int) -> None:
        try:
            task = read_task(tgid, tid, self.proc_root)
        except (OSError, ValueError) as exc:
            log.warning("task_read_failed", tid=tid, tgid=tgid, error=str(exc))
            return
        if task is None:
            self._stats.tasks_vanished += 1
            return  # gone already: its exit event follows
        self._put_task(task, ts)

    def _put_task(self, task: Task, ts: int) -> None:
        """Add a task or update its comm; a known TID with another start time or TGID is replaced."""
        th = self._threads.get(task.tid)
        old = th.task if th is not None else None
        if old is not None:
            if old == task:
                return
            if old.start_time != task.start_time or old.tgid != task.tgid:
                self._remove_task(old.tid, ts)
                th = old = None
        if self._stale:
            self._fresh(task.tgid)
        proc = self._procs.get(task.tgid)
        if proc is not None and task.tid == task.tgid and proc.start_time not in (None, task.start_time):
            # A leader with another start time: the PID was reused, so every thread of the old process is
            # gone (a leader's PID outlives its group) and their exits were lost. Kept, they held the
            # process's matches, and its TGID entry kept the dead process's start time, which the
            # scheduler ignores: the new process lost its boost.
            for tid in list(proc.tids):
                self._remove_task(tid, ts)
            proc = self._procs.get(task.tgid)
        if proc is None:
            proc = self._procs[task.tgid] = _Proc(task.tgid)
        if task.tid == task.tgid:
            proc.start_time = task.start_time
        changed = False
        if old is not None:
            changed = self._count_process_matches(proc, old.comm, -1)
        if th is None:
            th = self._threads[task.tid] = _Thread(task)
        else:
            th.task = task
        proc.tids.add(task.tid)
        changed = self._count_process_matches(proc, task.comm, +1) or changed
        if changed and self._refresh_proc_winner(proc, ts):
            self._assign_all(proc, ts)
        else:
            self._assign(th, proc, ts)
        if changed:  # every thread of the process matches the process-scope intents it matches
            self._status.count_all(proc)

    def _remove_task(self, tid: int, ts: int) -> None:
        th = self._threads.get(tid)
        if th is None:
            return
        task = th.task
        if self._stale:
            self._fresh(task.tgid)
        self._status.uncount(th)
        self._status.row_tids.add(tid)
        del self._threads[tid]
        self._writer.want(EntryKey(KeyKind.TID, tid), None, "", ts)
        proc = self._procs.get(task.tgid)
        if proc is None:
            return
        proc.tids.discard(tid)
        if not proc.tids:
            del self._procs[task.tgid]
            self._writer.want(EntryKey(KeyKind.TGID, task.tgid), None, "", ts)
            return
        if self._count_process_matches(proc, task.comm, -1):
            if self._refresh_proc_winner(proc, ts):
                self._assign_all(proc, ts)
            self._status.count_all(proc)

    def _eligible(
        self, cands: tuple[CompiledIntent, ...], proc: _Proc, policy: PolicySet | None = None
    ) -> tuple[CompiledIntent, ...]:
        """Drop candidates whose podUID or owner selectors (users, cgroup, executable, and the node's
        `named_only` setting) do not admit the process (under `policy`, the current one by default)."""
        policy = policy or self._policy
        if not cands:
            return cands
        if policy.has_pod_selectors and any(c.pod_uid is not None for c in cands):
            if not proc.pod_known:
                try:
                    proc.pod = read_pod_uid(proc.tgid, self.proc_root)
                    proc.pod_known = True
                except OSError as exc:  # unknown for now: no pod intent, and asked again next time
                    self._owner_read_failed(proc, exc)
                    proc.pod = None
            cands = tuple(c for c in cands if c.pod_uid is None or c.pod_uid == proc.pod)
        if not policy.has_owner_selectors or not (policy.named_only or any(c.needs_owner for c in cands)):
            return cands
        if not proc.owner_known:
            try:
                proc.owner = read_owner(proc.tgid, self.proc_root)
                proc.owner_known = True
            except OSError as exc:
                self._owner_read_failed(proc, exc)
                proc.owner = None
        return tuple(c for c in cands if c.admits(proc.owner, policy.named_only))

    def _owner_read_failed(self, proc: _Proc, exc: OSError) -> None:
        self._stats.owner_read_errors += 1
        log.warning("process_owner_unreadable", tgid=proc.tgid, error=str(exc))

    def _count_process_matches(self, proc: _Proc, comm: str, delta: int) -> bool:
        """Update the process-scope match counts for one thread's comm; True if the set of keys changed."""
        if not self._policy.has_process_scope:
            return False
        changed = False
        pm = proc.pmatch
        for c in self._eligible(self._policy.match(comm).process, proc):
            n = pm.get(c.key, 0) + delta
            if n <= 0:
                pm.pop(c.key, None)
                changed = True
            else:
                changed = changed or (n == 1 and delta > 0)
                pm[c.key] = n
        return changed

    def _refresh_proc_winner(self, proc: _Proc, ts: int) -> bool:
        """Recompute the process's winner and TGID entry; True when the winner changed."""
        by_key = self._policy.by_key
        new = best(by_key[k] for k in proc.pmatch)
        if new is proc.winner:
            return False
        proc.winner = new
        key = EntryKey(KeyKind.TGID, proc.tgid)
        if new is None or new.is_noop or not self.backend.process_fallback:
            self._writer.want(key, None, "", ts)  # without a fallback, _assign gives each thread its own
            return True
        if proc.start_time is None:
            try:
                leader = read_task(proc.tgid, proc.tgid, self.proc_root)
            except (OSError, ValueError):
                leader = None
            if leader is not None:
                proc.start_time = leader.start_time
        if proc.start_time is None:
            log.warning("process_leader_unknown", tgid=proc.tgid, intent_id=new.key)
            self._writer.want(key, None, "", ts)
        else:
            self._writer.want(key, Entry(new.priority, new.slice_ns, proc.start_time), new.key, ts)
        return True

    def _assign_all(self, proc: _Proc, ts: int) -> None:
        threads = self._threads
        for tid in proc.tids:
            self._assign(threads[tid], proc, ts)

    def _assign(self, th: _Thread, proc: _Proc, ts: int) -> None:
        """Give one thread its winner: nothing, the TGID entry's strategy, or a TID entry of its own."""
        task = th.task
        thread = self._eligible(self._policy.match(task.comm).thread, proc)
        pw = proc.winner
        w = best((thread[0] if thread else None, pw))
        tid = task.tid
        prev = th.winner
        key = EntryKey(KeyKind.TID, tid)
        th.cands = frozenset(c.key for c in thread) if thread else frozenset()
        self._status.row_tids.add(tid)
        if w is None:
            if prev is not None:
                th.winner = None
                fields: dict[str, object] = {"intent_id": prev.key, "tid": tid, "tgid": task.tgid}
                self._pending_logs.append(("task_unmatched", {**fields, "comm": task.comm}))
            self._status.count(th, proc)
            self._writer.want(key, None, "", ts)
            return
        th.winner = w
        self._status.count(th, proc)
        if prev is not w:
            self._pending_logs.append(
                ("task_matched", {"intent_id": w.key, "tid": tid, "tgid": task.tgid, "comm": task.comm,
                                  "priority": w.priority, "slice_ns": w.slice_ns, "scope": w.scope.value})
            )
        covered_by_tgid = (
            self.backend.process_fallback
            and pw is not None
            and not pw.is_noop
            and proc.start_time is not None
            and (pw is w or (pw.priority, pw.slice_ns) == (w.priority, w.slice_ns))
        )
        if w.is_noop or covered_by_tgid:
            self._writer.want(key, None, "", ts)
        else:
            self._writer.want(key, Entry(w.priority, w.slice_ns, task.start_time), w.key, ts)

    def _rematch_proc(self, proc: _Proc, ts: int = 0) -> None:
        """Recompute one process's and its threads' winners under the current policy (after a change, or
        at `ts`, the time of the event that changed who the process is)."""
        self._stale.pop(proc.tgid, None)
        threads = self._threads
        for tid in proc.tids:
            threads[tid].winner = None
        proc.pmatch.clear()
        if proc.winner is not None:
            proc.winner = None
            self._writer.want(EntryKey(KeyKind.TGID, proc.tgid), None, "", ts)
        if self._policy.has_process_scope:
            for tid in proc.tids:
                self._count_process_matches(proc, threads[tid].task.comm, +1)
            if proc.pmatch:
                self._refresh_proc_winner(proc, ts)
        self._assign_all(proc, ts)

    def _fresh(self, tgid: int) -> None:
        """Rematch a stale process before anything changes it: its counts and winners must be the
        current policy's for the change to be computed right."""
        if tgid in self._stale:
            self._rematch_proc(self._procs[tgid])
