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

from collections.abc import Iterable, Mapping
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
from gthulhu_node.backends.eevdf_engine_slice import EngineSlice
from gthulhu_node.backends.eevdf_journal import ThreadJournal
from gthulhu_node.backends.eevdf_proc import start_time, tgid_of, thread_ids, thread_start
from gthulhu_node.backends.eevdf_threads import ChangedThread, ThreadLedger
from gthulhu_node.backends.sched_attr import Probe, SchedAttr, SchedAttrSyscalls, probe

log = structlog.get_logger(__name__)

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


class EevdfBackend(Backend):
    """Applies the strategy table with sched_setattr per thread. See the module docstring.

    It owns the entries (keys to strategies) and which threads each covers; the threads themselves, what
    they had and what we wrote, are its ledger's (eevdf_threads.py); the engine thread's own slice is
    eevdf_engine_slice.py's; what a strategy becomes in nice and slice, eevdf_policy.py's.
    """

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
        self._entries: dict[EntryKey, Entry] = {}
        self._ledger = ThreadLedger(
            proc_root=proc_root,
            journal=None if journal is None else ThreadJournal(journal),
            entries=self._entries,
        )
        self._threads = self._ledger.threads  # the same dicts, read here on every pass
        self._hands_off = self._ledger.hands_off
        self._counts = self._ledger.counts
        self._cover_interval_s = cover_interval_s
        self._verify_interval_s = verify_interval_s
        self._next_cover = self._next_verify = 0.0
        self._engine_slice = EngineSlice(engine_slice_ns)

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
        self._sys = self._ledger.calls = calls
        self._ledger.base_slice_ns = found.base_slice_ns
        self._engine_slice.start(calls, found.base_slice_ns)
        journal = self._ledger.journal
        if journal is not None:
            self._ledger.recover(journal.path.with_name(LEGACY_JOURNAL_NAME))
        self._running = True
        self._next_cover = self._next_verify = 0.0
        log.info("eevdf_backend_started", base_slice_ns=found.base_slice_ns, reason=found.reason)

    def stop(self) -> None:
        """Restore every thread we changed (those still ours), then forget everything."""
        if not self._running:
            return
        restored = len(self._threads)
        for rec in list(self._threads.values()):
            self._ledger.release(rec)
        self._engine_slice.release()
        self._entries.clear()
        self._hands_off.clear()
        self._running = False
        journal = self._ledger.journal
        if journal is not None:
            journal.compact()
            journal.close()
        log.info("eevdf_backend_stopped", threads=restored)

    def health(self) -> BackendHealth:
        return BackendHealth(BackendState.RUNNING if self._running else BackendState.STOPPED)

    def tick(self, now: float) -> None:
        """The periodic passes, on the engine's thread: every `cover_interval_s` the light one (threads
        of TGID entries not seen yet; `cover_interval_s` 0: never), every `verify_interval_s` the full one
        (reads every thread back, to find ones someone else changed or that exited). See refresh()."""
        if not self._running:
            return
        self._engine_slice.protect()
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
        self._engine_slice.protect()
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
            if thread_start(self._proc_root, tid) != start:
                del self._hands_off[tid]
        for rec in list(self._threads.values()):
            if thread_start(self._proc_root, rec.tid) != rec.start_time:
                self._ledger.forget(rec)
        for key, entry in list(self._entries.items()):
            if key.kind is KeyKind.TGID:
                result.upserted += self._cover_process(key, entry)
                continue
            held = self._threads.get(key.id)
            if held is None:
                del self._entries[key]  # the thread exited; the reconciler's delete will find nothing
                continue
            err = self._ledger.check_still_ours(held)
            if err is not None:
                result.failed[key] = err
        return result

    def read_back(self) -> dict[EntryKey, Entry]:
        """Entries whose every covered thread shows, by sched_getattr now, what we wrote.

        A key missing here is not (fully) in effect: its thread exited, or someone else changed it.
        """
        held: dict[EntryKey, Entry] = {}
        owned: dict[EntryKey, list[ChangedThread]] = {}
        for rec in self._threads.values():
            owned.setdefault(rec.owner, []).append(rec)
        for key, entry in self._entries.items():
            recs = owned.get(key, [])
            if key.kind is KeyKind.TID and not recs:
                continue
            if all(self._ledger.shows_applied(rec) for rec in recs):
                held[key] = entry
        return held

    def read_keys(self, keys: Iterable[EntryKey]) -> dict[EntryKey, Entry]:
        """`read_back` of these keys: sched_getattr of their threads only."""
        wanted = {k: e for k in keys if (e := self._entries.get(k)) is not None}
        owned: dict[EntryKey, list[ChangedThread]] = {}
        for rec in self._threads.values():
            if rec.owner in wanted:
                owned.setdefault(rec.owner, []).append(rec)
        return {key: entry for key, entry in wanted.items()
                if (key.kind is not KeyKind.TID or owned.get(key))
                and all(self._ledger.shows_applied(rec) for rec in owned.get(key, []))}

    def thread_attrs(self) -> dict[int, tuple[EntryKey, SchedAttr]]:
        """Every thread we manage, with its owning key and its attributes as sched_getattr reports now."""
        out: dict[int, tuple[EntryKey, SchedAttr]] = {}
        for rec in self._threads.values():
            current = self._ledger.get(rec.tid)
            if current is not None:
                out[rec.tid] = (rec.owner, current)
        return out

    def counters(self) -> dict[str, int]:
        """Monotonic counts since construction (threads written, restored, found changed by others, ...)."""
        counts = dict(self._counts)
        journal = self._ledger.journal
        if journal is not None:
            counts["errors"] += journal.write_failures
        counts["errors"] += self._engine_slice.failures
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
        if thread_start(self._proc_root, key.id) != entry.start_time:
            self._delete(key)
            self._counts["task_gone"] += 1
            return TaskGoneError(f"{key}: no task with start time {entry.start_time}")
        if key.kind is KeyKind.TGID:
            self._entries[key] = entry
            self._cover_process(key, entry)
            return None
        self._entries[key] = entry
        err = self._ledger.settle(key.id, 0, entry.start_time, key, entry)
        if err is not None:
            del self._entries[key]
        return err

    def _delete(self, key: EntryKey) -> BackendError | None:
        if self._entries.pop(key, None) is None:
            return None
        failure: BackendError | None = None
        for rec in [r for r in self._threads.values() if r.owner == key]:
            if key.kind is KeyKind.TID and any(k.kind is KeyKind.TGID for k in self._entries):
                tgid = rec.tgid or tgid_of(self._proc_root, rec.tid) or 0
                process_key = EntryKey(KeyKind.TGID, tgid)
                fallback = self._entries.get(process_key)
                if fallback is not None:
                    self._ledger.settle(rec.tid, tgid, rec.start_time, process_key, fallback)
                    continue
            err = self._ledger.release(rec)
            if err is not None:
                failure = err
        return failure

    def _cover_process(self, key: EntryKey, entry: Entry, *, verify: bool = True) -> int:
        """Settle every thread of the process that has no TID entry; return how many were new to us."""
        tgid = key.id
        tids = thread_ids(self._proc_root, tgid)
        present = set(tids)
        for rec in [r for r in self._threads.values() if r.owner == key and r.tid not in present]:
            self._ledger.forget(rec)
        newly = 0
        for tid in tids:
            if EntryKey(KeyKind.TID, tid) in self._entries:
                continue
            known = self._threads.get(tid)
            if not verify and (
                tid in self._hands_off or (known is not None and known.owner == key and known.entry == entry)
            ):
                continue  # the light pass only looks for threads it has not seen
            start = start_time(self._proc_root, tgid, tid)
            if start is None or self._ledger.left_alone(tid, start) is not None:
                continue
            fresh = known is None or known.start_time != start
            if self._ledger.settle(tid, tgid, start, key, entry) is None and fresh:
                newly += 1
        return newly

    # --- helpers ---------------------------------------------------------------------------------------

    def _require_running(self) -> None:
        if not self._running:
            raise BackendError("the eevdf backend is not started")
