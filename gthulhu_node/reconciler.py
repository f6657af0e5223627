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
- Per-key write failures: MapFullError is kept on the owning intent's status (and retried at the next full
  diff); TaskGoneError drops the entry (the exit event follows).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gthulhu_node.backends.base import (
    ApplyResult,
    Backend,
    BackendError,
    Entry,
    EntryKey,
    KeyKind,
    MapFullError,
    TaskGoneError,
)
from gthulhu_node.matching import CompiledIntent, Owner, PolicySet, best, read_owner, read_pod_uid
from gthulhu_node.tasks.events import EventKind, ProcEvent
from gthulhu_node.tasks.procfs import Snapshot, Task, read_task, snapshot

log = structlog.get_logger(__name__)

LATENCY_WINDOW = 4096
_EVENT_NAMES = {k: k.name.lower() for k in EventKind}


@dataclass(frozen=True, slots=True)
class Match:
    """One task and the intent whose strategy it gets."""

    tid: int
    tgid: int
    comm: str
    intent_key: str
    priority: int
    slice_ns: int
    scope: str  # the winning intent's scope: "thread" or "process"
    entry: str  # the key that carries it ("tid:123", "tgid:100"), "" when nothing is written (noop)
    applied: bool  # the backend holds that entry as computed


@dataclass(slots=True)
class IntentStats:
    """Per-intent status: how many tasks it matched, won and lost (and to whom), write failures."""

    key: str
    noop: bool = False
    matched_tasks: int = 0
    applied_tasks: int = 0  # tasks whose strategy is this intent's
    lost_tasks: int = 0
    overlaps: dict[str, int] = field(default_factory=dict)  # winner's key -> tasks lost to it
    write_failures: int = 0
    pending_failures: int = 0  # entries of this intent not in the backend right now because a write failed
    last_error: str = ""


@dataclass(slots=True)
class ReconcilerStats:
    """Counters for metrics (read at scrape time through `Reconciler.stats()`)."""

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
    batches: int = 0
    upserts: int = 0
    deletes: int = 0
    write_failures: int = 0
    map_full: int = 0
    tasks_gone: int = 0
    tasks_vanished: int = 0  # an event named a task that was gone before its /proc entry could be read
    # /proc/<tgid>/{cgroup,status} unreadable for a reason other than the process being gone: selectors
    # that ask failed closed, and the read is tried again at the next match
    owner_read_errors: int = 0
    resyncs: int = 0
    policy_updates: int = 0
    latency_count: int = 0
    latency_sum_s: float = 0.0
    latency_p50_s: float = 0.0  # over the last LATENCY_WINDOW writes
    latency_p99_s: float = 0.0


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
    """Desired table, diff, batched writes. Not thread-safe: the engine thread owns it.

    Latency listeners (`on_latency` and `add_latency_listener`) are called for every write caused by an
    event, with the time from the kernel's event timestamp (CLOCK_MONOTONIC, the moment of the prctl / fork /
    exit) to the end of the backend write.
    """

    def __init__(
        self,
        backend: Backend,
        *,
        policy: PolicySet | None = None,
        proc_root: Path = Path("/proc"),
        on_latency: Callable[[float], None] | None = None,
    ) -> None:
        self.backend = backend
        self.proc_root = proc_root
        # replaced whole, never mutated: another thread may add a listener while the engine thread reads it
        self._latency_listeners: tuple[Callable[[float], None], ...] = (on_latency,) if on_latency else ()
        self._policy = policy or PolicySet.empty()
        self._tasks: dict[int, Task] = {}
        self._procs: dict[int, _Proc] = {}
        self._winner: dict[int, CompiledIntent] = {}  # tid -> winning intent (noop included)
        self._desired: dict[EntryKey, Entry] = {}
        self._owner: dict[EntryKey, str] = {}  # key -> intent key that produced it
        self._applied: dict[EntryKey, Entry] = {}
        # key -> earliest event timestamp (ns) that touched it, 0 if none
        self._dirty: dict[EntryKey, int] = {}
        self._failed: dict[EntryKey, str] = {}  # key -> why its last write failed
        self._failures: dict[str, int] = collections.Counter()
        self._last_error: dict[str, str] = {}
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._stats = ReconcilerStats()
        # Set by the engine while the backend is down (ejected, reloading): changes accumulate, nothing is
        # written; `resync` writes everything once the backend is back.
        self.hold_writes = False
        self._pending_logs: list[tuple[str, dict[str, object]]] = []

    # ---- inputs -------------------------------------------------------------------------------------

    @property
    def policy(self) -> PolicySet:
        return self._policy

    def set_policy(self, policy: PolicySet) -> ApplyResult:
        """Replace the policy set and recompute every task's strategy; writes the difference at once."""
        self._policy = policy
        self._stats.policy_updates += 1
        for key in list(self._failures):
            if key not in policy.by_key:
                del self._failures[key]
                self._last_error.pop(key, None)
        self._rebuild()
        log.info("policy_applied", intents=len(policy), tasks=len(self._tasks), entries=len(self._desired))
        return self.flush()

    def apply_snapshot(self, snap: Snapshot) -> ApplyResult:
        """Make the task table agree with a full scan, then diff everything and write.

        Only a complete snapshot removes tasks it did not see (or saw with another start time).
        """
        st = self._stats
        st.scans += 1
        st.scan_errors += snap.errors
        st.scan_duration_last_s = snap.duration_s
        st.scan_duration_total_s += snap.duration_s
        if snap.complete:
            seen = snap.tasks
            for tid in [t for t, old in self._tasks.items() if (s := seen.get(t)) is None or s != old]:
                new = seen.get(tid)
                old = self._tasks[tid]
                if new is None or new.start_time != old.start_time or new.tgid != old.tgid:
                    self._remove_task(tid, 0)
        else:
            st.scans_incomplete += 1
            log.warning("proc_scan_incomplete", errors=snap.errors, tasks=len(snap.tasks))
        for task in snap.tasks.values():
            self._put_task(task, 0)
        self._mark_all_dirty()
        return self.flush()

    def rescan(self) -> ApplyResult:
        """Take a full snapshot of `proc_root` and apply it."""
        return self.apply_snapshot(snapshot(self.proc_root))

    def handle_events(self, events: Iterable[ProcEvent]) -> ApplyResult:
        """Apply events in order, then write everything they changed as one batch."""
        counts = self._stats.events
        for ev in events:
            kind = ev.kind
            counts[_EVENT_NAMES[kind]] += 1
            if kind is EventKind.EXIT:
                old = self._tasks.get(ev.tid)
                if old is not None and old.tgid == ev.tgid:
                    self._remove_task(ev.tid, ev.timestamp_ns)
            elif kind is EventKind.COMM:
                old = self._tasks.get(ev.tid)
                if old is not None and old.tgid == ev.tgid and ev.comm is not None:
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
                self._read_and_put(ev.tgid, ev.tgid, ev.timestamp_ns)
        return self.flush()

    def note_events_lost(self) -> None:
        """The event source dropped events; the engine rescans at once."""
        self._stats.events_lost += 1

    def note_event_read_error(self) -> None:
        self._stats.event_read_errors += 1

    def resync(self) -> ApplyResult:
        """Re-read what the backend holds (after a restart or reload) and write every difference."""
        self._stats.resyncs += 1
        try:
            self._applied = dict(self.backend.read_back())
        except BackendError as exc:
            log.error("backend_read_back_failed", backend=self.backend.name, error=str(exc))
            self._applied = {}
        self._failed.clear()
        self._mark_all_dirty()
        return self.flush()

    # ---- outputs ------------------------------------------------------------------------------------

    def desired(self) -> dict[EntryKey, Entry]:
        return dict(self._desired)

    def applied(self) -> dict[EntryKey, Entry]:
        return dict(self._applied)

    def tasks(self) -> dict[int, Task]:
        return dict(self._tasks)

    def matches(self) -> list[Match]:
        """Every task some intent matched, with the one intent whose strategy it gets."""
        out: list[Match] = []
        for tid, w in self._winner.items():
            task = self._tasks[tid]
            proc = self._procs[task.tgid]
            entry_key: EntryKey | None = None
            tid_key = EntryKey(KeyKind.TID, tid)
            if tid_key in self._desired:
                entry_key = tid_key
            elif proc.winner is not None and not proc.winner.is_noop:
                entry_key = EntryKey(KeyKind.TGID, task.tgid)
            applied = entry_key is not None and self._applied.get(entry_key) == self._desired.get(entry_key)
            out.append(
                Match(
                    tid,
                    task.tgid,
                    task.comm,
                    w.key,
                    w.priority,
                    w.slice_ns,
                    w.scope.value,
                    str(entry_key) if entry_key is not None else "",
                    applied,
                )
            )
        out.sort(key=lambda m: (m.tgid, m.tid))
        return out

    def intent_stats(self) -> dict[str, IntentStats]:
        """Per-intent matched/applied/lost counts and overlaps, computed from the current tables."""
        result = {c.key: IntentStats(c.key, noop=c.is_noop) for c in self._policy.ordered}
        by_key = self._policy.by_key
        for tid, w in self._winner.items():
            task = self._tasks[tid]
            proc = self._procs[task.tgid]
            candidates = set(self._eligible(self._policy.match(task.comm).thread, proc))
            candidates.update(by_key[k] for k in proc.pmatch)
            for c in candidates:
                s = result[c.key]
                s.matched_tasks += 1
                if c is w:
                    s.applied_tasks += 1
                else:
                    s.lost_tasks += 1
                    s.overlaps[w.key] = s.overlaps.get(w.key, 0) + 1
        for key, n in self._failures.items():
            if key in result:
                result[key].write_failures = n
                result[key].last_error = self._last_error.get(key, "")
        for failed_key in self._failed:
            owner = self._owner.get(failed_key)
            if owner is not None and owner in result:
                result[owner].pending_failures += 1
        return result

    def stats(self) -> ReconcilerStats:
        st = self._stats
        st.tasks = len(self._tasks)
        st.processes = len(self._procs)
        st.matched_tasks = len(self._winner)
        st.entries_desired = len(self._desired)
        st.entries_applied = len(self._applied)
        if self._latencies:
            ordered = sorted(self._latencies)
            st.latency_p50_s = ordered[len(ordered) // 2]
            st.latency_p99_s = ordered[min(len(ordered) - 1, (len(ordered) * 99) // 100)]
        copy = ReconcilerStats(**{f: getattr(st, f) for f in ReconcilerStats.__dataclass_fields__})
        copy.events = dict(st.events)
        return copy

    # ---- writing ------------------------------------------------------------------------------------

    def flush(self) -> ApplyResult:
        """Write every dirty key whose desired value differs from what the backend holds, as one batch.

        Log lines about (un)matched tasks are emitted after the write, so rendering them never delays it.
        """
        try:
            return self._flush()
        finally:
            if self._pending_logs:
                logs, self._pending_logs = self._pending_logs, []
                for event, fields in logs:
                    if event == "task_matched":
                        log.info(event, **fields)
                    else:
                        log.debug(event, **fields)

    def _flush(self) -> ApplyResult:
        if not self._dirty or self.hold_writes:
            return ApplyResult()
        dirty, self._dirty = self._dirty, {}
        upserts: dict[EntryKey, Entry] = {}
        deletes: list[EntryKey] = []
        desired, applied = self._desired, self._applied
        for key in dirty:
            want = desired.get(key)
            if want == applied.get(key):
                self._failed.pop(key, None)
                continue
            if want is None:
                deletes.append(key)
            else:
                upserts[key] = want
        if not upserts and not deletes:
            return ApplyResult()
        st = self._stats
        st.batches += 1
        try:
            result = self.backend.apply(upserts, deletes)
        except BackendError as exc:
            # The whole batch was refused (nothing written): every key keeps its old applied value.
            log.error("backend_write_failed", backend=self.backend.name, keys=len(upserts) + len(deletes),
                      error=str(exc))
            st.write_failures += len(upserts) + len(deletes)
            for key in [*upserts, *deletes]:
                self._record_failure(key, str(exc))
            return ApplyResult(failed={k: exc for k in [*upserts, *deletes]})
        done = time.monotonic_ns()
        failed = result.failed
        for key, entry in upserts.items():
            err = failed.get(key)
            if err is None:
                applied[key] = entry
                self._failed.pop(key, None)
            elif isinstance(err, TaskGoneError):
                st.tasks_gone += 1
                self._drop_desired(key)
            else:
                st.write_failures += 1
                if isinstance(err, MapFullError):
                    st.map_full += 1
                self._record_failure(key, str(err))
        for key in deletes:
            err = failed.get(key)
            if err is None or isinstance(err, TaskGoneError):
                applied.pop(key, None)
                self._failed.pop(key, None)
            else:
                st.write_failures += 1
                self._record_failure(key, str(err))
        st.upserts += result.upserted
        st.deletes += result.deleted
        self._observe_latencies(dirty, upserts, deletes, failed, done)
        return result

    def _observe_latencies(
        self,
        dirty: dict[EntryKey, int],
        upserts: dict[EntryKey, Entry],
        deletes: list[EntryKey],
        failed: dict[EntryKey, BackendError],
        done_ns: int,
    ) -> None:
        st = self._stats
        listeners = self._latency_listeners
        for key in [*upserts, *deletes]:
            ts = dirty.get(key, 0)
            if ts <= 0 or key in failed:
                continue
            seconds = max(0, done_ns - ts) / 1e9
            st.latency_count += 1
            st.latency_sum_s += seconds
            self._latencies.append(seconds)
            for listener in listeners:
                listener(seconds)

    def add_latency_listener(self, listener: Callable[[float], None]) -> None:
        """Also call `listener(seconds)` for every event-caused write (metrics' histogram). Thread-safe."""
        self._latency_listeners = (*self._latency_listeners, listener)

    def _record_failure(self, key: EntryKey, message: str) -> None:
        self._failed[key] = message
        owner = self._owner.get(key)
        if owner is not None:
            first = owner not in self._last_error or self._last_error[owner] != message
            self._failures[owner] += 1
            self._last_error[owner] = message
            if first:
                log.warning("entry_write_failed", intent_id=owner, key=str(key), error=message)

    def _drop_desired(self, key: EntryKey) -> None:
        self._desired.pop(key, None)
        self._owner.pop(key, None)
        self._failed.pop(key, None)

    def _mark_all_dirty(self) -> None:
        dirty = self._dirty
        for key in self._desired.keys() | self._applied.keys():
            dirty.setdefault(key, 0)

    def _set_desired(self, key: EntryKey, entry: Entry | None, owner: str, ts: int) -> None:
        cur = self._desired.get(key)
        if entry is None:
            if cur is None:
                return
            del self._desired[key]
            self._owner.pop(key, None)
        else:
            self._owner[key] = owner
            if cur == entry:
                return
            self._desired[key] = entry
        if key not in self._dirty or (ts and not self._dirty[key]):
            self._dirty[key] = ts

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
        old = self._tasks.get(task.tid)
        if old is not None:
            if old == task:
                return
            if old.start_time != task.start_time or old.tgid != task.tgid:
                self._remove_task(old.tid, ts)
                old = None
        proc = self._procs.get(task.tgid)
        if proc is None:
            proc = self._procs[task.tgid] = _Proc(task.tgid)
        if task.tid == task.tgid:
            proc.start_time = task.start_time
        changed = False
        if old is not None:
            changed = self._count_process_matches(proc, old.comm, -1)
        self._tasks[task.tid] = task
        proc.tids.add(task.tid)
        changed = self._count_process_matches(proc, task.comm, +1) or changed
        if changed and self._refresh_proc_winner(proc, ts):
            self._assign_all(proc, ts)
        else:
            self._assign(task, proc, ts)

    def _remove_task(self, tid: int, ts: int) -> None:
        task = self._tasks.pop(tid, None)
        if task is None:
            return
        self._winner.pop(tid, None)
        self._set_desired(EntryKey(KeyKind.TID, tid), None, "", ts)
        self._failed.pop(EntryKey(KeyKind.TID, tid), None)
        proc = self._procs.get(task.tgid)
        if proc is None:
            return
        proc.tids.discard(tid)
        if not proc.tids:
            del self._procs[task.tgid]
            self._set_desired(EntryKey(KeyKind.TGID, task.tgid), None, "", ts)
            return
        if self._count_process_matches(proc, task.comm, -1) and self._refresh_proc_winner(proc, ts):
            self._assign_all(proc, ts)

    def _eligible(self, cands: tuple[CompiledIntent, ...], proc: _Proc) -> tuple[CompiledIntent, ...]:
        """Drop candidates whose podUID or owner selectors (users, cgroup, executable, and the node's
        `named_only` setting) do not admit the process."""
        policy = self._policy
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
            self._set_desired(key, None, "", ts)  # without a fallback, _assign gives each thread its own
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
            self._set_desired(key, None, "", ts)
        else:
            self._set_desired(key, Entry(new.priority, new.slice_ns, proc.start_time), new.key, ts)
        return True

    def _assign_all(self, proc: _Proc, ts: int) -> None:
        tasks = self._tasks
        for tid in proc.tids:
            self._assign(tasks[tid], proc, ts)

    def _assign(self, task: Task, proc: _Proc, ts: int) -> None:
        """Give one thread its winner: nothing, the TGID entry's strategy, or a TID entry of its own."""
        thread = self._eligible(self._policy.match(task.comm).thread, proc)
        pw = proc.winner
        w = best((thread[0] if thread else None, pw))
        tid = task.tid
        prev = self._winner.get(tid)
        key = EntryKey(KeyKind.TID, tid)
        if w is None:
            if prev is not None:
                del self._winner[tid]
                fields: dict[str, object] = {"intent_id": prev.key, "tid": tid, "tgid": task.tgid}
                self._pending_logs.append(("task_unmatched", {**fields, "comm": task.comm}))
            self._set_desired(key, None, "", ts)
            return
        self._winner[tid] = w
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
            self._set_desired(key, None, "", ts)
        else:
            self._set_desired(key, Entry(w.priority, w.slice_ns, task.start_time), w.key, ts)

    def _rebuild(self) -> None:
        """Recompute every process's and thread's winner from scratch (after a policy change)."""
        self._winner.clear()
        new_desired: dict[EntryKey, Entry] = {}
        old_desired = self._desired
        self._desired, self._owner = new_desired, {}
        for proc in self._procs.values():
            proc.pmatch.clear()
            proc.winner = None
        tasks = self._tasks
        if self._policy.has_process_scope:
            for task in tasks.values():
                self._count_process_matches(self._procs[task.tgid], task.comm, +1)
            for proc in self._procs.values():
                if proc.pmatch:
                    self._refresh_proc_winner(proc, 0)
        for proc in self._procs.values():
            self._assign_all(proc, 0)
        for key in old_desired.keys() | new_desired.keys():
            self._dirty.setdefault(key, 0)
        self._failed.clear()
