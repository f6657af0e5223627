"""The backend interface: the only thing the reconciler writes to.

One reconciler owns the desired table and is the only writer to the backend (docs/watching.md). The table is
keyed by `EntryKey`: a TID entry covers one thread, a TGID entry covers every thread of a process that has
no TID entry of its own (the scheduler looks up TID first, then TGID, then uses its default).

Every entry carries the start time of the task it was computed for (the thread for a TID entry, the
process leader for a TGID entry), in clock ticks since boot as `/proc/<pid>/stat` field 22 reports it.
A backend must never apply an entry to a task that started at another time: that is how a reused TID is
kept from inheriting a dead task's strategy.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gthulhu_node.errors import BackendError as BackendError  # re-exported: the backends' base error
from gthulhu_node.errors import Unavailable
from gthulhu_node.limits import PRIORITY_MAX, SLICE_MAX_NS, SLICE_MIN_NS


class KeyKind(enum.StrEnum):
    TID = "tid"
    TGID = "tgid"


@dataclass(frozen=True, slots=True, order=True)
class EntryKey:
    """Which task(s) an entry covers: one thread (TID) or a whole process (TGID)."""

    kind: KeyKind
    id: int

    def __str__(self) -> str:
        return f"{self.kind.value}:{self.id}"


@dataclass(frozen=True, slots=True)
class Entry:
    """What the backend holds for one key: the winning intent's priority and slice."""

    priority: int  # 0-20; > 0 is boosted
    slice_ns: int  # 0 (the scheduler's default) or 50,000-1,000,000,000
    start_time: int  # clock ticks since boot of the task the key names (see module docstring)


class BackendUnavailable(Unavailable, BackendError):
    """The backend cannot run on this host (missing kernel support, not root, ...)."""


class SchedulerRefused(BackendUnavailable):
    """The kernel has sched_ext but refused our scheduler (verifier, missing kfunc or member, attach).

    `details` are libbpf's own messages from the attempt (the verifier log among them): an operator needs
    them to report the kernel, and `backend: auto` falls back to another backend on this error only."""

    def __init__(self, message: str, details: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.details = details


class MapFullError(BackendError):
    """The backend has no room for another entry: a distinct error, never silent."""


class TaskGoneError(BackendError):
    """The task a key names no longer exists (or its id was reused): normal, not a fault."""


class InvalidEntryError(BackendError):
    """An entry outside the contract's ranges, refused before anything was written."""


@dataclass(slots=True)
class ApplyResult:
    """What one batch did. Keys in `failed` were not written (or not deleted) and say why."""

    upserted: int = 0
    deleted: int = 0
    failed: dict[EntryKey, BackendError] = field(default_factory=dict)


class BackendState(enum.StrEnum):
    STOPPED = "stopped"
    RUNNING = "running"
    # The kernel removed the scheduler (error, watchdog, sysrq): the agent reports and reloads.
    EJECTED = "ejected"


@dataclass(frozen=True, slots=True)
class BackendHealth:
    state: BackendState
    reason: str = ""


class Backend(abc.ABC):
    """A place where strategies take effect. Not thread-safe: only the reconciler's thread calls it."""

    #: short name shown in status, logs and metrics ("sched_ext", "eevdf", "dry-run")
    name: str = ""
    #: Whether a TGID entry covers every thread of its process without a TID entry, threads created
    #: later included, by itself (sched_ext: the kernel looks the TGID up at once). When False, the
    #: reconciler writes a TID entry for each thread a process-scope intent covers, and no TGID entry.
    process_fallback: bool = True

    @abc.abstractmethod
    def start(self) -> None:
        """Make the backend ready (load and attach a scheduler, ...). Raises BackendUnavailable."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Undo what start did and everything applied since (clean detach, restore originals)."""

    @abc.abstractmethod
    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        """Write a batch. Per-key failures are returned, not raised; other keys still go through.

        Raises InvalidEntryError for an out-of-range entry before any write of the batch.
        """

    @abc.abstractmethod
    def read_back(self) -> dict[EntryKey, Entry]:
        """What the backend holds now, read from where it takes effect (the kernel, for real backends)."""

    def read_keys(self, keys: Iterable[EntryKey]) -> dict[EntryKey, Entry]:
        """`read_back` of a few keys (explain's): backends whose full read-back walks a map or every
        thread override it with lookups of these keys alone."""
        wanted = set(keys)
        return {k: v for k, v in self.read_back().items() if k in wanted}

    def task_stats(self, threads: Iterable[tuple[int, int, int]]) -> dict[int, dict[str, int] | str]:
        """What the scheduler did with each (tid, tgid, start_time) lately, by TID: its per-task counters,
        or why they cannot be read (a string, never zeros). Only the sched_ext scheduler keeps such
        counters. The start time (stat field 22, as the caller read it) names the thread: a TID the kernel
        reused since is another thread, whose counters are not the caller's."""
        return {t[0]: f"not available: the {self.name} backend keeps no per-task counters" for t in threads}

    @property
    def boosted_tgid(self) -> int:
        """The process the backend boosts by itself, without an entry (the sched_ext scheduler's agent
        protection: the agent's own process, docs/scheduler.md); 0 when none."""
        return 0

    @property
    def capacity(self) -> int | None:
        """Entries each of the backend's maps holds at most; None when it has no such limit."""
        return None

    @property
    def enforces_cpu_max(self) -> bool:
        """Whether cgroup cpu.max holds for the tasks this backend schedules while it runs: the kernel's
        own scheduler enforces it; the sched_ext scheduler's objects do too (`cpu_max_source`)."""
        return True

    @property
    def cpu_max_source(self) -> str:
        """Where a backend that enforces cpu.max itself takes the limits from; "" when the kernel does."""
        return ""

    def health(self) -> BackendHealth:
        """Whether the backend still works; a real scheduler can be ejected by the kernel."""
        return BackendHealth(BackendState.RUNNING)

    def tick(self, now: float) -> None:
        """Periodic upkeep (`now`: time.monotonic()), on the reconciler's thread at every health check:
        a backend needs no thread of its own for it."""
        return None

    def counters(self) -> dict[str, int]:
        """Backend-specific monotonic counts for metrics (BPF counters for the scheduler)."""
        return {}

    def gauges(self) -> dict[str, int]:
        """Backend-specific current sizes for metrics (entries held, live map entries): unlike
        counters() they may go down, so they are exported as gauges."""
        return {}


def check_entry(key: EntryKey, entry: Entry) -> None:
    """Refuse an entry outside the intent contract (intents/model.py) before it reaches any map."""
    if not 0 <= entry.priority <= PRIORITY_MAX:
        raise InvalidEntryError(f"{key}: priority {entry.priority} is outside 0-{PRIORITY_MAX}")
    if entry.slice_ns != 0 and not SLICE_MIN_NS <= entry.slice_ns <= SLICE_MAX_NS:
        raise InvalidEntryError(
            f"{key}: slice {entry.slice_ns} ns is outside 0 or {SLICE_MIN_NS}-{SLICE_MAX_NS} ns"
        )
    if key.id <= 0 or key.id >= 1 << 31:
        raise InvalidEntryError(f"{key}: not a valid task id")
    if entry.start_time < 0:
        raise InvalidEntryError(f"{key}: negative start time")
