"""One way to run a long-lived thread: a worker's blocking `run(stop)` on a named thread, and one
coalescing work queue for the loops that wake on changes or on a period.

Why: the agent's loops (the policy builder, the status thread, the policy-file poller, the cgroup-limits
rescan, the probes) each had their own Event, flags, counters and join, written slightly differently, and
three different threads were all called `gthulhu-probe`. Here a thread is started one way
(`WorkerThread`, a lifecycle component: started in the supervisor's order, stopped in reverse through its
one stop `Flag`; `spawn` for a thread that is not a part) and named for what it does, and
a loop's wake-ups go through a `WorkQueue`: any number of wakes between two turns of work make one turn, a
minimum gap between turns that an urgent wake cuts short, a period when nothing wakes it, and a hand-off a
caller can wait for ("every change I made is handled").

This module is the only one of the package that touches `threading.Thread`, `Event` or `Condition`
(tests/unit/test_workers_structure.py). Imports nothing of ours but the lifecycle's `Health` (layer 1).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import structlog

from gthulhu_node.lifecycle import Health

log = structlog.get_logger(__name__)


class Flag:
    """A flag threads wait on: the stop signal of a worker, a part's "ready", a signal handler's request.
    Callbacks added with `on_set` run (on the setting thread) each time it is set, so a `WorkQueue` waiting
    in its own condition wakes on a stop too."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._callbacks: list[Callable[[], None]] = []

    def set(self) -> None:
        self._event.set()
        for callback in list(self._callbacks):
            callback()

    def clear(self) -> None:
        self._event.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when `timeout` passed first."""
        return self._event.wait(timeout)

    def on_set(self, callback: Callable[[], None]) -> None:
        self._callbacks.append(callback)


Spawned = threading.Thread  # what `spawn` returns: join it, ask is_alive; start threads only here

T = TypeVar("T")


class Latest(Generic[T]):
    """A value replaced whole by one thread and read by any, with waits for a value that satisfies a
    condition (a newer frame): the engine's status feed. `close` ends every wait at once."""

    def __init__(self, value: T) -> None:
        self._cond = threading.Condition()
        self._value = value
        self._closed = False

    def get(self) -> T:
        return self._value  # one reference read: the value is replaced, never changed

    def set(self, value: T) -> None:
        with self._cond:
            self._value = value
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait_for(self, ready: Callable[[T], bool], timeout: float) -> T:
        """The value once `ready(value)`, or when `timeout` seconds passed or `close` was called (then
        possibly not ready: the caller checks)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not ready(self._value) and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return self._value


def spawn(name: str, target: Callable[[], None]) -> Spawned:
    """A daemon thread named `name` (what it does: the agent's threads have unique names, docs/design.md
    "Threads"), started; for a run that is not a long-lived part (one measurement, a start in the
    background, a reload beside the engine)."""
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def current_thread_name() -> str:
    return threading.current_thread().name


def run_in_thread(name: str, target: Callable[[], None]) -> None:
    """`target` on a thread of its own named `name`, waited for: what a thread's own settings (its nice,
    its scheduling attributes) are tried on, so the caller's stay untouched."""
    spawn(name, target).join()


class WorkerThread:
    """A worker on its own thread, as a lifecycle component: `start` starts the thread (named `name`,
    which says what it does) running `run(stop)`, which blocks until `stop` is set (or its work is over);
    `stop` sets that one signal and waits for `run` to return."""

    def __init__(self, name: str, run: Callable[[Flag], None], *,
                 join_timeout_s: float | None = 30.0) -> None:
        self.name = name
        self._run = run
        self._join_timeout_s = join_timeout_s
        self._stop = Flag()
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop = Flag()
        stop = self._stop

        def body() -> None:
            try:
                self._run(stop)
            except Exception:
                log.exception("worker_failed", worker=self.name)

        self._thread = spawn(self.name, body)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._join_timeout_s)
            if thread.is_alive():
                log.error("worker_stop_timeout", worker=self.name, timeout_s=self._join_timeout_s)

    def health(self) -> Health:
        return Health(True) if self.running else Health(False, "not running")


class WorkQueue:
    """Wake-ups coalesced into turns of work, served by one thread (`serve`).

    `wake()` asks for a turn; wakes that come before the turn starts are that one turn, wakes during a turn
    one more. A turn waits until `min_gap_s` after the last one (`last` says when that was, when others
    than the server also do the work), unless a wake is `urgent`. With `period_s`, a turn also comes when
    nothing woke the queue for that long. `wait_handled` waits until every wake before it has had its turn
    (or the queue is not served: nobody would ever answer). A turn that raises is tried again on its own
    after `backoff_s` (doubling up to `max_backoff_s`, back to the start after a turn that did not raise)."""

    def __init__(self, *, period_s: float | None = None, min_gap_s: float = 0.0,
                 last: Callable[[], float] | None = None, backoff_s: float = 0.1,
                 max_backoff_s: float = 30.0) -> None:
        self.period_s = period_s
        self.min_gap_s = min_gap_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._backoff = backoff_s
        self._retry_at: float | None = None  # after a turn that raised
        self._last_turn = 0.0
        self._last = last or (lambda: self._last_turn)
        self._cond = threading.Condition()
        self._woken = 0  # wakes asked for
        self._handled = 0  # wakes whose turn has ended
        self._urgent = False
        self._serving = False

    def wake(self, urgent: bool = False) -> None:
        with self._cond:
            self._woken += 1
            self._urgent = self._urgent or urgent
            self._cond.notify_all()

    def open(self) -> None:
        """Say a server is coming (before its thread starts): `wait_handled` waits for it from now on."""
        with self._cond:
            self._serving = True

    def _close(self) -> None:
        with self._cond:
            self._serving = False
            self._cond.notify_all()

    def wait_handled(self, timeout: float | None) -> bool:
        """True once every wake before this call has had its turn, or nobody serves the queue."""
        with self._cond:
            target = self._woken
            return self._cond.wait_for(lambda: self._handled >= target or not self._serving, timeout)

    def serve(self, stop: Flag, turn: Callable[[], None]) -> None:
        """Run `turn` for each coalesced wake (and each period) until `stop` is set. A turn that raises is
        logged and the queue goes on: tried again after the backoff, or sooner by a wake."""
        stop.on_set(self._close)
        self.open()
        try:
            while True:
                seen = self._next(stop)
                if seen is None:
                    return
                self._last_turn = time.monotonic()
                try:
                    turn()
                except Exception:
                    log.exception("work_turn_failed", thread=current_thread_name(), retry_in_s=self._backoff)
                    self._retry_at = time.monotonic() + self._backoff
                    self._backoff = min(self._backoff * 2, self.max_backoff_s)
                else:
                    self._retry_at, self._backoff = None, self.backoff_s
                with self._cond:
                    self._handled = max(self._handled, seen)
                    self._cond.notify_all()
        finally:
            self._close()

    def _next(self, stop: Flag) -> int | None:
        """Wait for the next turn; the wakes it covers, or None on stop."""
        with self._cond:
            deadline = None if self.period_s is None else time.monotonic() + self.period_s
            if self._retry_at is not None:
                deadline = self._retry_at if deadline is None else min(deadline, self._retry_at)
            while not stop.is_set() and self._handled >= self._woken:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._cond.wait(left)
            # a turn's wakes wait out the gap since the last one; an urgent wake ends the wait
            while not stop.is_set() and not self._urgent:
                early = self._last() + self.min_gap_s - time.monotonic()
                if early <= 0:
                    break
                self._cond.wait(early)
            if stop.is_set():
                return None
            self._urgent = False
            return self._woken
