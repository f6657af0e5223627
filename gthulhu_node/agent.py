"""The Agent: composes backend, reconciler (inside the engine), intent store, local policy files, status
and the gRPC API into one thing a service can start, reload and stop.

Order matters, and it is why this class exists:
1. the backend is selected and started (the scheduler loaded),
2. the last accepted intents are loaded from the state directory and the local policy files are read;
   the resulting policy is given to the reconciler before the engine's first full scan, so the first
   write to the backend already carries them,
3. only then are the gRPC API (and, through `store`, the REST push) open to traffic, and the agent is
   ready: the service sends READY=1 after its supervisor started these parts.
The order is the list `Agent.components` (each part a lifecycle Component); the service puts it between
the metrics endpoint and the probe (docs/design.md, "Start and stop").

Other parts feed intents through `agent.store` (`IntentStore.apply(source, generation, intents,
allow_reserved=True)` for the `manager` source): the agent listens to the store and hands every change to
the policy builder (gthulhu_node/policy_builder.py, its own thread), which hands the policy to the
reconciler (on the engine thread). Status rows, the summary and the `intent-status` thread that refreshes
them from the engine's last frame are `AgentStatus`'s (gthulhu_node/agent_status.py); the agent answers
`status`, `matches` and `summary` from it. This class is the wiring: which parts, in which order, and
what each is handed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from gthulhu_node.agent_status import AgentStatus
from gthulhu_node.api.server import ApiServer, ApiStats
from gthulhu_node.backends.base import Backend, BackendState
from gthulhu_node.backends.select import fallback_after_ejections, fallback_after_refusal, select_backend
from gthulhu_node.backends.supervisor import Choice, SupervisedBackend
from gthulhu_node.config import AgentConfig
from gthulhu_node.engine import Engine
from gthulhu_node.explain import ProbeView, Report, explain_in_agent
from gthulhu_node.intents.localfiles import LocalFilesStats, LocalPolicies
from gthulhu_node.intents.model import Intent
from gthulhu_node.intents.status import (
    MatchRow,
    StatusSnapshot,
)
from gthulhu_node.intents.store import IntentStore, StoreStats
from gthulhu_node.lifecycle import Component, Created, Health, Step, Supervisor
from gthulhu_node.policy_builder import PolicyBuilder
from gthulhu_node.preview import Displaced, Preview, preview_in_agent
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.cgroup_limits import CgroupLimitsStats, CpuMaxWatch
from gthulhu_node.workers import Flag

if TYPE_CHECKING:  # imported only when REST is enabled (aiohttp and the token machinery)
    from gthulhu_node.rest.server import RestServer
    from gthulhu_node.rest.stats import RestStats

log = structlog.get_logger(__name__)

MANAGER_PODS = "manager-pods"  # the REST pod-intent source (gthulhu_node.rest.intent_routes.POD_SOURCE)
SYNC_TIMEOUT_S = 5.0


@dataclass(slots=True)
class AgentStats:
    """What metrics read at scrape time (plain values; metrics.py owns the Prometheus names)."""

    ready: bool = False
    store: StoreStats = field(default_factory=StoreStats)
    # per state ("pending", "applied", "failed", "not_for_this_node") -> number of intents
    intents_by_state: dict[str, int] = field(default_factory=dict)
    matched_tasks: int = 0
    local_files: LocalFilesStats = field(default_factory=LocalFilesStats)
    api: ApiStats = field(default_factory=ApiStats)
    policy_updates: int = 0
    policy_errors: int = 0
    rest: RestStats | None = None  # while the REST listener runs
    cgroup_limits: CgroupLimitsStats = field(default_factory=CgroupLimitsStats)


class Agent:
    """One gthulhu-node agent. Not started by the constructor; see the module docstring for the order."""

    def __init__(self, config: AgentConfig, *, backend: Backend | None = None) -> None:
        """`backend` overrides the configured selection (tests); otherwise select_backend(config)."""
        self.config = config
        self.store = IntentStore(
            config.state.directory,
            max_intents_per_source=config.api.max_intents_per_source,
            max_sources=config.api.max_sources,
            max_client_intents=config.api.max_client_intents,
        )
        self.local = LocalPolicies(
            config.policies.directory, self.store, poll_interval_s=config.policies.poll_interval_s
        )
        # the one backend, for life: it selects, falls back, reloads and gives up (backends/supervisor.py)
        self._backend = SupervisedBackend(
            backend,
            reason="given by the caller" if backend is not None else "",
            select=lambda: select_backend(self.config),
            fall_back=self._fallback_after_refusal if config.backend.kind == "auto" else None,
            replace=self._replacement,
        )
        self.capabilities = ""  # set by the service: the capabilities dropped at start, for status
        self._ready = Flag()
        self._stopped = Flag()
        # the status rows, their `intent-status` thread and the summary (agent_status.py)
        self.statuses = AgentStatus(self, self._stopped)
        self.board = self.statuses.board
        self.cgroup_limits = CpuMaxWatch(config.watch.cgroup_root, config.watch.cgroup_scan_interval_s,
                                         self.statuses.cpu_max_enforced)
        self.engine: Engine | None = None
        self.api: ApiServer | None = None
        self.rest: RestServer | None = None  # when rest.enabled
        self.probe: ProbeView | None = None  # set by the service when it runs the run-queue probe (explain's)
        self._supervisor: Supervisor | None = None  # when started by `start` (not by the service)
        # the policy-builder thread: woken by store changes, coalesced; `sync` waits for its hand-off
        self.policies = PolicyBuilder(self.store, lambda: self.config, lambda: self.engine,
                                      self.statuses.wake_now)
        self.store.subscribe(self.policies.store_changed)

    # ---- lifecycle ----------------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True between the end of start() and the beginning of stop()."""
        return self._ready.is_set()

    def components(self) -> list[Component]:
        """The agent's parts in start order; a Supervisor stops the started ones in reverse
        (gthulhu_node/lifecycle.py). `ready` is last: the first thing undone at stop."""
        parts: list[Component] = [
            Step("backend", self._start_backend, self._stop_backend, self._backend_health),
            Step("engine", self._start_engine, self._stop_engine, self._engine_health),
            self.local,
            self.cgroup_limits,
            Step("status", self.statuses.start, self.statuses.stop),
            Created("api", self._new_api),
        ]
        if self.config.rest.enabled:
            parts.append(Created("rest", self._new_rest))
        parts.append(Step("ready", self._mark_ready, self._mark_stopping))
        return parts

    @property
    def name(self) -> str:
        return "agent"

    def start(self) -> None:
        """Start every part in order (`components`), for an agent run on its own (tests, tools); the
        service starts the same parts within its own list. Raises (BackendUnavailable, ApiConfigError,
        OSError, ...) after undoing what was started."""
        self._supervisor = Supervisor(self.components())
        try:
            self._supervisor.start()
        except BaseException:
            self._stopped.set()
            log.error("agent_start_failed", component=self._supervisor.failed, exc_info=True)
            raise

    def health(self) -> Health:
        return Health(self.ready, "" if self.ready else "not ready")

    @property
    def backend(self) -> SupervisedBackend | None:
        """The supervised backend once one is selected (at start, or given), else None."""
        return self._backend if self._backend.current is not None else None

    @property
    def backend_reason(self) -> str:
        return self._backend.reason

    @property
    def sched_ext_refused(self) -> str:
        """Why the kernel refused our scheduler when auto fell back, else ""."""
        return self._backend.refused

    @property
    def sched_ext_given_up(self) -> str:
        """Why the engine stopped reloading an ejected scheduler, else ""."""
        return self._backend.given_up

    def _fallback_after_refusal(self, refusal: str) -> Choice:
        return fallback_after_refusal(self.config, refusal)

    def _replacement(self, why: str) -> Choice:
        """The replacement for a scheduler the kernel keeps ejecting (on the engine thread): the next best
        backend, as for a refusal at start, started."""
        backend, reason = fallback_after_ejections(self.config, why)
        backend.start()
        return backend, reason

    def _start_backend(self) -> None:
        if self.config.rest.enabled and self.config.rest.runtime_config_allow:
            self._apply_runtime_config()
        self._backend.start()

    def _stop_backend(self) -> None:
        self._backend.stop()

    def _backend_health(self) -> Health:
        running = self._backend.current
        health = running.health() if running is not None else None
        if health is None:
            return Health(False, "no backend")
        return Health(health.state is BackendState.RUNNING, health.reason)

    def _start_engine(self) -> None:
        """Saved intents and policy files first: the engine's first scan writes them."""
        self.store.load()
        self.local.reload(force=True)
        self.local.check_scale()
        policy = self.policies.first()
        reconciler = Reconciler(self._backend, policy=policy, proc_root=self.config.watch.proc_root)
        self.engine = engine_for(reconciler, self.config)
        self.engine.start()
        self.policies.start()

    def _stop_engine(self) -> None:
        self.policies.stop()
        if self.engine is not None:
            self.engine.close()

    def _engine_health(self) -> Health:
        return self.engine.health() if self.engine is not None else Health(False, "not created")

    def _new_api(self) -> ApiServer:
        self.api = ApiServer(self.config.api, self)
        return self.api

    def _new_rest(self) -> RestServer:
        # Imported only when enabled: aiohttp and the token machinery are not needed otherwise.
        from gthulhu_node.rest.server import RestServer

        self.rest = RestServer(
            self.config.rest, self.store, node_name=self.config.node.name, status=self.status,
            metrics_text=self._pod_metrics_text,
            backend_name=lambda: self.backend.name if self.backend is not None else "",
            explain=lambda tid, pid, comm: self.explain(tid=tid, pid=pid, comm_regex=comm),
            preview=self.preview,
        )
        return self.rest

    def _mark_ready(self) -> None:
        self._ready.set()
        if self.api is not None:
            self.api.set_ready(True)
        self.statuses.wake_now()
        log.info("agent_ready", summary=self.summary())

    def _mark_stopping(self) -> None:
        """First at stop: not ready, and the status board closed so watch streams end before the API."""
        self._ready.clear()
        self._stopped.set()
        self.statuses.wake_now()
        self.board.close()

    def _apply_runtime_config(self) -> None:
        """Load-time settings the Manager set through runtime-config (rest/runtime_config.py), before the
        scheduler is loaded."""
        from gthulhu_node.rest.runtime_config import default_slice_at_start

        configured = self.config.scheduler.default_slice_ns
        slice_ns = default_slice_at_start(self.config.state.directory,
                                          frozenset(self.config.rest.runtime_config_allow), configured)
        if slice_ns != configured:
            scheduler = self.config.scheduler.model_copy(update={"default_slice_ns": slice_ns})
            self.config = self.config.model_copy(update={"scheduler": scheduler})

    def _pod_metrics_text(self) -> bytes:
        """Upstream's gthulhu_pod_* metrics for the Manager's scrape of the REST listener's /metrics."""
        from gthulhu_node.rest.podmetrics import manager_pods_text

        return manager_pods_text(MANAGER_PODS, self.store.get(MANAGER_PODS), self.matches,
                                 self.config.node.name, self.config.watch.proc_root)

    def stop(self) -> None:
        """Stop what `start` started, in reverse (ready, REST, API, status, files, engine, backend).
        Idempotent; a part that fails to stop is logged and the rest still stop."""
        supervisor, self._supervisor = self._supervisor, None
        if supervisor is not None:
            supervisor.stop()
        self._stopped.set()
        log.info("agent_stopped")

    def reload(self) -> None:
        """SIGHUP: re-read every local policy file now (the config file itself is not reloaded)."""
        log.info("agent_reload", directory=str(self.local.directory))
        self.local.reload(force=True)
        self.sync()

    def wait_stopped(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # ---- policy -------------------------------------------------------------------------------------

    def sync(self, timeout: float = SYNC_TIMEOUT_S) -> None:
        """Wait until earlier store changes are built (the policy builder), then in effect (rematched and
        written), then rebuild status from the frame the engine published as it settled (best effort)."""
        engine = self.engine
        if engine is not None and engine.running:
            deadline = time.monotonic() + timeout
            try:
                if not self.policies.await_handed(timeout):
                    raise TimeoutError(f"the policy builder did not hand over within {timeout:g} s")
                engine.when_settled().result(max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                log.warning("agent_sync_failed", error=str(exc))
        self.refresh_status()

    # ---- status (gthulhu_node/agent_status.py) ------------------------------------------------------

    def refresh_status(self) -> None:
        """Rebuild status rows and the summary now (on the caller's thread)."""
        self.statuses.refresh()

    def status(self, source: str = "") -> StatusSnapshot:
        """Per-intent status (of one source, or all) and the agent summary."""
        return self.statuses.status(source)

    def matches(self, intent: str = "") -> list[MatchRow]:
        """The tasks intents govern (of one `source/id`, or all), as the engine last published them."""
        return self.statuses.matches(intent)

    def summary(self) -> str:
        """One line for systemd's STATUS=."""
        return self.statuses.summary()

    def explain(self, *, tid: int = 0, pid: int = 0, comm_regex: str = "") -> list[Report]:
        """Why threads are (not) governed: gthulhu_node/explain.py, its one entry into the agent."""
        return explain_in_agent(self, tid=tid, pid=pid, comm_regex=comm_regex)

    def preview(self, source: str, intents: Sequence[Intent]) -> tuple[Preview, list[Displaced]]:
        """What intents not applied would do now: gthulhu_node/preview.py. Changes nothing."""
        return preview_in_agent(self, source, intents)

    def stats(self) -> AgentStats:
        """Counters for metrics."""
        return AgentStats(
            ready=self.ready,
            store=self.store.stats(),
            intents_by_state=self.statuses.counts(),
            matched_tasks=self.statuses.matched_tasks,
            local_files=self.local.stats(),
            api=self.api.service.stats() if self.api is not None else ApiStats(),
            policy_updates=self.policies.updates,
            policy_errors=self.policies.errors,
            rest=self.rest.stats() if self.rest is not None else None,
            cgroup_limits=self.cgroup_limits.stats(),
        )


def engine_for(reconciler: Reconciler, config: AgentConfig,
               on_give_up: Callable[[str], Backend] | None = None) -> Engine:
    """The engine with the settings of the configuration's `watch`, `backend` and `scheduler` sections
    (here, not in engine.py: the engine takes plain values and never sees the configuration)."""
    return Engine(
        reconciler,
        rescan_interval_s=config.watch.rescan_interval_s,
        reload_backoff_initial_s=config.backend.reload_backoff_initial_s,
        reload_backoff_max_s=config.backend.reload_backoff_max_s,
        ejection_limit=config.scheduler.ejection_limit,
        ejection_window_s=config.scheduler.ejection_window_s,
        on_give_up=on_give_up,
    )
