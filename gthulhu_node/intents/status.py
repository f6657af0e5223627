"""Per-intent status: what became of each intent, in words a user troubleshooting it can act on.

Upstream's intents never get past "Sent"; here every intent goes Pending -> Applied or Failed (with a
reason), carries the number of tasks it governs and when its status last changed, and warnings for the
things users trip over: a pattern that matches nothing right now (check `comm`, not the command line),
an intent that does nothing, an intent for another node, an intent that loses to another one.

`StatusBoard` keeps the last status of every intent and turns each recomputation into change events for
WatchStatus streams; `last_changed` only moves when what a user sees (state, reason, count, warnings)
changes.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from gthulhu_node.intents.model import Intent, intent_key

NO_MATCH_WARNING = "matches no task right now: check the thread name (comm), not the command line"
NOOP_WARNING = "priority 0 and executionTime 0: this intent changes nothing"
MAP_FULL_WARNING = "the scheduler's map is full: raise scheduler.map_capacity"
NOT_FOR_THIS_NODE_REASON = "not for this node: its nodeNames/nodeSelectors do not select {node}"


class IntentState(enum.StrEnum):
    PENDING = "pending"
    APPLIED = "applied"
    FAILED = "failed"
    NOT_FOR_THIS_NODE = "not_for_this_node"


@dataclass(frozen=True, slots=True)
class IntentStatus:
    source: str
    intent: Intent
    state: IntentState
    reason: str = ""
    matched_tasks: int = 0
    last_changed: float = 0.0
    warnings: tuple[str, ...] = ()
    generation: int = 0

    @property
    def key(self) -> str:
        return intent_key(self.source, self.intent.id)

    def same_view(self, other: IntentStatus) -> bool:
        """Whether a user would see the same thing (everything but the time)."""
        return (
            self.intent == other.intent
            and self.state == other.state
            and self.reason == other.reason
            and self.matched_tasks == other.matched_tasks
            and self.warnings == other.warnings
            and self.generation == other.generation
        )


@dataclass(frozen=True, slots=True)
class SourceStatus:
    source: str
    generation: int
    intents: int
    updated: float
    errors: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class AgentSummary:
    node_name: str
    node_labels: Mapping[str, str]
    backend: str
    backend_reason: str
    scheduler_state: str
    scheduler_reason: str
    ready: bool
    matched_tasks: int
    version: str
    warnings: tuple[str, ...] = ()
    capabilities: str = ""  # what the agent gave up at start (privileges.Released.describe), or ""
    cgroup_cpu_max: str = ""  # cgroups with cpu.max limits and whether they hold (cgroup_limits.describe)


@dataclass(frozen=True, slots=True)
class StatusSnapshot:
    agent: AgentSummary
    sources: tuple[SourceStatus, ...]
    intents: tuple[IntentStatus, ...]


@dataclass(frozen=True, slots=True)
class MatchRow:
    """One task an intent governs now."""

    tid: int
    tgid: int
    comm: str
    intent: str  # source/id
    priority: int
    slice_ns: int
    scope: str
    overlaps: tuple[str, ...] = ()  # other intents it matches, beaten by `intent` (precedence)


@dataclass(frozen=True, slots=True)
class StatusEvent:
    """One WatchStatus message: exactly one field is set."""

    snapshot: StatusSnapshot | None = None
    changed: IntentStatus | None = None
    removed: str | None = None
    agent: AgentSummary | None = None


@dataclass(slots=True, eq=False)
class _Watcher:
    events: queue.Queue[StatusEvent | None] = field(default_factory=lambda: queue.Queue(maxsize=10_000))
    overflowed: bool = False


class StatusBoard:
    """The last published status of every intent, and the watchers that want to hear of changes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intents: dict[str, IntentStatus] = {}
        self._agent: AgentSummary | None = None
        self._watchers: list[_Watcher] = []

    def publish(self, statuses: Iterable[IntentStatus], agent: AgentSummary) -> list[StatusEvent]:
        """Replace the board with freshly computed statuses; returns (and broadcasts) the changes.

        A status whose view did not change keeps its `last_changed` time.
        """
        now = time.time()
        events: list[StatusEvent] = []
        with self._lock:
            fresh: dict[str, IntentStatus] = {}
            for st in statuses:
                old = self._intents.get(st.key)
                if old is not None and old.same_view(st):
                    fresh[st.key] = old
                    continue
                stamped = _with_time(st, now)
                fresh[st.key] = stamped
                events.append(StatusEvent(changed=stamped))
            events.extend(StatusEvent(removed=key) for key in self._intents if key not in fresh)
            self._intents = fresh
            if agent != self._agent:
                self._agent = agent
                events.append(StatusEvent(agent=agent))
            for watcher in self._watchers:
                for ev in events:
                    _offer(watcher, ev)
        return events

    def intents(self) -> list[IntentStatus]:
        with self._lock:
            return sorted(self._intents.values(), key=lambda s: s.key)

    def get(self, key: str) -> IntentStatus | None:
        with self._lock:
            return self._intents.get(key)

    def subscribe(self) -> Subscription:
        """Start receiving every change published from now on (take the snapshot after this call)."""
        sub = Subscription(self)
        with self._lock:
            self._watchers.append(sub._watcher)
        return sub

    def _unsubscribe(self, watcher: _Watcher) -> None:
        with self._lock:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def close(self) -> None:
        """End every watch stream (agent stopping)."""
        with self._lock:
            for watcher in self._watchers:
                _offer(watcher, None)

    def watcher_count(self) -> int:
        with self._lock:
            return len(self._watchers)


class Subscription:
    """One watcher's queue of change events. A watcher that falls 10,000 events behind is ended (its
    stream closes; the client reconnects and gets a fresh snapshot) rather than silently missing events."""

    def __init__(self, board: StatusBoard) -> None:
        self._board = board
        self._watcher = _Watcher()
        self.closed = False

    def get(self, timeout: float) -> StatusEvent | None:
        """The next event; None on timeout. Sets `closed` when the board ended the stream."""
        try:
            ev = self._watcher.events.get(timeout=timeout)
        except queue.Empty:
            return None
        if ev is None:
            self.closed = True
        return ev

    def close(self) -> None:
        self._board._unsubscribe(self._watcher)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _offer(watcher: _Watcher, ev: StatusEvent | None) -> None:
    if watcher.overflowed:
        return
    try:
        watcher.events.put_nowait(ev)
    except queue.Full:
        watcher.overflowed = True
        # make room for the end marker so the stream terminates instead of silently missing events
        try:
            while True:
                watcher.events.get_nowait()
        except queue.Empty:
            pass
        watcher.events.put_nowait(None)


def _with_time(st: IntentStatus, now: float) -> IntentStatus:
    return IntentStatus(
        st.source, st.intent, st.state, st.reason, st.matched_tasks, now, st.warnings, st.generation
    )
