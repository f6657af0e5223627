"""The status projection: per-intent figures and task rows, produced as the task table and the writer
change, for the engine to publish (gthulhu_node/feed.py).

Fed, not pulled: the task table calls `count`/`uncount`/`count_all` wherever a thread's winner, its
matches or its process's process-scope matches change, and notes threads matched again or removed
(`row_tids`); the writer leaves the keys whose desired or applied entry changed (`changed_keys`) and the
intents whose failures changed (`touched`). `figures` and `rows` then rebuild only what those say
changed. The from-scratch recount (`Reconciler.intent_stats`) is the reference the tests check these
against; nothing in production reads it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

from gthulhu_node.backends.base import EntryKey, KeyKind
from gthulhu_node.matching import CompiledIntent, PolicySet
from gthulhu_node.outbox import FailureReason
from gthulhu_node.tasks.procfs import Task
from gthulhu_node.writer import Writer


class TableThread(Protocol):
    """A thread of the task table as the projection reads it (the table owns it; `counted` is the
    projection's note of what the thread adds to the counts)."""

    task: Task
    winner: CompiledIntent | None
    cands: frozenset[str]
    counted: tuple[frozenset[str], str] | None


class TableProcess(Protocol):
    """A process of the task table as the projection reads it."""

    tids: set[int]
    pmatch: dict[str, int]
    winner: CompiledIntent | None


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
    overlaps: tuple[str, ...] = ()  # the other intents it matches, which the winner beats (sorted keys)


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
    unwritten: int = 0  # entries of this intent waiting for their write (a long write is done in slices)
    pending_reasons: dict[FailureReason, int] = field(default_factory=dict)  # the same, by reason
    last_error: str = ""  # the backend's words for the last refusal, for people
    last_reason: FailureReason | None = None



@dataclass(slots=True)
class IntentCount:
    """One intent's share of the task table, kept as threads are matched and unmatched."""

    matched: int = 0
    applied: int = 0
    lost: int = 0
    overlaps: dict[str, int] = field(default_factory=dict)  # winner's key -> tasks lost to it


class StatusProjection:
    """Per-intent counts kept as threads are matched and unmatched, and what was last produced from them.
    Not thread-safe: the engine thread owns it (through the reconciler)."""

    def __init__(self, threads: Mapping[int, TableThread], procs: Mapping[int, TableProcess],
                 writer: Writer) -> None:
        self._threads = threads  # the task table's, read only
        self._procs = procs
        self._writer = writer
        self.counts: dict[str, IntentCount] = {}
        self.matched = 0  # threads with a winner
        self.touched: set[str] = set()  # intents whose counts changed since `figures`
        self.all_touched = True  # the policy changed: every intent's figures are built again
        self._figures: dict[str, IntentStats] = {}  # what `figures` last returned
        self._live: set[str] = set()  # intents that had refused or unwritten entries then
        # Task rows as `rows` last returned them, and what may have changed them since: threads matched
        # again or removed, keys whose desired or applied entry changed (the writer's `changed_keys`: a row
        # says which key carries its strategy and whether the backend holds it), or everything (a resync).
        self._rows: dict[int, Match] = {}
        self.row_tids: set[int] = set()
        self.rows_all = True

    def rows(self) -> Mapping[int, Match]:
        """The rows of `Reconciler.matches` by TID, produced: only the rows of threads matched again or
        removed, or whose entry's desired or applied value changed since the last call, are built anew;
        the others are the last call's (frozen) rows. The engine publishes the result
        (gthulhu_node/feed.py)."""
        if self.rows_all:
            out: dict[int, Match] = {}
            tids: Iterable[int] = self._threads
        else:
            out = dict(self._rows)
            changed = set(self.row_tids)
            procs = self._procs
            for key in self._writer.changed_keys:
                if key.kind is KeyKind.TID:
                    changed.add(key.id)
                elif (proc := procs.get(key.id)) is not None:
                    changed.update(proc.tids)
            tids = changed
        for tid in tids:
            row = self.row(tid)
            if row is None:
                out.pop(tid, None)
            else:
                out[tid] = row
        self._rows = out
        self.row_tids, self.rows_all = set(), False
        self._writer.changed_keys.clear()
        return MappingProxyType(out)

    def row(self, tid: int) -> Match | None:
        th = self._threads.get(tid)
        w = th.winner if th is not None else None
        if th is None or w is None:
            return None
        writer = self._writer
        task = th.task
        proc = self._procs[task.tgid]
        entry_key: EntryKey | None = None
        tid_key = EntryKey(KeyKind.TID, tid)
        if writer.wanted(tid_key):
            entry_key = tid_key
        elif proc.winner is not None and not proc.winner.is_noop:
            entry_key = EntryKey(KeyKind.TGID, task.tgid)
        ok = entry_key is not None and writer.holds(entry_key)
        lost = tuple(sorted(th.counted[0] - {w.key})) if th.counted is not None else ()
        return Match(tid, task.tgid, task.comm, w.key, w.priority, w.slice_ns, w.scope.value,
                     str(entry_key) if entry_key is not None else "", ok, lost)

    def figures(self, policy: PolicySet) -> Mapping[str, IntentStats]:
        """Per-intent figures under `policy` (the current one) equal to `Reconciler.intent_stats`'s,
        produced from the counts kept as tasks are matched (no pass over the task table): only the
        intents whose counts or failures changed since the last call, or that have refused or unwritten
        entries (a pass over the outbox, which is short outside a long write), are built anew; the others
        are the previous call's records, shared. The engine publishes the result (gthulhu_node/feed.py);
        no record is changed once returned."""
        writer = self._writer
        live = writer.pending()
        if self.all_touched:
            out: dict[str, IntentStats] = {}
            rebuild: Iterable[str] = policy.by_key
        else:
            out = dict(self._figures)
            rebuild = (self.touched | writer.touched | self._live | live.keys()) & policy.by_key.keys()
        counts_of, failures = self.counts, writer.failures_by_intent
        for key in rebuild:
            c = counts_of.get(key)
            f = failures.get(key)
            pending = live.get(key)
            out[key] = IntentStats(
                key,
                noop=policy.by_key[key].is_noop,
                matched_tasks=c.matched if c else 0,
                applied_tasks=c.applied if c else 0,
                lost_tasks=c.lost if c else 0,
                overlaps=dict(c.overlaps) if c else {},
                write_failures=f.count if f else 0,
                pending_failures=pending[0][0] if pending else 0,
                unwritten=pending[0][1] if pending else 0,
                pending_reasons=dict(pending[1]) if pending else {},
                last_error=f.last_message if f else "",
                last_reason=f.last_reason if f else None,
            )
        self._figures = out
        self.touched = set()
        writer.touched.clear()
        self.all_touched = False
        self._live = set(live)
        return MappingProxyType(out)

    def count(self, th: TableThread, proc: TableProcess) -> None:
        """Make the per-intent counts hold what this thread counts now: every intent it matches (its own
        thread-scope matches and its process's process-scope ones) counts it as matched, its winner as
        applied, the others as lost to the winner. Called wherever a winner, a thread's matches or a
        process's process-scope matches change; a no-op when nothing did."""
        w = th.winner
        new = None if w is None else (th.cands.union(proc.pmatch), w.key)
        old = th.counted
        if new == old:
            return
        if old is not None:
            self._tally(old, -1)
        if new is not None:
            self._tally(new, +1)
        self.matched += (new is not None) - (old is not None)
        th.counted = new
        self.row_tids.add(th.task.tid)  # its row shows what it beats (Match.overlaps)

    def uncount(self, th: TableThread) -> None:
        if th.counted is not None:
            self._tally(th.counted, -1)
            self.matched -= 1
            th.counted = None

    def count_all(self, proc: TableProcess) -> None:
        threads = self._threads
        for tid in proc.tids:
            self.count(threads[tid], proc)

    def _tally(self, counted: tuple[frozenset[str], str], delta: int) -> None:
        cands, winner = counted
        counts, touched = self.counts, self.touched
        for key in cands:
            c = counts.get(key)
            if c is None:
                c = counts[key] = IntentCount()
            c.matched += delta
            if key == winner:
                c.applied += delta
            else:
                c.lost += delta
                n = c.overlaps.get(winner, 0) + delta
                if n:
                    c.overlaps[winner] = n
                else:
                    del c.overlaps[winner]
            if not c.matched:
                del counts[key]
            touched.add(key)
