"""The threads the eevdf backend changed, one by one: what each had before and what we wrote; settling a
thread on an entry, giving it back its original attributes, handing it over to whoever else changed it,
and the journal that lets a successor undo our writes after a crash (eevdf_journal.py).

A thread whose attributes differ from what we last wrote was changed by someone else: it is left alone (not
even restored) until it exits, logged, counted, and reported on its key. Only SCHED_OTHER and SCHED_BATCH
threads are managed; real-time, deadline and SCHED_IDLE threads are left alone and reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog

from gthulhu_node.backends.base import BackendError, Entry, EntryKey, KeyKind, TaskGoneError
from gthulhu_node.backends.eevdf_journal import JournalRecord, ThreadJournal, read_journal
from gthulhu_node.backends.eevdf_policy import desired, read_back_of, request_of
from gthulhu_node.backends.eevdf_proc import GONE, thread_start
from gthulhu_node.backends.sched_attr import FAIR_POLICIES, SchedAttr, SchedAttrSyscalls

log = structlog.get_logger(__name__)

COUNTERS = (
    "setattr",
    "restored",
    "foreign_changes",
    "task_gone",
    "threads_exited",
    "policy_skipped",
    "errors",
)


class ForeignChangeError(BackendError):
    """Someone else changed the thread's scheduling attributes after we did: it is theirs now."""


class PolicyNotManagedError(BackendError):
    """The thread runs under a policy this backend does not touch (real-time, deadline, SCHED_IDLE)."""


@dataclass(slots=True)
class ChangedThread:
    """One thread we changed: what it had before, what we wrote (as the kernel reported it back)."""

    tid: int
    tgid: int  # 0 until needed: looking it up (/proc/<tid>/status) cost a third of a TID entry's write
    start_time: int
    owner: EntryKey
    entry: Entry
    original: SchedAttr
    applied: SchedAttr


class ThreadLedger:
    """The changed threads (`threads`), the ones left alone until they exit (`hands_off`), and the
    counters of what happened to them; on the engine's thread only, like the backend that holds it."""

    def __init__(
        self, *, proc_root: Path, journal: ThreadJournal | None, entries: dict[EntryKey, Entry]
    ) -> None:
        """`entries`: the backend's table; a TID entry whose thread is handed over leaves it."""
        self._proc_root = proc_root
        self.journal = journal
        self._entries = entries
        self.calls: SchedAttrSyscalls | None = None  # set by the backend's start()
        self.base_slice_ns = 0
        self.threads: dict[int, ChangedThread] = {}
        # tid -> (start time, why): threads we must not touch until they exit (changed by someone else,
        # or under a policy we do not manage); the error is what their key reports.
        self.hands_off: dict[int, tuple[int, BackendError]] = {}
        self.counts = dict.fromkeys(COUNTERS, 0)

    def settle(self, tid: int, tgid: int, start: int, key: EntryKey, entry: Entry) -> BackendError | None:
        """Make one thread carry `entry` for `key`, recording its original attributes the first time."""
        why = self.left_alone(tid, start)
        if why is not None:
            return why
        rec = self.threads.get(tid)
        if rec is not None and rec.start_time != start:
            self.forget(rec)
            rec = None
        if rec is not None and rec.owner == key and rec.entry == entry:
            return self.check_still_ours(rec)
        try:
            current = self._calls().get(tid)
        except OSError as exc:
            return self._syscall_failed(key, tid, rec, exc)
        if rec is not None:
            if not current.same_settings(rec.applied):
                return self._foreign(rec, current)
            original = rec.original
            tgid = tgid or rec.tgid
        else:
            if current.policy not in FAIR_POLICIES:
                self.counts["policy_skipped"] += 1
                log.info("eevdf_policy_skipped", key=str(key), tid=tid, policy=current.policy_name)
                skipped = PolicyNotManagedError(
                    f"{key}: thread {tid} runs under {current.policy_name}; left alone"
                )
                self.hands_off[tid] = (start, skipped)
                return skipped
            original = current
        wanted = desired(original, entry, self.base_slice_ns)
        expected = read_back_of(wanted, self.base_slice_ns)
        self._journal_changing(tid, tgid, start, original, expected)  # ahead of the write: see the journal
        try:
            self._calls().set(tid, wanted)
            applied = self._calls().get(tid)
        except OSError as exc:
            return self._syscall_failed(key, tid, rec, exc)
        if not applied.same_settings(expected):
            self._journal_changing(tid, tgid, start, original, applied)
        self.counts["setattr"] += 1
        self.threads[tid] = ChangedThread(tid, tgid, start, key, entry, original, applied)
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

    def release(self, rec: ChangedThread) -> BackendError | None:
        """Give a thread back its original attributes, unless it exited or someone else changed it."""
        err = self._give_back(rec)
        if self.journal is not None:
            self.journal.released(rec.tid)  # after the restore: a crash before it still finds the thread
        return err

    def _give_back(self, rec: ChangedThread, earlier: tuple[SchedAttr, ...] = ()) -> BackendError | None:
        self.threads.pop(rec.tid, None)
        if thread_start(self._proc_root, rec.tid) != rec.start_time:
            self.counts["threads_exited"] += 1
            return None
        current = self.get(rec.tid)
        if current is None:
            self.counts["threads_exited"] += 1
            return None
        if not any(current.same_settings(a) for a in (rec.applied, *earlier)):
            return self._foreign(rec, current)
        original = rec.original
        restore = SchedAttr(
            original.policy, original.nice, request_of(original, self.base_slice_ns), original.reset_on_fork
        )
        try:
            self._calls().set(rec.tid, restore)
        except OSError as exc:
            if exc.errno in GONE:
                self.counts["threads_exited"] += 1
                return None
            self.counts["errors"] += 1
            log.warning("eevdf_restore_failed", tid=rec.tid, key=str(rec.owner), error=exc.strerror)
            return BackendError(f"{rec.owner}: restoring thread {rec.tid} failed: {exc.strerror}")
        self.counts["restored"] += 1
        log.debug("eevdf_thread_restored", key=str(rec.owner), tid=rec.tid, nice=original.nice)
        return None

    def check_still_ours(self, rec: ChangedThread) -> BackendError | None:
        current = self.get(rec.tid)
        if current is None:
            self.forget(rec)
            return None
        if not current.same_settings(rec.applied):
            return self._foreign(rec, current)
        return None

    def shows_applied(self, rec: ChangedThread) -> bool:
        current = self.get(rec.tid)
        return current is not None and current.same_settings(rec.applied)

    def _foreign(self, rec: ChangedThread, current: SchedAttr) -> ForeignChangeError:
        """Hand a thread over to whoever changed it: no restore, no further writes until it exits."""
        self.threads.pop(rec.tid, None)
        if self.journal is not None:
            self.journal.released(rec.tid)
        if rec.owner.kind is KeyKind.TID:
            self._entries.pop(rec.owner, None)
        self.counts["foreign_changes"] += 1
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
        self.hands_off[rec.tid] = (rec.start_time, err)
        return err

    def left_alone(self, tid: int, start: int) -> BackendError | None:
        held = self.hands_off.get(tid)
        return held[1] if held is not None and held[0] == start else None

    def forget(self, rec: ChangedThread) -> None:
        """The thread exited (or its TID now names another task): nothing to restore."""
        self.threads.pop(rec.tid, None)
        if self.journal is not None:
            self.journal.released(rec.tid)
        self.counts["threads_exited"] += 1

    def _syscall_failed(
        self, key: EntryKey, tid: int, rec: ChangedThread | None, exc: OSError
    ) -> BackendError:
        if exc.errno in GONE:
            if rec is not None:
                self.forget(rec)
            self.counts["task_gone"] += 1
            return TaskGoneError(f"{key}: thread {tid} exited")
        self.counts["errors"] += 1
        log.warning("eevdf_setattr_failed", key=str(key), tid=tid, error=exc.strerror, errno=exc.errno)
        return BackendError(f"{key}: thread {tid}: {exc.strerror}")

    # --- the journal: what a crashed agent left behind -------------------------------------------------

    def _journal_changing(
        self, tid: int, tgid: int, start: int, original: SchedAttr, applied: SchedAttr
    ) -> None:
        """A sched_ext scheduler dies with the agent; nice values and slice requests do not: the journal
        names each thread before we write it, so a successor can undo our writes."""
        if self.journal is not None:
            self.journal.changing(JournalRecord(tid, tgid, start, original, applied))

    def recover(self, legacy: Path) -> None:
        """Undo what a predecessor that died without stop() wrote: each thread it changed that is still
        the same task and still shows its write gets its original attributes back; then the journal
        starts empty (in this order, so a crash during recovery loses nothing). `legacy`: the one-document
        journal of earlier versions, read once and removed."""
        if self.journal is None:
            return
        records = self.journal.leftovers() + read_journal(legacy)
        before = self.counts["restored"]
        for r in records:
            owner, entry = EntryKey(KeyKind.TID, r.tid), Entry(0, 0, r.start_time)
            self._give_back(
                ChangedThread(r.tid, r.tgid, r.start_time, owner, entry, r.original, r.applied), r.earlier
            )
        if records:
            restored = self.counts["restored"] - before
            log.info("eevdf_journal_recovered", threads=len(records), restored=restored)
        self.journal.begin(self.base_slice_ns)
        legacy.unlink(missing_ok=True)

    # --- the kernel ------------------------------------------------------------------------------------

    def _calls(self) -> SchedAttrSyscalls:
        assert self.calls is not None, "started backends have their syscalls"
        return self.calls

    def get(self, tid: int) -> SchedAttr | None:
        """The thread's attributes now; None when it exited or cannot be read (counted, logged)."""
        try:
            return self._calls().get(tid)
        except OSError as exc:
            if exc.errno not in GONE:
                self.counts["errors"] += 1
                log.warning("eevdf_getattr_failed", tid=tid, error=exc.strerror)
            return None
