"""The status feed: what the engine thread produces for every reader of status (issue 21, item 1).

Status used to be pulled: the status loop, every gRPC write's `sync`, every metrics scrape, the run-queue
sampler and the probe each asked the engine thread (`Engine.call`) to recompute per-intent figures and
task rows from scratch (8 ms of the engine thread per scrape at 1,000 intents). Now the engine thread is
the one producer: it keeps the per-intent counts up to date as tasks are matched and entries written
(`Reconciler.intent_figures`), and publishes an `EngineFrame` here after the turns that changed something
(at most every `Engine.publish_interval_s`, at once when someone waits for the reconciler to settle, and
every `Engine.refresh_s` for the backend's own counters). Readers on any thread take `latest()` or wait
for a newer version with `wait_newer`; none of them runs anything on the engine thread.

A frame is immutable: its mappings are read-only views of dicts built for it alone, its task rows are
frozen, and the `IntentStats` records it holds are never changed after publication (the producer builds
new records and rows for what changed and shares the others with the previous frame).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import structlog

from gthulhu_node.backends.base import BackendHealth
from gthulhu_node.reconciler import ReconcilerStats
from gthulhu_node.status_projection import IntentStats, Match
from gthulhu_node.workers import Latest

log = structlog.get_logger(__name__)


def _empty() -> Mapping[str, int]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class EngineFrame:
    """One published view of what the engine thread owns, consistent within itself (built in one go on
    the engine thread). `version` grows by one per publication; `produced_at` is monotonic seconds."""

    version: int = 0
    produced_at: float = 0.0
    settled: bool = False
    reconciler: ReconcilerStats = field(default_factory=ReconcilerStats)
    intents: Mapping[str, IntentStats] = field(default_factory=lambda: MappingProxyType({}))
    matches: Mapping[int, Match] = field(default_factory=lambda: MappingProxyType({}))  # by TID
    health: BackendHealth | None = None
    counters: Mapping[str, int] = field(default_factory=_empty)
    gauges: Mapping[str, int] = field(default_factory=_empty)


class StatusFeed:
    """The latest frame and the threads waiting for a newer one. Thread-safe; `publish` is the engine
    thread's alone."""

    def __init__(self) -> None:
        self._frame = Latest(EngineFrame())
        self._listeners_lock = threading.Lock()
        self._listeners: tuple[Callable[[EngineFrame], None], ...] = ()

    def latest(self) -> EngineFrame:
        """The last published frame (version 0, empty, before the engine's first publication)."""
        return self._frame.get()  # one reference read: a frame is replaced whole, never changed

    def publish(self, frame: EngineFrame) -> None:
        """Make `frame` the latest, wake the waiters and tell the listeners (on the publishing thread:
        a listener must only hand the news on, as setting an Event does)."""
        self._frame.set(frame)
        for listener in self._listeners:
            try:
                listener(frame)
            except Exception as exc:  # a reader's bug must not reach the engine thread
                log.exception("status_listener_failed", error=str(exc))

    def wait_newer(self, version: int, timeout: float) -> EngineFrame:
        """The latest frame once its version is above `version`, or when `timeout` seconds passed or the
        feed closed (then possibly not newer: compare `version`)."""
        return self._frame.wait_for(lambda frame: frame.version > version, timeout)

    def add_listener(self, listener: Callable[[EngineFrame], None]) -> None:
        """Call `listener(frame)` after every publication (the agent's status thread is woken this way)."""
        with self._listeners_lock:
            self._listeners = (*self._listeners, listener)

    def close(self) -> None:
        """The engine stopped: no frame will follow; waiters return at once."""
        self._frame.close()
