"""The task table: every task seen, the process it belongs to, and the one intent whose strategy each
gets (matching.py's precedence decides; `best`), turned into the writer's desired entries.

It does no I/O of its own: what it must read from /proc when a task appears or an intent asks who a
process is (the task's stat, the process's owner, its pod) comes through the `ProcReader` it is handed
(`gthulhu_node/reconciler.py`'s `ProcFiles` reads /proc; tests hand a fake /proc the same way). It feeds the
writer (`Writer.want`) and the status projection (`StatusProjection.count`, `row_tids`) as it changes.

Rules it implements:
- A task is (tid, start_time): a TID seen with another start time is a new task (the old one is gone).
- One task gets exactly one intent's strategy (matching.py's precedence), never a merge.
- scope=process: the strongest process-scope intent matching any thread of a process becomes that
  process's TGID entry, so threads it creates later are covered by the kernel at once. A thread whose own
  winner (its thread-scope matches and the process winner) gives something else gets a TID entry.
- Noop intents (priority 0, executionTime 0) match and win like any other but write nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from gthulhu_node.backends.base import Entry, EntryKey, KeyKind
from gthulhu_node.matching import CompiledIntent, Owner, PolicySet, best
from gthulhu_node.status_projection import StatusProjection
from gthulhu_node.tasks.procfs import Task
from gthulhu_node.writer import Writer

log = structlog.get_logger(__name__)


class ProcReader(Protocol):
    """The reads the table needs, done outside it. Each raises OSError when /proc cannot answer (the
    task read: ValueError for a malformed stat too); a task gone is None."""

    def task(self, tgid: int, tid: int) -> Task | None: ...

    def owner(self, tgid: int) -> Owner | None: ...

    def pod_uid(self, tgid: int) -> str | None: ...


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


class TaskTable:
    """Tasks, processes, their matches and winners. Not thread-safe: the engine thread owns it.

    Invariants (`check_invariants`): every thread is in exactly its own process's `tids`, every process
    has a thread, and every winner is what matching.py's precedence gives for the current policy (for a
    process in `stale`, the older policy it was matched with: it keeps that policy's strategies until
    rematched, by `rematch` or before anything changes it).
    """

    def __init__(self, policy: PolicySet, read: ProcReader, writer: Writer,
                 clock: Callable[[], float]) -> None:
        self.policy = policy
        self._read = read
        self._writer = writer
        self._clock = clock
        self.threads: dict[int, _Thread] = {}
        self.procs: dict[int, _Proc] = {}
        self.status = StatusProjection(self.threads, self.procs, writer)
        # Processes whose winners were computed with an older policy than `policy` (tgid -> that policy).
        self.stale: dict[int, PolicySet] = {}
        self.pending_logs: list[tuple[str, dict[str, object]]] = []  # (un)matched: logged after a write
        self.rematched = 0  # processes rematched (status moves with each)
        self.vanished = 0  # an event named a task that was gone before its /proc entry could be read
        self.owner_read_errors = 0  # /proc/<tgid>/{cgroup,status} unreadable (not gone): failed closed

    def take_policy(self, policy: PolicySet) -> None:
        """Every process keeps its winners under the old policy until rematched."""
        old, self.policy = self.policy, policy
        stale = self.stale
        for tgid in self.procs:
            stale.setdefault(tgid, old)

    def rematch(self, deadline: float) -> None:
        stale, procs, clock = self.stale, self.procs, self._clock
        n = 0
        while stale:
            if n and clock() >= deadline:
                return
            tgid = next(iter(stale))
            self.rematch_proc(procs[tgid])
            self.rematched += 1
            n += 1
        log.info("policy_applied", intents=len(self.policy), tasks=len(self.threads),
                 entries=self._writer.sizes[0])

    def forget_owner(self, proc: _Proc, ts: int, reowned: dict[int, int]) -> None:
        """Who the process is may have changed (setuid, exec): the owner selectors are evaluated again,
        with a fresh read, for every thread of it. Without this a root process that named a thread, then
        dropped to nobody and exec'd, kept a boost `named_only` denies nobody (issue 38, item 7). The
        rematch is done once per process at the end of the batch (a setuid is one event per thread)."""
        if not proc.owner_known:
            return  # never read, nothing cached: the next match reads it
        proc.owner_known = False
        proc.owner = None
        if self.policy.has_owner_selectors:
            reowned[proc.tgid] = ts

    def check_invariants(self) -> None:
        """Assert the table's invariants (the class docstring; tests call it after every step)."""
        threads, procs = self.threads, self.procs
        for tid, th in threads.items():
            assert th.task.tid == tid and tid in procs[th.task.tgid].tids, tid
        for tgid, proc in procs.items():
            assert proc.tids and all(threads[t].task.tgid == tgid for t in proc.tids), tgid
        assert sum(len(p.tids) for p in procs.values()) == len(threads)
        assert self.stale.keys() <= procs.keys()
        for proc in procs.values():
            policy = self.stale.get(proc.tgid, self.policy)  # a stale process: the one it was matched with
            assert proc.winner is best(policy.by_key[k] for k in proc.pmatch), proc.tgid
            for tid in proc.tids:
                th = threads[tid]
                thread = self.eligible(policy.match(th.task.comm).thread, proc, policy)
                assert th.winner is best((thread[0] if thread else None, proc.winner)), tid


    def read_and_put(self, tgid: int, tid: int, ts: int) -> None:
        try:
            task = self._read.task(tgid, tid)
        except (OSError, ValueError) as exc:
            log.warning("task_read_failed", tid=tid, tgid=tgid, error=str(exc))
            return
        if task is None:
            self.vanished += 1
            return  # gone already: its exit event follows
        self.put(task, ts)

    def put(self, task: Task, ts: int) -> None:
        """Add a task or update its comm; a known TID with another start time or TGID is replaced."""
        th = self.threads.get(task.tid)
        old = th.task if th is not None else None
        if old is not None:
            if old == task:
                return
            if old.start_time != task.start_time or old.tgid != task.tgid:
                self.remove(old.tid, ts)
                th = old = None
        if self.stale:
            self._fresh(task.tgid)
        proc = self.procs.get(task.tgid)
        if proc is not None and task.tid == task.tgid and proc.start_time not in (None, task.start_time):
            # A leader with another start time: the PID was reused, so every thread of the old process is
            # gone (a leader's PID outlives its group) and their exits were lost. Kept, they held the
            # process's matches, and its TGID entry kept the dead process's start time, which the
            # scheduler ignores: the new process lost its boost.
            for tid in list(proc.tids):
                self.remove(tid, ts)
            proc = self.procs.get(task.tgid)
        if proc is None:
            proc = self.procs[task.tgid] = _Proc(task.tgid)
        if task.tid == task.tgid:
            proc.start_time = task.start_time
        changed = False
        if old is not None:
            changed = self._count_process_matches(proc, old.comm, -1)
        if th is None:
            th = self.threads[task.tid] = _Thread(task)
        else:
            th.task = task
        proc.tids.add(task.tid)
        changed = self._count_process_matches(proc, task.comm, +1) or changed
        if changed and self._refresh_proc_winner(proc, ts):
            self._assign_all(proc, ts)
        else:
            self._assign(th, proc, ts)
        if changed:  # every thread of the process matches the process-scope intents it matches
            self.status.count_all(proc)

    def remove(self, tid: int, ts: int) -> None:
        th = self.threads.get(tid)
        if th is None:
            return
        task = th.task
        if self.stale:
            self._fresh(task.tgid)
        self.status.uncount(th)
        self.status.row_tids.add(tid)
        del self.threads[tid]
        self._writer.want(EntryKey(KeyKind.TID, tid), None, "", ts)
        proc = self.procs.get(task.tgid)
        if proc is None:
            return
        proc.tids.discard(tid)
        if not proc.tids:
            del self.procs[task.tgid]
            self._writer.want(EntryKey(KeyKind.TGID, task.tgid), None, "", ts)
            return
        if self._count_process_matches(proc, task.comm, -1):
            if self._refresh_proc_winner(proc, ts):
                self._assign_all(proc, ts)
            self.status.count_all(proc)

    def eligible(
        self, cands: tuple[CompiledIntent, ...], proc: _Proc, policy: PolicySet | None = None
    ) -> tuple[CompiledIntent, ...]:
        """Drop candidates whose podUID or owner selectors (users, cgroup, executable, and the node's
        `named_only` setting) do not admit the process (under `policy`, the current one by default)."""
        policy = policy or self.policy
        if not cands:
            return cands
        if policy.has_pod_selectors and any(c.pod_uid is not None for c in cands):
            if not proc.pod_known:
                try:
                    proc.pod = self._read.pod_uid(proc.tgid)
                    proc.pod_known = True
                except OSError as exc:  # unknown for now: no pod intent, and asked again next time
                    self._owner_read_failed(proc, exc)
                    proc.pod = None
            cands = tuple(c for c in cands if c.pod_uid is None or c.pod_uid == proc.pod)
        if not policy.has_owner_selectors or not (policy.named_only or any(c.needs_owner for c in cands)):
            return cands
        if not proc.owner_known:
            try:
                proc.owner = self._read.owner(proc.tgid)
                proc.owner_known = True
            except OSError as exc:
                self._owner_read_failed(proc, exc)
                proc.owner = None
        return tuple(c for c in cands if c.admits(proc.owner, policy.named_only))

    def _owner_read_failed(self, proc: _Proc, exc: OSError) -> None:
        self.owner_read_errors += 1
        log.warning("process_owner_unreadable", tgid=proc.tgid, error=str(exc))

    def _count_process_matches(self, proc: _Proc, comm: str, delta: int) -> bool:
        """Update the process-scope match counts for one thread's comm; True if the set of keys changed."""
        if not self.policy.has_process_scope:
            return False
        changed = False
        pm = proc.pmatch
        for c in self.eligible(self.policy.match(comm).process, proc):
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
        by_key = self.policy.by_key
        new = best(by_key[k] for k in proc.pmatch)
        if new is proc.winner:
            return False
        proc.winner = new
        key = EntryKey(KeyKind.TGID, proc.tgid)
        if new is None or new.is_noop or not self._writer.backend.process_fallback:
            self._writer.want(key, None, "", ts)  # without a fallback, _assign gives each thread its own
            return True
        if proc.start_time is None:
            try:
                leader = self._read.task(proc.tgid, proc.tgid)
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
        threads = self.threads
        for tid in proc.tids:
            self._assign(threads[tid], proc, ts)

    def _assign(self, th: _Thread, proc: _Proc, ts: int) -> None:
        """Give one thread its winner: nothing, the TGID entry's strategy, or a TID entry of its own."""
        task = th.task
        thread = self.eligible(self.policy.match(task.comm).thread, proc)
        pw = proc.winner
        w = best((thread[0] if thread else None, pw))
        tid = task.tid
        prev = th.winner
        key = EntryKey(KeyKind.TID, tid)
        th.cands = frozenset(c.key for c in thread) if thread else frozenset()
        self.status.row_tids.add(tid)
        if w is None:
            if prev is not None:
                th.winner = None
                fields: dict[str, object] = {"intent_id": prev.key, "tid": tid, "tgid": task.tgid}
                self.pending_logs.append(("task_unmatched", {**fields, "comm": task.comm}))
            self.status.count(th, proc)
            self._writer.want(key, None, "", ts)
            return
        th.winner = w
        self.status.count(th, proc)
        if prev is not w:
            self.pending_logs.append(
                ("task_matched", {"intent_id": w.key, "tid": tid, "tgid": task.tgid, "comm": task.comm,
                                  "priority": w.priority, "slice_ns": w.slice_ns, "scope": w.scope.value})
            )
        covered_by_tgid = (
            self._writer.backend.process_fallback
            and pw is not None
            and not pw.is_noop
            and proc.start_time is not None
            and (pw is w or (pw.priority, pw.slice_ns) == (w.priority, w.slice_ns))
        )
        if w.is_noop or covered_by_tgid:
            self._writer.want(key, None, "", ts)
        else:
            self._writer.want(key, Entry(w.priority, w.slice_ns, task.start_time), w.key, ts)

    def rematch_proc(self, proc: _Proc, ts: int = 0) -> None:
        """Recompute one process's and its threads' winners under the current policy (after a change, or
        at `ts`, the time of the event that changed who the process is)."""
        self.stale.pop(proc.tgid, None)
        threads = self.threads
        for tid in proc.tids:
            threads[tid].winner = None
        proc.pmatch.clear()
        if proc.winner is not None:
            proc.winner = None
            self._writer.want(EntryKey(KeyKind.TGID, proc.tgid), None, "", ts)
        if self.policy.has_process_scope:
            for tid in proc.tids:
                self._count_process_matches(proc, threads[tid].task.comm, +1)
            if proc.pmatch:
                self._refresh_proc_winner(proc, ts)
        self._assign_all(proc, ts)

    def _fresh(self, tgid: int) -> None:
        """Rematch a stale process before anything changes it: its counts and winners must be the
        current policy's for the change to be computed right."""
        if tgid in self.stale:
            self.rematch_proc(self.procs[tgid])
