"""The engine's status publication: an immutable `EngineFrame` on a `StatusFeed` (gthulhu_node/feed.py),
built from the reconciler's produced figures on the engine thread, when the reconciler changed
(`Reconciler.revision`) at most every `publish_interval_s`, at once before its settled callbacks, and
every `refresh_s` in any case: the only publication that reads the backend's own health, counters and
gauges (the sched_ext backend's gauges run a BPF count program: once a second, not at every change), and
at once after the supervisor's health check changed the backend (`refresh_soon`).
"""

from __future__ import annotations

import time
from types import MappingProxyType

import structlog

from gthulhu_node.feed import EngineFrame, StatusFeed
from gthulhu_node.reconciler import Reconciler

log = structlog.get_logger(__name__)


class FramePublisher:
    """When to publish and what. Not thread-safe: the engine thread calls it; readers read the feed."""

    def __init__(self, reconciler: Reconciler, publish_interval_s: float, refresh_s: float) -> None:
        self._reconciler = reconciler
        self.feed = StatusFeed()
        self.publish_interval_s = publish_interval_s
        self.refresh_s = refresh_s
        self._published_revision = -1
        self._next_publish = 0.0  # no publication for a change before this (monotonic)
        self._refresh_due = 0.0  # a publication at this time even without a change

    def _changed(self) -> bool:
        return self._reconciler.revision != self._published_revision

    def due(self) -> float:
        """When the next publication is due (monotonic): the engine's poll wakes up then."""
        return self._next_publish if self._changed() else self._refresh_due

    def publishes_mid_job(self, now: float) -> bool:
        """A turn that publishes status during a long job does not also take a slice of it: the
        publication (a few ms at 1,000 intents and tasks after a rematch) gets a turn of its own instead
        of lengthening one that already spent its slices."""
        return not self._reconciler.settled and self._changed() and now >= self._next_publish

    def publish_if_due(self, now: float) -> None:
        if now >= self._refresh_due:
            self.publish(read_backend=True)
        elif self._changed() and now >= self._next_publish:
            self.publish()

    def refresh_soon(self) -> None:
        """The backend changed (ejected, reloading, back, replaced): its own figures at the next turn."""
        self._refresh_due = 0.0

    def publish_changed(self) -> None:
        """Before the reconciler's settled callbacks: publish what they wait for, unless published."""
        if self._reconciler.revision != self._published_revision:
            self.publish()

    def publish(self, read_backend: bool = False) -> None:
        """Build the frame from the reconciler's produced figures and publish it; with `read_backend`,
        the backend's health, counters and gauges are read again, else the last frame's stand. A backend
        whose figures cannot be read costs those figures only (as a metrics scrape did)."""
        r = self._reconciler
        last = self.feed.latest()
        health, counters, gauges = last.health, last.counters, last.gauges
        if read_backend:
            backend = r.backend
            try:
                health = backend.health()
                counters = MappingProxyType(dict(backend.counters()))
                gauges = MappingProxyType(dict(backend.gauges()))
            except Exception as exc:
                log.warning("backend_figures_unreadable", backend=backend.name, error=str(exc))
                health, counters, gauges = None, MappingProxyType({}), MappingProxyType({})
        now = time.monotonic()
        try:
            frame = EngineFrame(
                version=last.version + 1,
                produced_at=now,
                settled=r.settled,
                reconciler=r.stats(),
                intents=r.intent_figures(),
                matches=r.task_rows(),
                health=health,
                counters=counters,
                gauges=gauges,
            )
        except Exception as exc:  # a bug here must cost status, not the engine
            log.exception("status_publish_failed", error=str(exc))
            return
        finally:
            self._published_revision = r.revision
            self._next_publish = now + self.publish_interval_s
            if read_backend:
                self._refresh_due = now + self.refresh_s
        self.feed.publish(frame)
