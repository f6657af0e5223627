"""The EEVDF backend: strategies through the kernel's own fair scheduler, for kernels without sched_ext.

Each covered thread gets, through `sched_setattr(2)`:
- priority > 0: a nice level (`nice_for_priority`), never weaker than the thread's own nice;
- slice > 0: a slice request (`sched_runtime`, honoured by EEVDF since Linux 6.12, clamped by the kernel
  to 100 us - 100 ms); priority 0 keeps the thread's nice, slice 0 keeps its slice;
- SCHED_FLAG_RESET_ON_FORK, so threads it creates start with nice 0 (when ours is negative) and no slice
  request: as under the sched_ext backend, a strategy never spreads to new tasks by inheritance.
A thread's original attributes are read before the first change and written back when no entry covers it
any more, or at stop(). A thread whose attributes differ from what we last wrote was changed by someone
else: it is left alone (not even restored) until it exits, logged, counted, and reported on its key.

Semantics that differ from the sched_ext backend (docs/eevdf.md): no preemption guarantee (a boost is a
weight, not a place ahead of the queue), no in-kernel TGID fallback (`process_fallback` is False: the
reconciler gives every thread of a process-scope match its own TID entry, new threads on their fork
event; a TGID entry applied here directly is expanded to the process's threads, and threads created later
are covered by the periodic pass), and no starvation guard of our own (EEVDF's fairness bounds what a
boosted thread can take). Like the sched_ext backend it is a writer: no thread, socket or lock of its own,
called only on the engine's thread (its periodic passes through `tick`). Only SCHED_OTHER and
SCHED_BATCH threads are managed; real-time, deadline and SCHED_IDLE threads are left alone and
reported. Nice values outlive the agent, so the threads it changed are journaled (eevdf_journal.py) and
a successor restores them after a crash.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from gthulhu_node.backends.base import (
    ApplyResult,
    Backend,
    BackendError,
    BackendHealth,
    BackendState,
    BackendUnavailable,
    Entry,
    EntryKey,
    KeyKind,
    TaskGoneError,
    check_entry,
)
from gthulhu_node.backends.eevdf_journal import JournalRecord, ThreadJournal, read_journal
from gthulhu_node.backends.sched_attr import (
    FAIR_POLICIES,
    KERNEL_SLICE_MAX_NS,
    KERNEL_SLICE_MIN_NS,
    NICE_MIN,
    Probe,
    SchedAttr,
    SchedAttrSyscalls,
    probe,
)
from gthulhu_node.limits import PRIORITY_MAX, strength
from gthulhu_node.tasks.procfs import StatParseError, read_task

log = structlog.get_logger(__name__)

# The weakest boost is nice -5 (about 3x the CPU weight of a nice-0 thread): "boosted" must mean served
# ahead of ordinary threads, and nice -1 (1.25x) would not be noticeable under contention.
NICE_WEAKEST_BOOST = -5
_GONE = frozenset({errno.ESRCH, errno.ENOENT})
# The file, in the agent's state directory, where it keeps the threads it changed, for a successor after a
# crash (not /run: systemd empties the unit's RuntimeDirectory on every stop, crashes included). One agent
# per host uses it; other instances (tests, benches) pass none. The format: backends/eevdf_journal.py.
JOURNAL_NAME = "eevdf-threads.journal"
# Where versions before the incremental journal kept it (one JSON document): read once, then removed.
LEGACY_JOURNAL_NAME = "eevdf-threads.json"
# The slice request the agent's engine thread gets (the kernel's minimum): a thread waking with a shorter
# slice than the running one's may preempt it at once (EEVDF's PREEMPT_SHORT), where it otherwise waited
# for the running thread's slice to end at the next tick (4 ms at HZ=250). docs/eevdf.md, reaction time.
ENGINE_SLICE_NS = 100_000


def nice_for_priority(priority: int) -> int:
    """Map a boost priority 1-20 onto nice -20..-5, evenly (rounded), a stronger priority (1 the
    strongest: limits.strength) never a weaker nice.

    Compressed rather than 1:1 (strength s -> nice -s) because the weaker half of a 1:1 map barely changes
    a thread's weight; 20 priorities on 16 nice levels means a few neighbours share a level.
    """
    if not 1 <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority {priority} is not a boost (1-{PRIORITY_MAX})")
    span = NICE_WEAKEST_BOOST - NICE_MIN  # 15 levels below the weakest boost
    steps = (2 * span * (strength(priority) - 1) + (PRIORITY_MAX - 1)) // (2 * (PRIORITY_MAX - 1))
    return NICE_WEAKEST_BOOST - steps


class ForeignChangeError(BackendError):
    """Someone else changed the thread's scheduling attributes after we did: it is theirs now."""


class PolicyNotManagedError(BackendError):
    """The thread runs under a policy this backend does not touch (real-time, deadline, SCHED_IDLE)."""


@dataclass(slots=True)
class _Thread:
    """One thread we changed: what it had before, what we wrote (as the kernel reported it back)."""

    tid: int
    tgid: int  # 0 until needed: looking it up (/proc/<tid>/status) cost a third of a TID entry's write
    start_time: int
    owner: EntryKey
    entry: Entry
    original: SchedAttr
    applied: SchedAttr


_COUNTERS = (
    "setattr",
    "restored",
    "foreign_changes",
    "task_gone",
    "threads_exited",
    "policy_skipped",
    "errors",
)


class EevdfBackend(Backend):
    """Applies the strategy table with sched_setattr per thread. See the module docstring."""

    name = "eevdf"
    process_fallback = False

    def __init__(
        self,
        *,
        proc_root: Path = Path("/proc"),
        syscalls: SchedAttrSyscalls | None = None,
        probed: Probe | None = None,
        cover_interval_s: float = 1.0,
        verify_interval_s: float = 30.0,
        journal: Path | None = None,
        engine_slice_ns: int = 0,
    ) -> None:
        """`engine_slice_ns` > 0: the thread that calls `apply` and `tick` (the engine's) asks for that
        slice (see ENGINE_SLICE_NS); the agent passes it, tests and tools that call from their own
        threads do not."""
        self._proc_root = proc_root
        self._sys = syscalls
        self._probed = probed
        self._running = False
        self._base_slice_ns = 0
        self._entries: dict[EntryKey, Entry] = {}
        self._threads: dict[int, _Thread] = {}
        # tid -> (start time, why): threads we must not touch until they exit (changed by someone else,
        # or under a policy we do not manage); the error is what their key reports.
        self._hands_off: dict[int, tuple[int, BackendError]] = {}
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._cover_interval_s = cover_interval_s
        self._verify_interval_s = verify_interval_s
        self._next_cover = self._next_verify = 0.0
        self._journal = None if journal is None else ThreadJournal(journal)
        self._engine_slice_ns = engine_slice_ns
        # The engine thread's tid once seen, and whether it carries our slice request (to drop at stop).
        self._engine_tid = 0
        self._engine_slice_set = False

    # --- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> None:
        if self._running:
            return
        try:
            calls = self._sys or SchedAttrSyscalls()
        except OSError as exc:
            raise BackendUnavailable(str(exc)) from None
        found = self._probed or probe(calls)
        if not found.ok:
            raise BackendUnavailable(found.reason)
        self._sys = calls
        self._base_slice_ns = found.base_slice_ns
        self._recover()
        self._running = True
        self._next_cover = self._next_verify = 0.0
        log.info("eevdf_backend_started", base_slice_ns=self._base_slice_ns, reason=found.reason)

    def stop(self) -> None:
        """Restore every thread we changed (those still ours), then forget everything."""
        if not self._running:
            return
        restored = len(self._threads)
        for rec in list(self._threads.values()):
            self._release(rec)
        self._release_engine_thread()
        self._entries.clear()
        self._hands_off.clear()
        self._running = False
        if self._journal is not None:
            self._journal.compact()
            self._journal.close()
        log.info("eevdf_backend_stopped", threads=restored)

    def health(self) -> BackendHealth:
        return BackendHealth(BackendState.RUNNING if self._running else BackendState.STOPPED)

    def tick(self, now: float) -> None:
        """The periodic passes, on the engine's thread: every `cover_interval_s` the light one (threads
        of TGID entries not seen yet; `cover_interval_s` 0: never), every `verify_interval_s` the full one
        (reads every thread back, to find ones someone else changed or that exited). See refresh()."""
        if not self._running:
            return
        self._protect_engine_thread()
        if now >= self._next_verify:
            if self._next_verify:  # not at the first tick: start() has just written everything
                self.refresh(verify=True)
            self._next_verify = now + self._verify_interval_s
            self._next_cover = now + self._cover_interval_s
        elif self._cover_interval_s > 0 and now >= self._next_cover:
            self.refresh(verify=False)
            self._next_cover = now + self._cover_interval_s

    # --- the Backend interface -------------------------------------------------------------------------

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        for key, entry in upserts.items():
            check_entry(key, entry)
        self._require_running()
        self._protect_engine_thread()
        result = ApplyResult()
        for key in deletes:
            if key in upserts:
                continue
            err = self._delete(key)
            if err is None:
                result.deleted += 1
            else:
                result.failed[key] = err
        # TID entries first: a TGID entry covers only the threads without an entry of their own.
        for key, entry in sorted(upserts.items(), key=lambda item: item[0].kind is not KeyKind.TID):
            err = self._upsert(key, entry)
            if err is None:
                result.upserted += 1
            else:
                result.failed[key] = err
        return result

    def refresh(self, *, verify: bool = True) -> ApplyResult:
        """Bring TGID entries up to date with their processes' threads; forget threads that exited.

        The kernel has no TGID fallback for this backend: a thread created after a TGID entry was
        applied is written by this pass (listing each process's threads; new ones are written, gone ones
        forgotten; tick() runs it every `cover_interval_s`); with `verify` (every `verify_interval_s`) it
        also reads every thread back, to find ones someone else changed. `upserted` counts threads newly
        covered; `failed` names TID keys whose thread left our hands.
        """
        self._require_running()
        result = ApplyResult()
        if not verify:
            for key, entry in list(self._entries.items()):
                if key.kind is KeyKind.TGID:
                    result.upserted += self._cover_process(key, entry, verify=False)
            return result
        for tid, (start, _why) in list(self._hands_off.items()):
            if self._thread_start(tid) != start:
                del self._hands_off[tid]
        for rec in list(self._threads.values()):
            if self._thread_start(rec.tid) != rec.start_time:
                self._forget_thread(rec)
        for key, entry in list(self._entries.items()):
            if key.kind is KeyKind.TGID:
                result.upserted += self._cover_process(key, entry)
                continue
            held = self._threads.get(key.id)
            if held is None:
                del self._entries[key]  # the thread exited; the reconciler's delete will find nothing
                continue
            err = self._check_still_ours(held)
            if err is not None:
                result.failed[key] = err
        return result

    def read_back(self) -> dict[EntryKey, Entry]:
        """Entries whose every covered thread shows, by sched_getattr now, what we wrote.

        A key missing here is not (fully) in effect: its thread exited, or someone else changed it.
        """
        held: dict[EntryKey, Entry] = {}
        owned: dict[EntryKey, list[_Thread]] = {}
        for rec in self._threads.values():
            owned.setdefault(rec.owner, []).append(rec)
        for key, entry in self._entries.items():
            recs = owned.get(key, [])
            if key.kind is KeyKind.TID and not recs:
                continue
            if all(self._shows_applied(rec) for rec in recs):
                held[key] = entry
        return held

    def read_keys(self, keys: Iterable[EntryKey]) -> dict[EntryKey, Entry]:
        """`read_back` of these keys: sched_getattr of their threads only."""
        wanted = {k: e for k in keys if (e := self._entries.get(k)) is not None}
        owned: dict[EntryKey, list[_Thread]] = {}
        for rec in self._threads.values():
            if rec.owner in wanted:
                owned.setdefault(rec.owner, []).append(rec)
        return {key: entry for key, entry in wanted.items()
                if (key.kind is not KeyKind.TID or owned.get(key))
                and all(self._shows_applied(rec) for rec in owned.get(key, []))}

    def thread_attrs(self) -> dict[int, tuple[EntryKey, SchedAttr]]:
        """Every thread we manage, with its owning key and its attributes as sched_getattr reports now."""
        out: dict[int, tuple[EntryKey, SchedAttr]] = {}
        for rec in self._threads.values():
            current = self._get(rec.tid)
            if current is not None:
                out[rec.tid] = (rec.owner, current)
        return out

    def counters(self) -> dict[str, int]:
        """Monotonic counts since construction (threads written, restored, found changed by others, ...)."""
        counts = dict(self._counts)
        if self._journal is not None:
            counts["errors"] += self._journal.write_failures
        return counts

    def gauges(self) -> dict[str, int]:
        """Current sizes: entries held, threads carrying them, threads left alone until they exit."""
        return {
            "entries": len(self._entries),
            "threads_managed": len(self._threads),
            "threads_left_alone": len(self._hands_off),
        }

    # --- keys ------------------------------------------------------------------------------------------

    def _upsert(self, key: EntryKey, entry: Entry) -> BackendError | None:
        if self._thread_start(key.id) != entry.start_time:
            self._delete(key)
            self._counts["task_gone"] += 1
            return TaskGoneError(f"{key}: no task with start time {entry.start_time}")
        if key.kind is KeyKind.TGID:
            self._entries[key] = entry
            self._cover_process(key, entry)
            return None
        self._entries[key] = entry
        err = self._settle(key.id, 0, entry.start_time, key, entry)
        if err is not None:
            del self._entries[key]
        return err

    def _delete(self, key: EntryKey) -> BackendError | None:
        if self._entries.pop(key, None) is None:
            return None
        failure: BackendError | None = None
        for rec in [r for r in self._threads.values() if r.owner == key]:
            if key.kind is KeyKind.TID and any(k.kind is KeyKind.TGID for k in self._entries):
                tgid = rec.tgid or self._tgid_of(rec.tid) or 0
                process_key = EntryKey(KeyKind.TGID, tgid)
                fallback = self._entries.get(process_key)
                if fallback is not None:
                    self._settle(rec.tid, tgid, rec.start_time, process_key, fallback)
                    continue
            err = self._release(rec)
            if err is not None:
                failure = err
        return failure

    def _cover_process(self, key: EntryKey, entry: Entry, *, verify: bool = True) -> int:
        """Settle every thread of the process that has no TID entry; return how many were new to us."""
        tgid = key.id
        try:
            tids = [int(name) for name in os.listdir(self._proc_root / str(tgid) / "task")]
        except OSError:
            tids = []
        present = set(tids)
        for rec in [r for r in self._threads.values() if r.owner == key and r.tid not in present]:
            self._forget_thread(rec)
        newly = 0
        for tid in tids:
            if EntryKey(KeyKind.TID, tid) in self._entries:
                continue
            known = self._threads.get(tid)
            if not verify and (
                tid in self._hands_off or (known is not None and known.owner == key and known.entry == entry)
            ):
                continue  # the light pass only looks for threads it has not seen
            start = self._start_time(tgid, tid)
            if start is None or self._left_alone(tid, start) is not None:
                continue
            fresh = known is None or known.start_time != start
            if self._settle(tid, tgid, start, key, entry) is None and fresh:
                newly += 1
        return newly

    # --- threads ---------------------------------------------------------------------------------------

    def _settle(self, tid: int, tgid: int, start: int, key: EntryKey, entry: Entry) -> BackendError | None:
        """Make one thread carry `entry` for `key`, recording its original attributes the first time."""
        why = self._left_alone(tid, start)
        if why is not None:
            return why
        rec = self._threads.get(tid)
        if rec is not None and rec.start_time != start:
            self._forget_thread(rec)
            rec = None
        if rec is not None and rec.owner == key and rec.entry == entry:
            return self._check_still_ours(rec)
        try:
            current = self._sys_calls().get(tid)
        except OSError as exc:
            return self._syscall_failed(key, tid, rec, exc)
        if rec is not None:
            if not current.same_settings(rec.applied):
                return self._foreign(rec, current)
            original = rec.original
            tgid = tgid or rec.tgid
        else:
            if current.policy not in FAIR_POLICIES:
                self._counts["policy_skipped"] += 1
                log.info("eevdf_policy_skipped", key=str(key), tid=tid, policy=current.policy_name)
                skipped = PolicyNotManagedError(
                    f"{key}: thread {tid} runs under {current.policy_name}; left alone"
                )
                self._hands_off[tid] = (start, skipped)
                return skipped
            original = current
        desired = self._desired(original, entry)
        expected = self._read_back_of(desired)
        self._journal_changing(tid, tgid, start, original, expected)  # ahead of the write: see the journal
        try:
            self._sys_calls().set(tid, desired)
            applied = self._sys_calls().get(tid)
        except OSError as exc:
            return self._syscall_failed(key, tid, rec, exc)
        if not applied.same_settings(expected):
            self._journal_changing(tid, tgid, start, original, applied)
        self._counts["setattr"] += 1
        self._threads[tid] = _Thread(tid, tgid, start, key, entry, original, applied)
        log.debug(
            "eevdf_thread_applied",
            key=str(key),
            tid=tid,
            nice=applied.nice,
            slice_ns=applied.runtime_ns,
            original_nice=original.nice,
            original_slice_ns=original.runtime_ns,
        )
        return None

    def _release(self, rec: _Thread) -> BackendError | None:
        """Give a thread back its original attributes, unless it exited or someone else changed it."""
        err = self._give_back(rec)
        if self._journal is not None:
            self._journal.released(rec.tid)  # after the restore: a crash before it still finds the thread
        return err

    def _give_back(self, rec: _Thread, earlier: tuple[SchedAttr, ...] = ()) -> BackendError | None:
        self._threads.pop(rec.tid, None)
        if self._thread_start(rec.tid) != rec.start_time:
            self._counts["threads_exited"] += 1
            return None
        current = self._get(rec.tid)
        if current is None:
            self._counts["threads_exited"] += 1
            return None
        if not any(current.same_settings(a) for a in (rec.applied, *earlier)):
            return self._foreign(rec, current)
        original = rec.original
        restore = SchedAttr(
            original.policy, original.nice, self._request_of(original), original.reset_on_fork
        )
        try:
            self._sys_calls().set(rec.tid, restore)
        except OSError as exc:
            if exc.errno in _GONE:
                self._counts["threads_exited"] += 1
                return None
            self._counts["errors"] += 1
            log.warning("eevdf_restore_failed", tid=rec.tid, key=str(rec.owner), error=exc.strerror)
            return BackendError(f"{rec.owner}: restoring thread {rec.tid} failed: {exc.strerror}")
        self._counts["restored"] += 1
        log.debug("eevdf_thread_restored", key=str(rec.owner), tid=rec.tid, nice=original.nice)
        return None

    def _check_still_ours(self, rec: _Thread) -> BackendError | None:
        current = self._get(rec.tid)
        if current is None:
            self._forget_thread(rec)
            return None
        if not current.same_settings(rec.applied):
            return self._foreign(rec, current)
        return None

    def _shows_applied(self, rec: _Thread) -> bool:
        current = self._get(rec.tid)
        return current is not None and current.same_settings(rec.applied)

    def _foreign(self, rec: _Thread, current: SchedAttr) -> ForeignChangeError:
        """Hand a thread over to whoever changed it: no restore, no further writes until it exits."""
        self._threads.pop(rec.tid, None)
        if self._journal is not None:
            self._journal.released(rec.tid)
        if rec.owner.kind is KeyKind.TID:
            self._entries.pop(rec.owner, None)
        self._counts["foreign_changes"] += 1
        log.warning(
            "eevdf_foreign_change",
            key=str(rec.owner),
            tid=rec.tid,
            expected_nice=rec.applied.nice,
            found_nice=current.nice,
            expected_slice_ns=rec.applied.runtime_ns,
            found_slice_ns=current.runtime_ns,
            found_policy=current.policy_name,
        )
        err = ForeignChangeError(
            f"{rec.owner}: thread {rec.tid} was changed by someone else (nice {current.nice}, "
            f"slice {current.runtime_ns} ns, {current.policy_name}); left alone"
        )
        self._hands_off[rec.tid] = (rec.start_time, err)
        return err

    def _left_alone(self, tid: int, start: int) -> BackendError | None:
        held = self._hands_off.get(tid)
        return held[1] if held is not None and held[0] == start else None

    def _forget_thread(self, rec: _Thread) -> None:
        """The thread exited (or its TID now names another task): nothing to restore."""
        self._threads.pop(rec.tid, None)
        if self._journal is not None:
            self._journal.released(rec.tid)
        self._counts["threads_exited"] += 1

    def _syscall_failed(self, key: EntryKey, tid: int, rec: _Thread | None, exc: OSError) -> BackendError:
        if exc.errno in _GONE:
            if rec is not None:
                self._forget_thread(rec)
            self._counts["task_gone"] += 1
            return TaskGoneError(f"{key}: thread {tid} exited")
        self._counts["errors"] += 1
        log.warning("eevdf_setattr_failed", key=str(key), tid=tid, error=exc.strerror, errno=exc.errno)
        return BackendError(f"{key}: thread {tid}: {exc.strerror}")

    def _desired(self, original: SchedAttr, entry: Entry) -> SchedAttr:
        nice = original.nice
        if entry.priority > 0:
            nice = min(nice, nice_for_priority(entry.priority))
        runtime = entry.slice_ns if entry.slice_ns else self._request_of(original)
        return SchedAttr(original.policy, nice, runtime, reset_on_fork=True)

    def _read_back_of(self, desired: SchedAttr) -> SchedAttr:
        """What sched_getattr will report after writing `desired`: the kernel clamps a slice request and
        reports the base slice when there is none (sched_attr.py)."""
        runtime = desired.runtime_ns
        if runtime:
            runtime = min(max(runtime, KERNEL_SLICE_MIN_NS), KERNEL_SLICE_MAX_NS)
        else:
            runtime = self._base_slice_ns
        return SchedAttr(desired.policy, desired.nice, runtime, desired.reset_on_fork)

    def _request_of(self, original: SchedAttr) -> int:
        """The slice request to write back: 0 (none) when the thread only had the base slice.

        sched_getattr cannot tell "no request" from "a request equal to the base slice"; both are
        restored as no request, which behaves the same until someone changes the base slice.
        """
        return 0 if original.runtime_ns == self._base_slice_ns else original.runtime_ns

    # --- the engine thread's own slice -----------------------------------------------------------------

    def _protect_engine_thread(self) -> None:
        """Give the calling thread (the engine's) a short slice request, once.

        The proc connector wakes the engine with a sync wakeup, which places it on the CPU of the thread
        that renamed itself or forked; with the default slice it waits there until that thread's slice
        ends at the next tick (4 ms at HZ=250) unless the thread sleeps first. With a shorter slice the
        kernel lets it preempt at once (PREEMPT_SHORT) and picks it first after any preemption. Its
        weight (nice) is left alone: the agent's share of the CPU does not grow, only its latency falls.
        """
        if self._engine_slice_ns <= 0:
            return
        tid = threading.get_native_id()
        if tid == self._engine_tid:
            return
        self._release_engine_thread()
        self._engine_tid = tid
        calls = self._sys_calls()
        try:
            before = calls.get(tid)
            if before.policy not in FAIR_POLICIES or before.runtime_ns != self._base_slice_ns:
                return  # real-time, or a slice someone chose: not ours to change
            calls.set(tid, SchedAttr(before.policy, before.nice, self._engine_slice_ns, before.reset_on_fork))
        except OSError as exc:
            self._counts["errors"] += 1
            log.warning("eevdf_engine_slice_failed", tid=tid, error=exc.strerror)
            return
        self._engine_slice_set = True
        log.info("eevdf_engine_slice", tid=tid, slice_ns=self._engine_slice_ns)

    def _release_engine_thread(self) -> None:
        """Drop the engine thread's slice request if it still has ours (at stop; a new engine thread)."""
        tid, ours = self._engine_tid, self._engine_slice_set
        self._engine_tid, self._engine_slice_set = 0, False
        if not ours or not os.path.exists(f"/proc/self/task/{tid}"):
            return  # nothing written, or the thread ended (and its tid is not ours any more)
        try:
            now = self._sys_calls().get(tid)
            if now.runtime_ns == min(max(self._engine_slice_ns, KERNEL_SLICE_MIN_NS), KERNEL_SLICE_MAX_NS):
                self._sys_calls().set(tid, SchedAttr(now.policy, now.nice, 0, now.reset_on_fork))
        except OSError as exc:
            if exc.errno not in _GONE:
                log.warning("eevdf_engine_slice_restore_failed", tid=tid, error=exc.strerror)

    # --- the journal: what a crashed agent left behind -------------------------------------------------

    def _journal_changing(
        self, tid: int, tgid: int, start: int, original: SchedAttr, applied: SchedAttr
    ) -> None:
        """A sched_ext scheduler dies with the agent; nice values and slice requests do not: the journal
        names each thread before we write it, so a successor can undo our writes."""
        if self._journal is not None:
            self._journal.changing(JournalRecord(tid, tgid, start, original, applied))

    def _recover(self) -> None:
        """Undo what a predecessor that died without stop() wrote: each thread it changed that is still
        the same task and still shows its write gets its original attributes back; then the journal
        starts empty (in this order, so a crash during recovery loses nothing)."""
        if self._journal is None:
            return
        legacy = self._journal.path.with_name(LEGACY_JOURNAL_NAME)
        records = self._journal.leftovers() + read_journal(legacy)
        before = self._counts["restored"]
        for r in records:
            owner, entry = EntryKey(KeyKind.TID, r.tid), Entry(0, 0, r.start_time)
            self._give_back(
                _Thread(r.tid, r.tgid, r.start_time, owner, entry, r.original, r.applied), r.earlier
            )
        if records:
            restored = self._counts["restored"] - before
            log.info("eevdf_journal_recovered", threads=len(records), restored=restored)
        self._journal.begin(self._base_slice_ns)
        legacy.unlink(missing_ok=True)

    # --- helpers ---------------------------------------------------------------------------------------

    def _require_running(self) -> None:
        if not self._running:
            raise BackendError("the eevdf backend is not started")

    def _sys_calls(self) -> SchedAttrSyscalls:
        assert self._sys is not None, "started backends have their syscalls"
        return self._sys

    def _get(self, tid: int) -> SchedAttr | None:
        try:
            return self._sys_calls().get(tid)
        except OSError as exc:
            if exc.errno not in _GONE:
                self._counts["errors"] += 1
                log.warning("eevdf_getattr_failed", tid=tid, error=exc.strerror)
            return None

    def _start_time(self, tgid: int, tid: int) -> int | None:
        try:
            task = read_task(tgid, tid, self._proc_root)
        except (OSError, StatParseError):
            return None
        return None if task is None else task.start_time

    def _thread_start(self, tid: int) -> int | None:
        """A thread's start time, whatever its process: /proc/<tid> resolves for any thread, and its
        task/<tid>/stat is the thread's own (O(1), unlike /proc/<tid>/stat)."""
        return self._start_time(tid, tid)

    def _tgid_of(self, tid: int) -> int | None:
        """The process a thread belongs to (/proc/<tid> resolves for any thread, not only leaders)."""
        try:
            with open(self._proc_root / str(tid) / "status", "rb") as status:
                for line in status:
                    if line.startswith(b"Tgid:"):
                        return int(line.split()[1])
        except (OSError, ValueError, IndexError):
            return None
        return None
