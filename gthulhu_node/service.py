"""The process lifecycle of `gthulhu-node run`: logging, metrics, the agent, systemd notifications, signals.

Order, and why:
1. logging first, so even a failed start is in the journal with fields;
   then, while the process has its only thread, privileges are released (gthulhu_node/privileges.py:
   a stale scheduler taken over, CAP_SYS_ADMIN dropped): capabilities are per thread, so only a drop
   made before the first other thread starts covers every thread;
2.-3. one Supervisor (gthulhu_node/lifecycle.py) starts the parts of `_components` in order: the metrics
   endpoint, so a start that hangs can be looked at; the agent's parts (scheduler loaded, saved intents
   applied, API open); the probe. Then READY=1: systemd reports the unit active, and `systemctl start`
   returns, only when the node is really scheduled as its intents say;
   Then the start-up heap is frozen (`gc.freeze`): modules, schemas, the loaded policy and the task
   table leave the collector's generations, so a full collection, which runs on whichever thread
   allocates and holds the GIL, walks only what came after (12-18 ms at 76,000 objects on a quiet host
   and 70-100 ms under load before, under 1 ms after: docs/benchmarks.md, "Engine thread blocking");
4. the main loop: signals (SIGTERM/SIGINT stop, SIGHUP reloads the local policy files), STATUS= refreshed
   with the agent's one-line summary, log-suppression summaries flushed;
5. stop: STOPPING=1, the supervisor stops every part in reverse (the scheduler is unloaded: sched_ext back
   to `disabled`).

The systemd watchdog is fed from the engine's loop through its periodic hook, and only while the main loop
is alive too: a stuck engine or a stuck main thread stops the pings and systemd restarts the service. A
timer thread that pings regardless would hide exactly the hangs the watchdog exists for.
"""

from __future__ import annotations

import gc
import signal
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Protocol

import structlog

from gthulhu_node import __version__, logs
from gthulhu_node.config import AgentConfig
from gthulhu_node.lifecycle import Component, Supervisor
from gthulhu_node.metrics import Metrics, MetricsSource
from gthulhu_node.systemd import Notifier
from gthulhu_node.workers import Flag, spawn

if TYPE_CHECKING:
    from gthulhu_node.explain import ProbeView
    from gthulhu_node.privileges import Released
    from gthulhu_node.probe.continuous import ContinuousProbe

log = structlog.get_logger(__name__)

TICK_S = 1.0
STATUS_EVERY_S = 5.0
RUNQUEUE_SAMPLE_EVERY_S = 5.0


class EngineHooks(Protocol):
    """What the service hooks into the engine: the watchdog (a periodic hook, so a stuck engine stops the
    pings) and the reaction-latency histogram."""

    def add_periodic(self, name: str, interval_s: float, fn: Callable[[], None]) -> None: ...

    def add_latency_listener(self, listener: Callable[[float], None]) -> None: ...


class ServedAgent(MetricsSource, Protocol):
    """What the service runs: agent.Agent, or a stand-in in tests. Typed, so a renamed method is a mypy
    error here rather than an AttributeError at 3 a.m."""

    capabilities: str  # set by the service: what was dropped at start (privileges.Released.describe)
    probe: ProbeView | None  # set by the service when it runs the probe: explain reads its figures

    def components(self) -> list[Component]:
        """The agent's parts in start order; the service's supervisor runs them (lifecycle.py)."""

    def reload(self) -> None: ...

    def summary(self) -> str: ...


def _default_agent(config: AgentConfig) -> ServedAgent:
    from gthulhu_node.agent import Agent

    return Agent(config)


class Service:
    """One run of the agent as a service. `run()` returns the process exit code."""

    def __init__(self, config: AgentConfig, *, config_path: str = "",
                 agent_factory: Callable[[AgentConfig], ServedAgent] = _default_agent,
                 notifier: Notifier | None = None,
                 release_privileges: Callable[[AgentConfig], Released] | None = None) -> None:
        """`release_privileges` (privileges.release for `gthulhu-node run`) is called before any thread
        starts; None for tests that run a Service inside their own (root, multi-threaded) process."""
        self.config = config
        self.config_path = config_path
        self.agent_factory = agent_factory
        self.notifier = notifier or Notifier()
        self.metrics = Metrics(config.metrics.listen)
        self.supervisor = Supervisor([])  # replaced by run() once the agent exists
        self.release_privileges = release_privileges
        self.released: Released | None = None  # what release_privileges returned
        self._agent: ServedAgent | None = None
        self.probe: ContinuousProbe | None = None  # the continuous run-queue probe, when enabled
        self._stop = Flag()
        self._reload = Flag()
        self._main_alive = time.monotonic()
        self._watchdog_from_engine = False
        self._last_ping = 0.0
        self._stop_signal = ""

    @property
    def agent(self) -> ServedAgent:
        """The agent, once created (run() creates it before anything else uses it)."""
        if self._agent is None:
            raise RuntimeError("the agent is not created yet")
        return self._agent

    # ---- signals -------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            self._reload.set()
        else:
            self._stop_signal = signal.Signals(signum).name
            self._stop.set()

    def _install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_signal)

    # ---- the watchdog --------------------------------------------------------------------------------

    def _feed_watchdog(self) -> None:
        """Called from the engine's loop. Pings only if the main loop ticked recently as well.

        The notifier's interval is already half of WatchdogSec (systemd.py), the documented ping rate.
        """
        interval = self.notifier.watchdog_interval_s
        if interval is None:
            return
        now = time.monotonic()
        if now - self._last_ping < interval:
            return
        if now - self._main_alive > max(3 * TICK_S, interval):
            return  # the main thread is stuck: let systemd see it
        self._last_ping = now
        self.notifier.watchdog()

    def _wire_engine(self, engine: EngineHooks | None) -> None:
        """Hook the reaction-latency histogram and the watchdog into the engine."""
        if engine is not None:
            engine.add_latency_listener(self.metrics.observe_reaction)
        if engine is not None and self.notifier.watchdog_interval_s is not None:
            engine.add_periodic("systemd-watchdog", min(TICK_S, self.notifier.watchdog_interval_s / 2),
                                self._feed_watchdog)
            self._watchdog_from_engine = True
        elif self.notifier.watchdog_interval_s is not None:
            log.warning("watchdog_fed_from_main_loop", reason="the agent has no engine")

    # ---- lifecycle -----------------------------------------------------------------------------------

    def run(self) -> int:
        setup = logs.configure(self.config.log)
        self._install_signals()
        log.info("service_starting", version=__version__, config=self.config_path or "(defaults)",
                 log_format=setup.format, log_rate_limit_per_s=self.config.log.rate_limit_per_s,
                 watchdog_interval_s=self.notifier.watchdog_interval_s, notify=self.notifier.enabled)
        for note in self.config.deprecations():
            log.warning("config_deprecated", detail=note)
        if self.release_privileges is not None:
            self.released = self.release_privileges(self.config)
        try:
            return self._run(setup)
        finally:
            setup.close()
            self.notifier.close()

    def _run(self, setup: logs.LoggingSetup) -> int:
        self.notifier.status("starting: loading the scheduler and the saved intents")
        try:
            self._agent = self.agent_factory(self.config)
        except Exception as exc:
            log.error("agent_create_failed", error=str(exc), exc_info=True)
            self.notifier.status(f"failed: {exc}")
            return 1
        if self.released is not None:
            self.agent.capabilities = self.released.describe()
        parts = self._components()  # the probe among them, when enabled: its collector is attached too
        self.metrics.attach(self.agent, log_stats=lambda: setup.stats, probe=self.probe)
        self.supervisor = Supervisor(parts)
        if not self._start_agent():
            return 1
        if self._stop.is_set():
            return self._shutdown()
        self._wire_engine(self.agent.engine)
        summary = self._summary()
        self.notifier.ready(status=summary)
        gc.freeze()
        log.info("service_ready", summary=summary, watchdog_from_engine=self._watchdog_from_engine)
        self._loop(setup)
        return self._shutdown()

    def _components(self) -> list[Component]:
        """The process's long-lived parts in start order, the one list (stopped in reverse): the metrics
        endpoint first, so a start that hangs can be looked at; the agent's parts (Agent.components:
        backend, engine, policy files, status, gRPC API, REST, ready); the probe last, in its own thread
        (one that cannot run only logs and exports up=0), when `probe.enabled`; `Metrics.attach` takes its
        collector with the others'."""
        parts: list[Component] = [self.metrics, *self.agent.components()]
        if self.config.probe.enabled:
            from gthulhu_node.probe.continuous import ContinuousProbe

            self.probe = ContinuousProbe(self.agent.matches, self.config.probe.poll_interval_s)
            self.agent.probe = self.probe  # explain reads its figures
            parts.append(self.probe)
        return parts

    def _start_agent(self) -> bool:
        """The supervisor's start in a worker thread, so the main thread can keep systemd informed."""
        failure: list[BaseException] = []

        def start() -> None:
            try:
                self.supervisor.start()
            except BaseException as exc:
                failure.append(exc)

        started = time.monotonic()
        worker = spawn("agent-start", start)
        while worker.is_alive():
            worker.join(TICK_S)
            # While starting, systemd's start timeout (TimeoutStartSec) is what guards a hang.
            if self.notifier.watchdog_interval_s is not None:
                self.notifier.watchdog()
        if failure:
            exc = failure[0]
            log.error("agent_start_failed", component=self.supervisor.failed, error=str(exc),
                      seconds=round(time.monotonic() - started, 3), exc_info=exc)
            self.notifier.status(f"failed to start: {exc}")
            return False
        log.info("agent_started", seconds=round(time.monotonic() - started, 3))
        return True

    def _loop(self, setup: logs.LoggingSetup) -> None:
        last_status = last_sample = time.monotonic()
        status = ""
        while not self._stop.is_set():
            self._stop.wait(TICK_S)
            now = self._main_alive = time.monotonic()
            if not self._watchdog_from_engine and self.notifier.watchdog_interval_s is not None:
                self.notifier.watchdog()
            if self._reload.is_set():
                self._reload.clear()
                self._do_reload()
            if now - last_status >= STATUS_EVERY_S:
                last_status = now
                fresh = self._summary()
                if fresh != status:
                    status = fresh
                    self.notifier.status(fresh)
            if now - last_sample >= RUNQUEUE_SAMPLE_EVERY_S:
                last_sample = now
                self._sample_runqueue()
            setup.flush()

    def _do_reload(self) -> None:
        self.notifier.reloading()
        log.info("reload_requested", signal="SIGHUP")
        try:
            self.agent.reload()
        except Exception as exc:
            log.error("reload_failed", error=str(exc), exc_info=True)
        summary = self._summary()
        self.notifier.notify(ready=1, status=summary)
        log.info("reload_done", summary=summary)

    def _sample_runqueue(self) -> None:
        try:
            self.metrics.runqueue.sample(self.agent.matches())
        except Exception as exc:
            log.warning("runqueue_sample_failed", error=str(exc))

    def _summary(self) -> str:
        try:
            return str(self.agent.summary())
        except Exception as exc:
            return f"summary unavailable: {exc}"

    def _shutdown(self) -> int:
        self.notifier.stopping()
        self.notifier.status("stopping: unloading the scheduler")
        log.info("service_stopping", signal=self._stop_signal or "none")
        failures = self.supervisor.stop()  # probe, the agent's parts, metrics: each logged if it fails
        code = 1 if failures else 0
        log.info("service_stopped", exit_code=code)
        return code
