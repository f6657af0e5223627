"""The engine: the one thread that owns the reconciler (and therefore the only thread touching the backend).

Its loop waits (poll) on three things at once:
- the proc connector socket: every pending event is drained and applied in one batch, so a new or renamed
  thread is written to the backend in the same wakeup, with no batching timer;
- an eventfd for submitted work: other threads (gRPC, local files, metrics) call `submit(fn)` and get a
  Future; fn(reconciler) runs on the engine thread between event batches;
- timers: the periodic full rescan (`watch.rescan_interval_s`), the backend's health check (the
  supervised backend's `check`, gthulhu_node/backends/supervisor.py: an ejected scheduler is reloaded with
  exponential backoff or given up, then the reconciler writes every entry again; a running backend gets its
  `tick`, the upkeep the EEVDF backend once ran on a thread of its own), and registered periodic hooks
  (the service feeds the systemd watchdog from one, so a stuck engine stops the watchdog).

Lost events (ENOBUFS) or a socket error: a fresh socket and a full rescan at once.
`stop()` ends the thread and removes nothing: the Agent decides what happens to the backend.

The engine is the one producer of status (gthulhu_node/feed.py): after a loop turn that changed the
reconciler (`Reconciler.revision`) it publishes an `EngineFrame` on `feed`, at most every
`publish_interval_s`; at once when the reconciler settles with someone waiting (so `Agent.sync` and a
policy in effect read status that includes it); and every `refresh_s` in any case, the only publication
that reads the backend's own health, counters and gauges (the sched_ext backend's gauges run a BPF count
program: once a second, not at every change). Readers (status, gRPC, REST, metrics, the probe) read the
feed, never the engine.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

import structlog

from gthulhu_node.backends.base import Backend
from gthulhu_node.backends.supervisor import Checked, ReloadPolicy, SupervisorStats
from gthulhu_node.errors import Unavailable
from gthulhu_node.lifecycle import Health
from gthulhu_node.publication import FramePublisher
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.events import EventsUnavailable, ProcEventSource
from gthulhu_node.workers import Flag, Spawned, spawn

log = structlog.get_logger(__name__)

T = TypeVar("T")

# A loop turn's share of a long job (a rematch after a policy change, 1,000 writes after a reload): small
# against the 50 ms the engine may be away from events, the watchdog hook and its callers.
SLICE_S = 0.005
# Status is published at most this often while the reconciler keeps changing (events, a long write), and
# refreshed this often when nothing changed (the backend's counters move on their own).
PUBLISH_INTERVAL_S = 0.1
REFRESH_S = 1.0


class EngineStopped(Unavailable, RuntimeError):
    """Work was submitted to an engine that is not running (or stopped before running it)."""


@dataclass(slots=True)
class EngineStats:
    """The engine's own counters, and its supervised backend's (`backend`: state, ejections, reloads, give-up;
    one definition, the supervisor's, copied when read)."""

    events_available: bool = False
    events_reopens: int = 0
    loop_wakeups: int = 0
    submitted: int = 0
    hook_failures: int = 0  # its periodic hooks that raised (the backend's ticks: backend.tick_failures)
    backend: SupervisorStats = field(default_factory=SupervisorStats)


@dataclass(slots=True, eq=False)
class _Periodic:
    name: str
    interval_s: float
    fn: Callable[[], None]
    due: float


class Engine:
    """Runs the reconciler on its own thread. Thread-safe: submit/request_rescan/add_periodic/stop."""

    def __init__(
        self,
        reconciler: Reconciler,
        *,
        rescan_interval_s: float = 30.0,
        health_interval_s: float = 1.0,
        reload_backoff_initial_s: float = 1.0,
        reload_backoff_max_s: float = 60.0,
        ejection_limit: int = 3,
        ejection_window_s: float = 600.0,
        on_give_up: Callable[[str], Backend] | None = None,
        use_events: bool = True,
        events: ProcEventSource | None = None,
        slice_s: float = SLICE_S,
        publish_interval_s: float = PUBLISH_INTERVAL_S,
        refresh_s: float = REFRESH_S,
    ) -> None:
        """The reload settings go to the reconciler's supervised backend (SupervisedBackend.supervise), which
        reloads an ejected backend and gives it up: `on_give_up(reason)`, when given, returns a started
        replacement once the backend was ejected `ejection_limit` times within `ejection_window_s`
        (instead of the supervisor's own); without either it reloads forever.
        `slice_s`: how long one loop turn may spend on a rematch, and as long again on writes
        (`Reconciler.budget_s`), once the first scan is done."""
        self.reconciler = reconciler
        self.slice_s = slice_s
        self.rescan_interval_s = rescan_interval_s
        self.health_interval_s = health_interval_s
        self.reload_backoff_initial_s = reload_backoff_initial_s
        self.reload_backoff_max_s = reload_backoff_max_s
        self.ejection_limit = ejection_limit
        self.ejection_window_s = ejection_window_s
        self._on_give_up = on_give_up
        self._work: collections.deque[tuple[Callable[[Reconciler], Any], concurrent.futures.Future[Any]]] = (
            collections.deque()
        )
        self._periodic: list[_Periodic] = []
        self._wake_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._thread: Spawned | None = None
        self._stopping = Flag()
        self._ready = Flag()
        self._start_error: BaseException | None = None
        self._rescan_requested = False
        self._lock = threading.Lock()
        self._stats = EngineStats()
        source = events if events is not None else ProcEventSource()
        self._events = _EventPort(source, use_events, self._stats)
        self._frames = FramePublisher(reconciler, publish_interval_s, refresh_s)
        self.feed = self._frames.feed

    # ---- lifecycle ----------------------------------------------------------------------------------

    def start(self, timeout: float = 60.0) -> None:
        """Start the thread; returns once events are subscribed and the first full scan was applied.

        The backend must already be started (by the Agent) before this is called.
        """
        if self._thread is not None:
            raise RuntimeError("engine already started")
        self._thread = spawn("gthulhu-engine", self._run)
        if not self._ready.wait(timeout):
            raise TimeoutError("engine did not finish its first scan in time")
        if self._start_error is not None:
            raise self._start_error

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread. Pending submitted work fails with EngineStopped. Removes no entry."""
        self._stopping.set()
        self._wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_pending()

    def add_latency_listener(self, listener: Callable[[float], None]) -> None:
        """Call `listener(seconds)` for every event-caused write (Reconciler.add_latency_listener)."""
        self.reconciler.add_latency_listener(listener)

    name = "engine"  # a lifecycle Component (gthulhu_node/lifecycle.py)

    def health(self) -> Health:
        if self.running:
            return Health(True)
        return Health(False, "stopped" if self._stopping.is_set() else "not running")

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            os.close(self._wake_fd)

    # ---- thread-safe entry points -------------------------------------------------------------------

    def submit(self, fn: Callable[[Reconciler], T]) -> concurrent.futures.Future[T]:
        """Run fn(reconciler) on the engine thread; its result (or exception) lands in the Future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._stopping.is_set() or (self._thread is not None and not self._thread.is_alive()):
            fut.set_exception(EngineStopped("engine is stopped"))
            return fut
        self._work.append((fn, fut))
        self._wake()
        return fut

    def call(self, fn: Callable[[Reconciler], T], timeout: float | None = 30.0) -> T:
        """submit(fn) and wait for its result."""
        return self.submit(fn).result(timeout)

    def when_settled(self) -> concurrent.futures.Future[None]:
        """A Future done once everything submitted before is in effect: any rematch finished and every
        entry written or refused (`Reconciler.settled`)."""
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()

        def done() -> None:
            if not fut.done():
                fut.set_result(None)

        def not_queued(queued: concurrent.futures.Future[None]) -> None:
            error = queued.exception()
            if error is not None and not fut.done():  # the engine stopped first
                fut.set_exception(error)

        self.submit(lambda r: r.when_settled(done)).add_done_callback(not_queued)
        return fut

    def request_rescan(self) -> None:
        with self._lock:
            self._rescan_requested = True
        self._wake()

    def add_periodic(self, name: str, interval_s: float, fn: Callable[[], None]) -> None:
        """Call fn() on the engine thread every interval_s (first call one interval from now)."""
        with self._lock:
            self._periodic.append(_Periodic(name, interval_s, fn, time.monotonic() + interval_s))
        self._wake()

    def stats(self) -> EngineStats:
        s = self._stats
        own = {f.name: getattr(s, f.name) for f in fields(EngineStats) if f.name != "backend"}
        return EngineStats(**own, backend=self.reconciler.backend.stats.copy())

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.eventfd_write(self._wake_fd, 1)

    # ---- the loop -----------------------------------------------------------------------------------

    def _rescan(self, reason: str) -> None:
        r = self.reconciler
        try:
            r.rescan()
        except Exception as exc:  # a scan must never kill the engine
            log.exception("rescan_failed", reason=reason, error=str(exc))
        else:
            st = r.stats()
            log.debug("rescan_done", reason=reason, tasks=st.tasks, seconds=st.scan_duration_last_s)

    def _run(self) -> None:
        try:
            self._events.open()
            self._rescan("start")  # whole, before start() returns; later work goes in slices
            self.reconciler.budget_s = self.slice_s
            self._supervise()
            self.reconciler.before_settled = self._frames.publish_changed
            self._frames.publish(read_backend=True)  # status is there before start() returns
        except BaseException as exc:
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except Exception as exc:
            log.exception("engine_crashed", error=str(exc))
            raise
        finally:
            self.reconciler.backend.end()  # whoever stops the backend next must not meet a reload
            self._events.close()
            self._fail_pending()
            self.feed.close()

    def _loop(self) -> None:
        poller = select.poll()
        poller.register(self._wake_fd, select.POLLIN)
        events = self._events
        events.register(poller)
        now = time.monotonic()
        next_rescan = now + self.rescan_interval_s
        next_health = now + self.health_interval_s
        r = self.reconciler
        while not self._stopping.is_set():
            now = time.monotonic()
            with self._lock:
                periodic = list(self._periodic)
            due = min([next_rescan, next_health, r.next_retry_at(), self._frames.due(),
                       *(p.due for p in periodic)])
            timeout_ms = 0 if not r.settled else max(0, int((due - now) * 1000) + 1)
            ready = poller.poll(timeout_ms)
            self._stats.loop_wakeups += 1
            for fd, _mask in ready:
                if fd == events.fd:
                    batch = events.source.read_pending()
                    try:
                        r.handle_events(batch.events)
                    except Exception as exc:
                        log.exception("event_handling_failed", error=str(exc))
                    if batch.lost or batch.error:
                        if batch.lost:
                            r.note_events_lost()
                            log.warning("proc_events_lost", events_in_batch=len(batch.events))
                        else:
                            r.note_event_read_error()
                            log.warning("proc_events_error", error=batch.error)
                        events.open()
                        events.register(poller)
                        self._rescan("events_lost" if batch.lost else "events_error")
                        next_rescan = time.monotonic() + self.rescan_interval_s
                elif fd == self._wake_fd:
                    with contextlib.suppress(BlockingIOError):
                        os.eventfd_read(self._wake_fd)
            # A turn that publishes status during a long job does not also take a slice of it: the
            # publication (a few ms at 1,000 intents and tasks after a rematch) gets a turn of its own
            # instead of lengthening one that already spent its slices.
            self._run_work(step=not self._frames.publishes_mid_job(time.monotonic()))
            with self._lock:
                rescan_now, self._rescan_requested = self._rescan_requested, False
            now = time.monotonic()
            if rescan_now or now >= next_rescan:
                if events.use and not events.source.is_open and events.open():
                    events.register(poller)
                self._rescan("requested" if rescan_now else "periodic")
                next_rescan = time.monotonic() + self.rescan_interval_s
            reloaded = r.backend.reload_finished
            if now >= next_health or reloaded:
                self._check_backend(now)
                if now >= next_health:
                    next_health = now + self.health_interval_s
            for p in periodic:
                if now >= p.due:
                    p.due = now + p.interval_s
                    try:
                        p.fn()
                    except Exception as exc:
                        self._stats.hook_failures += 1
                        log.exception("periodic_hook_failed", hook=p.name, error=str(exc))
            self._frames.publish_if_due(time.monotonic())

    def _run_work(self, step: bool = True) -> None:
        work = self._work
        r = self.reconciler
        while work:
            fn, fut = work.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            self._stats.submitted += 1
            try:
                result = fn(r)
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(result)
        if step:
            r.step()

    def _fail_pending(self) -> None:
        while self._work:
            _fn, fut = self._work.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineStopped("engine stopped before running this"))

    def _supervise(self) -> None:
        """Hand the reload settings to the backend's supervisor, which owns every change of backend."""
        on_give_up = self._on_give_up
        backend = self.reconciler.backend

        def replace(why: str) -> tuple[Backend, str]:
            assert on_give_up is not None
            return on_give_up(why), backend.reason

        policy = ReloadPolicy(self.reload_backoff_initial_s, self.reload_backoff_max_s, self.ejection_limit,
                              self.ejection_window_s)
        backend.supervise(policy, self._wake, replace if on_give_up is not None else None)

    def _check_backend(self, now: float) -> None:
        """Health check (SupervisedBackend.check): an ejected backend is reloaded with exponential backoff
        or given up, then every entry is written again; status is read from it again at once."""
        r = self.reconciler
        checked = r.backend.check(now)
        if checked is not Checked.NOTHING:
            self._frames.refresh_soon()
        r.backend_changed(checked)


class _EventPort:
    """The proc connector as the engine's loop polls it: opened, reopened after a loss (counted in the
    engine's stats), and registered with the loop's poll under its current descriptor."""

    def __init__(self, source: ProcEventSource, use: bool, stats: EngineStats) -> None:
        self.source = source
        self.use = use
        self.stats = stats  # the engine's
        self.fd = -1

    def open(self) -> bool:
        if not self.use:
            return False
        source, stats = self.source, self.stats
        try:
            if source.is_open:
                source.reopen()
                stats.events_reopens += 1
            else:
                source.open()
        except EventsUnavailable as exc:
            if stats.events_available or not source.is_open:
                log.error("proc_events_unavailable", error=str(exc))
            stats.events_available = False
            return False
        stats.events_available = True
        return True

    def register(self, poller: select.poll) -> None:
        if self.fd >= 0:
            with contextlib.suppress(KeyError):
                poller.unregister(self.fd)
            self.fd = -1
        if self.source.is_open:
            self.fd = self.source.fileno()
            poller.register(self.fd, select.POLLIN | select.POLLERR)

    def close(self) -> None:
        self.source.close()
