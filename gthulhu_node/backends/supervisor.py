"""The one backend the writer holds for life: the backend actually running, supervised.

Every change of backend happens here and nowhere else (tests/unit/test_backend_owner.py): the first
selection at start (with the fall-back of `backend: auto` when the kernel refuses our scheduler), the
reload of an ejected backend on a thread of its own, the hand-over to a replacement once the kernel ejected
it too often (give-up), and holding writes while it is down. Before this part existed the Agent reassigned
its backend, the Engine swapped the reconciler's for a stand-in during a reload and back, flipped the
reconciler's hold on writes, and rebuilt its entries after a swap: three owners of one object, and reading
it from another thread rested on comments.

Threads: the engine thread calls `check`, `apply`, `read_back`, `health`, `counters`, `gauges`, `tick`; a
reload runs `stop` and `start` of the running backend on the `gthulhu-backend-reload` thread, during which
the engine thread's calls answer as the stand-in would (ejected, with the kernel's reason; nothing
written, nothing read) and never reach the backend being reloaded. Other threads read only `name`,
`reason`, `capacity`, `enforces_cpu_max`, `cpu_max_source` and the stats: one attribute read each.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields

import structlog

from gthulhu_node.backends.base import (
    ApplyResult,
    Backend,
    BackendError,
    BackendHealth,
    BackendState,
    Entry,
    EntryKey,
    SchedulerRefused,
)
from gthulhu_node.workers import Spawned, spawn

log = structlog.get_logger(__name__)

Choice = tuple[Backend, str]  # a backend not yet started, and why it was chosen (status)


class Checked(enum.Enum):
    """What a health check changed, for the writer and the engine's status publication."""

    NOTHING = "nothing"
    DOWN = "down"  # ejected, or a reload began: writes are held, status reads the stand-in's answers
    RELOADED = "reloaded"  # the same backend runs again: every entry is written again
    REPLACED = "replaced"  # another backend took over: every entry is written again
    REPLACED_OTHER_SCOPE = "replaced_other_scope"  # ... and it covers processes differently: rematch


@dataclass(frozen=True, slots=True)
class ReloadPolicy:
    """How an ejected backend is reloaded, and when it is given up instead (the configuration's
    `backend.reload_backoff_*` and `scheduler.ejection_*`)."""

    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    ejection_limit: int = 3
    ejection_window_s: float = 600.0


@dataclass(slots=True)
class SupervisorStats:
    state: str = ""
    ejections: int = 0
    reloads: int = 0
    reload_failures: int = 0
    last_ejection_reason: str = ""
    tick_failures: int = 0
    gave_up_reason: str = ""  # why the supervisor stopped reloading the backend and replaced it, else ""

    def copy(self) -> SupervisorStats:
        return SupervisorStats(**{f.name: getattr(self, f.name) for f in fields(self)})


class SupervisedBackend(Backend):
    """A Backend whose running backend the supervisor alone picks, reloads and replaces."""

    def __init__(
        self,
        backend: Backend | None = None,
        *,
        reason: str = "",
        select: Callable[[], Choice] | None = None,
        fall_back: Callable[[str], Choice] | None = None,
        replace: Callable[[str], Choice] | None = None,
    ) -> None:
        """`backend`: the one to run (tests, tools), else `select()` picks it at `start`.
        `fall_back(refusal)`: the next best when the kernel refuses the selected one (`backend: auto`);
        without it the refusal is raised. `replace(why)`: a started replacement for a backend ejected too
        often; without it an ejected backend is reloaded forever."""
        self._backend = backend
        self.reason = reason
        self._select = select
        self._fall_back = fall_back
        self.refused = ""  # why the kernel refused our scheduler when it fell back, else ""
        self.given_up = ""  # why an ejected scheduler was given up, else ""
        self._policy = ReloadPolicy()
        self._replace = replace
        self._wake: Callable[[], None] = lambda: None
        self._ejection_times: collections.deque[float] = collections.deque()
        self._held = False  # ejected or held by hand: nothing is written until released
        self._ejected = False
        self._standing_in = ""  # while a reload is under way or failed: the ejection's reason
        self._reloading: Spawned | None = None
        self._reload_outcome: list[BaseException | None] = []
        self._backoff_s = self._policy.backoff_initial_s
        self._next_reload = 0.0
        self.stats = SupervisorStats()

    # ---- what runs ----------------------------------------------------------------------------------

    @property
    def current(self) -> Backend | None:
        """The backend running (or being reloaded) now; None before `start` selected one."""
        return self._backend

    def _running(self) -> Backend:
        if self._backend is None:
            raise BackendError("no backend selected yet")
        return self._backend

    @property
    def name(self) -> str:  # type: ignore[override]
        return self._backend.name if self._backend is not None else ""

    @property
    def process_fallback(self) -> bool:  # type: ignore[override]
        return self._backend.process_fallback if self._backend is not None else True

    @property
    def capacity(self) -> int | None:
        return self._backend.capacity if self._backend is not None else None

    @property
    def enforces_cpu_max(self) -> bool:
        return self._backend.enforces_cpu_max if self._backend is not None else True

    @property
    def cpu_max_source(self) -> str:
        return self._backend.cpu_max_source if self._backend is not None else ""

    def start(self) -> None:
        """Select the backend (unless given) and start it; `backend: auto` on a kernel that refused our
        scheduler runs the next best instead of dying (systemd would only restart us into the same
        refusal), and says so everywhere."""
        chosen = self._backend is None
        if self._backend is None:
            if self._select is None:
                raise BackendError("no backend to start")
            self._backend, self.reason = self._select()
        log.info("backend_selected", backend=self._backend.name, reason=self.reason)
        try:
            self._backend.start()
        except SchedulerRefused as refusal:
            if not chosen or self._fall_back is None:
                raise
            log.error("sched_ext_refused", error=str(refusal), libbpf=list(refusal.details),
                      action="falling back (backend.kind auto); set backend.kind: sched_ext to fail instead")
            self.refused = str(refusal)
            self._backend, self.reason = self._fall_back(str(refusal))
            log.warning("backend_selected", backend=self._backend.name, reason=self.reason, fallback=True)
            self._backend.start()

    def stop(self) -> None:
        if self._backend is not None:
            self._backend.stop()

    # ---- the engine thread's calls --------------------------------------------------------------------

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        if self._standing_in:
            raise BackendError(f"the {self.name} backend is being reloaded")
        return self._running().apply(upserts, deletes)

    def read_back(self) -> dict[EntryKey, Entry]:
        return {} if self._standing_in else self._running().read_back()

    def read_keys(self, keys: Iterable[EntryKey]) -> dict[EntryKey, Entry]:
        return {} if self._standing_in else self._running().read_keys(keys)

    def task_stats(self, threads: Iterable[tuple[int, int, int]]) -> dict[int, dict[str, int] | str]:
        if self._standing_in:
            return {t[0]: f"not available: {self._standing_in}" for t in threads}
        return self._running().task_stats(threads)

    @property
    def boosted_tgid(self) -> int:
        return 0 if self._standing_in or self._backend is None else self._backend.boosted_tgid

    def health(self) -> BackendHealth:
        if self._standing_in:
            return BackendHealth(BackendState.EJECTED, self._standing_in)
        return self._running().health()

    def tick(self, now: float) -> None:
        self._running().tick(now)

    def counters(self) -> dict[str, int]:
        return {} if self._standing_in else self._running().counters()

    def gauges(self) -> dict[str, int]:
        return {} if self._standing_in else self._running().gauges()

    @property
    def reloading(self) -> bool:
        """A reload is under way or failed: the engine thread's calls answer as a stand-in."""
        return bool(self._standing_in)

    @property
    def held(self) -> bool:
        """Nothing is written (the writer keeps its changes) while the backend is down or held."""
        return self._held

    def hold(self) -> None:
        self._held = True

    def release(self) -> None:
        self._held = False

    # ---- supervision --------------------------------------------------------------------------------

    def supervise(self, policy: ReloadPolicy, wake: Callable[[], None],
                  replace: Callable[[str], Choice] | None = None) -> None:
        """Called by the engine thread before its loop: how to reload, how to wake the engine once a
        reload thread is done, and (when given) whom to hand over to instead of the constructor's."""
        self._policy = policy
        self._backoff_s = policy.backoff_initial_s
        self._wake = wake
        if replace is not None:
            self._replace = replace
        self.stats.state = self.health().state.value

    @property
    def reload_finished(self) -> bool:
        """A reload thread has ended: the next `check` takes its outcome."""
        return self._reloading is not None and not self._reloading.is_alive()

    def check(self, now: float) -> Checked:
        """The engine's health check: tick a running backend, notice an ejection, reload with exponential
        backoff, or give it up once ejected `ejection_limit` times within `ejection_window_s`."""
        if self._reloading is not None:
            return self._finish_reload(now) if not self._reloading.is_alive() else Checked.NOTHING
        backend = self._running()
        down = False
        if not self._ejected:
            try:
                health = backend.health()
            except Exception as exc:  # a broken health check must not end the engine
                log.exception("backend_health_failed", backend=backend.name, error=str(exc))
                return Checked.NOTHING
            self.stats.state = health.state.value
            if health.state is BackendState.RUNNING:
                try:
                    backend.tick(now)
                except Exception as exc:  # the backend's upkeep must not end the engine either
                    self.stats.tick_failures += 1
                    log.exception("backend_tick_failed", backend=backend.name, error=str(exc))
            if health.state is not BackendState.EJECTED:
                return Checked.NOTHING
            self._ejected = self._held = down = True
            self.stats.ejections += 1
            self.stats.last_ejection_reason = health.reason
            self._backoff_s = self._policy.backoff_initial_s
            self._next_reload = now
            log.error("scheduler_ejected", backend=backend.name, reason=health.reason)
            if self._too_many_ejections(now):
                return self._give_up(backend, health.reason)
        if now < self._next_reload:
            return Checked.DOWN if down else Checked.NOTHING
        self._begin_reload(backend)
        return Checked.DOWN

    def end(self) -> None:
        """The engine stops: wait for a reload under way (whoever stops the backend next must not meet
        it) and drop the stand-in."""
        if self._reloading is not None:
            self._reloading.join()
        self._reloading = None
        self._standing_in = ""

    def _begin_reload(self, backend: Backend) -> None:
        """Stop and start the backend on a thread of its own: loading a scheduler takes seconds, which the
        engine thread (events, submitted work, the watchdog hook) must not wait for. Meanwhile the engine
        thread's calls answer as a stand-in, so nothing on it reaches the backend being reloaded: the
        reload thread is its only user until `_finish_reload`. The stand-in stays through failed reloads:
        the backend they stopped would report itself stopped, and metrics and alerts must keep saying
        ejected, with the kernel's reason, until it is back."""
        outcome: list[BaseException | None] = []

        def reload() -> None:
            try:
                try:
                    backend.stop()
                except BackendError as exc:
                    log.warning("backend_stop_failed", backend=backend.name, error=str(exc))
                backend.start()
            except Exception as exc:
                outcome.append(exc)
            else:
                outcome.append(None)
            self._wake()

        self._standing_in = self.stats.last_ejection_reason or "being reloaded"
        self._reload_outcome = outcome
        self._reloading = spawn("gthulhu-backend-reload", reload)

    def _finish_reload(self, now: float) -> Checked:
        self._reloading = None
        backend = self._running()
        error = self._reload_outcome[0] if self._reload_outcome else RuntimeError("the reload thread ended")
        if error is not None:
            self.stats.reload_failures += 1
            self._next_reload = now + self._backoff_s
            log.error("backend_reload_failed", backend=backend.name, error=str(error),
                      retry_in_s=self._backoff_s)
            self._backoff_s = min(self._backoff_s * 2, self._policy.backoff_max_s)
            return Checked.NOTHING
        self._standing_in = ""
        self._ejected = self._held = False
        self.stats.reloads += 1
        self.stats.state = backend.health().state.value
        log.info("backend_reloaded", backend=backend.name)
        return Checked.RELOADED

    def _too_many_ejections(self, now: float) -> bool:
        """Count this ejection; True once `ejection_limit` fell within the last `ejection_window_s`."""
        times, policy = self._ejection_times, self._policy
        times.append(now)
        while times and now - times[0] > policy.ejection_window_s:
            times.popleft()
        return self._replace is not None and len(times) >= policy.ejection_limit

    def _give_up(self, backend: Backend, reason: str) -> Checked:
        """A scheduler the kernel keeps ejecting is not reloaded again (each reload leaves the policies
        unapplied for a while, and each ejection is a kernel error): the replacement takes over, every
        entry is written to it, and it stays until the agent restarts."""
        policy = self._policy
        why = (f"{len(self._ejection_times)} ejections within {policy.ejection_window_s:g} s "
               f"(scheduler.ejection_limit {policy.ejection_limit}); the last: {reason}")
        assert self._replace is not None
        try:
            backend.stop()
        except BackendError as exc:
            log.warning("backend_stop_failed", backend=backend.name, error=str(exc))
        self.given_up = why
        try:
            replacement, reason = self._replace(why)
        except Exception as exc:
            # Nothing to run instead: keep reloading what we had, as without a limit.
            log.error("backend_replacement_failed", backend=backend.name, error=str(exc))
            self._replace = None
            return Checked.DOWN
        self._backend, self.reason = replacement, reason
        log.warning("backend_selected", backend=replacement.name, reason=reason, fallback=True)
        self._ejected = self._held = False
        self._ejection_times.clear()
        self.stats.gave_up_reason = why
        self.stats.state = replacement.health().state.value
        log.error("backend_given_up", backend=backend.name, replacement=replacement.name, reason=why,
                  action="systemctl restart gthulhu-node tries the scheduler again")
        if replacement.process_fallback != backend.process_fallback:
            return Checked.REPLACED_OTHER_SCOPE
        return Checked.REPLACED
