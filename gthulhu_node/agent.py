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
the reconciler (on the engine thread). Per-intent figures and task rows are produced by the engine
(`Engine.feed`, gthulhu_node/feed.py); the agent turns its latest frame, the store and the policy in effect
into status rows when a frame is published (at most every `STATUS_MIN_INTERVAL_S`), when the store or the
policy in effect changes, and every `STATUS_INTERVAL_S` for what no frame carries (cgroup limits). It never
asks the engine thread for status.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from gthulhu_node import __version__
from gthulhu_node.api.server import ApiServer, ApiStats
from gthulhu_node.backends.base import Backend, BackendState
from gthulhu_node.backends.select import fallback_after_ejections, fallback_after_refusal, select_backend
from gthulhu_node.backends.supervisor import Choice, SupervisedBackend
from gthulhu_node.config import AgentConfig
from gthulhu_node.engine import Engine
from gthulhu_node.explain import ProbeView, Report, explain_in_agent
from gthulhu_node.feed import EngineFrame
from gthulhu_node.intents.localfiles import SOURCE as LOCAL_SOURCE
from gthulhu_node.intents.localfiles import LocalFilesStats, LocalPolicies
from gthulhu_node.intents.model import Intent, SenderEntry, intent_key, pattern_warnings
from gthulhu_node.intents.status import (
    MAP_FULL_WARNING,
    NO_MATCH_WARNING,
    NOOP_WARNING,
    NOT_FOR_THIS_NODE_REASON,
    AgentSummary,
    IntentState,
    IntentStatus,
    MatchRow,
    SourceStatus,
    StatusBoard,
    StatusSnapshot,
)
from gthulhu_node.intents.store import IntentStore, SourceSet, StoreStats
from gthulhu_node.lifecycle import Component, Created, Health, Step, Supervisor
from gthulhu_node.matching import resolve_users
from gthulhu_node.outbox import FailureReason
from gthulhu_node.policy_builder import PolicyBuilder
from gthulhu_node.preview import Displaced, Preview, preview_in_agent
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.status_projection import IntentStats
from gthulhu_node.tasks.cgroup_limits import CgroupLimitsStats, CpuMaxWatch, describe
from gthulhu_node.workers import Flag, WorkerThread, WorkQueue

if TYPE_CHECKING:  # imported only when REST is enabled (aiohttp and the token machinery)
    from gthulhu_node.rest.app import RestStats
    from gthulhu_node.rest.server import RestServer

log = structlog.get_logger(__name__)

STATUS_INTERVAL_S = 1.0
# Frames come up to 10 times a second under churn: status rows are rebuilt at most this often for them.
STATUS_MIN_INTERVAL_S = 0.25
ANY_USER_WARNING = (
    "{count} boosting intents name neither users nor a cgroup: any local user can get their priority by "
    "naming a thread to match (restrict them with users or cgroupRegex, or set "
    "security.unprivileged_tasks: named_only; docs/security.md)"
)
EXECUTABLE_WARNING = (
    "executableRegex is not a security boundary (anyone can run the same executable): use users or "
    "cgroupRegex to restrict who is boosted"
)
INSECURE_REST_WARNING = (
    "the REST API on {listen} serves plain HTTP without client certificates "
    "(rest.insecure_allow_plain_http): anyone who can reach it and has the public key can change this "
    "node's scheduling"
)
NODE_MISMATCH_WARNING = (
    "the Manager sent this for node {target!r}, and this node calls itself {node!r}: applied all the same "
    "(the Manager chose this node); set node.name (or NODE_NAME) to the Kubernetes node name"
)
MANAGER = "manager"  # the REST node-policy source (gthulhu_node.rest.app.NODE_SOURCE)
MANAGER_PODS = "manager-pods"  # the REST pod-intent source (gthulhu_node.rest.app.POD_SOURCE)
SYNC_TIMEOUT_S = 5.0
SCHED_EXT = "sched_ext"  # the backend that takes cpu.max away from the kernel (docs/scheduler.md)


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
        self.board = StatusBoard()
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
        self.cgroup_limits = CpuMaxWatch(config.watch.cgroup_root, config.watch.cgroup_scan_interval_s,
                                         self.cpu_max_enforced)
        self.engine: Engine | None = None
        self.api: ApiServer | None = None
        self.rest: RestServer | None = None  # when rest.enabled
        self.probe: ProbeView | None = None  # set by the service when it runs the run-queue probe (explain's)
        self._supervisor: Supervisor | None = None  # when started by `start` (not by the service)
        self._ready = Flag()
        self._stopped = Flag()
        # the policy-builder thread: woken by store changes, coalesced; `sync` waits for its hand-off
        self.policies = PolicyBuilder(self.store, lambda: self.config, lambda: self.engine, self._wake_now)
        self._refresh_lock = threading.Lock()
        # The status thread: woken by frames (at most every STATUS_MIN_INTERVAL_S since the last refresh),
        # at once by the store, a policy in effect, readiness or stop, and every STATUS_INTERVAL_S
        self._refreshes = self._refresh_queue()
        self._status_thread = WorkerThread("intent-status", self._run_status, join_timeout_s=5)
        self._matched_tasks = 0
        self._refreshed_at = 0.0  # monotonic time of the last status refresh
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
            Step("status", self._start_status, self._stop_status),
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

    def cpu_max_enforced(self) -> bool:
        """Whether cgroup cpu.max holds now. While our sched_ext scheduler runs, the kernel's CFS bandwidth
        control does not apply to its tasks and the scheduler enforces cpu.max itself, unless it could not
        track every cgroup (its counter `cgroups_untracked`, from the engine's latest frame). True for the
        other backends, and while the scheduler is ejected."""
        backend = self.backend
        if backend is None or backend.name != SCHED_EXT:
            return True
        return not self._scheduler_running() or (backend.enforces_cpu_max and not self._cgroups_untracked())

    def _cgroups_untracked(self) -> int:
        if self.engine is None:
            return 0
        return self.engine.feed.latest().counters.get("cgroups_untracked", 0)

    def _scheduler_running(self) -> bool:
        return self._backend_state()[0] in (BackendState.RUNNING.value, "starting")

    def cpu_max_by_scheduler(self) -> str:
        """Where our own scheduler takes cpu.max from when it is what holds it now; "" when it is not."""
        backend = self.backend  # cpu_max_source is "" for every backend but sched_ext
        if backend is None or not self._scheduler_running() or not self.cpu_max_enforced():
            return ""
        return backend.cpu_max_source

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

    def _start_status(self) -> None:
        if self.engine is not None:
            self.engine.feed.add_listener(self._on_frame)
        self._refreshes.open()
        self._status_thread.start()
        self.refresh_status()

    def _stop_status(self) -> None:
        self._stopped.set()
        self._wake_now()
        self._status_thread.stop()

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
        self._wake_now()
        log.info("agent_ready", summary=self.summary())

    def _mark_stopping(self) -> None:
        """First at stop: not ready, and the status board closed so watch streams end before the API."""
        self._ready.clear()
        self._stopped.set()
        self._wake_now()
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

    # ---- status -------------------------------------------------------------------------------------

    def _on_frame(self, _frame: EngineFrame) -> None:
        """On the engine thread, after each publication: wake the status thread, which refreshes at once
        or when `STATUS_MIN_INTERVAL_S` since its last refresh is up, whichever is later."""
        self._refreshes.wake()

    def _wake_now(self) -> None:
        """The store, the policy in effect, readiness or stop changed: refresh at once, whatever the rate."""
        self._refreshes.wake(urgent=True)

    def _refresh_queue(self) -> WorkQueue:
        """The status thread's wakes: a frame waits out STATUS_MIN_INTERVAL_S since the last refresh (more
        frames meanwhile change nothing), an urgent wake does not, and nothing at all for
        STATUS_INTERVAL_S is a refresh too."""
        return WorkQueue(period_s=STATUS_INTERVAL_S, min_gap_s=STATUS_MIN_INTERVAL_S,
                         last=lambda: self._refreshed_at)

    def _run_status(self, stop: Flag) -> None:
        """The status thread: refresh on each coalesced wake until the agent stops."""
        self._stopped.on_set(stop.set)
        self._refreshes.serve(stop, self._refresh_turn)

    def _refresh_turn(self) -> None:
        if self._stopped.is_set():
            return
        try:
            self.refresh_status()
        except Exception:
            log.exception("status_refresh_failed")

    def _frame(self) -> EngineFrame | None:
        """The engine's last published frame while it runs (its figures stand while it is busy: a busy
        engine has undone nothing)."""
        engine = self.engine
        if engine is None or not engine.running:
            return None
        frame = engine.feed.latest()
        return frame if frame.version else None

    def refresh_status(self) -> None:
        """Turn the engine's last frame, the store and the policy in effect into status rows; publish the
        changes. Runs nothing on the engine thread."""
        with self._refresh_lock:
            frame = self._frame()
            stats = frame.intents if frame is not None else None
            if frame is not None:
                self._matched_tasks = len(frame.matches)
            statuses = self._compute(self.store.snapshot(), stats)
            self.board.publish(statuses, self._summary())
            self._refreshed_at = time.monotonic()

    def _compute(
        self, sources: dict[str, SourceSet], stats: Mapping[str, IntentStats] | None
    ) -> list[IntentStatus]:
        node = self.config.node
        effect = self.policies.effect()
        backend_state, backend_reason = self._backend_state()
        out: list[IntentStatus] = []
        for name, ss in sources.items():
            out.extend(_failed_entries(name, ss, node.name))
            sender_warnings = {e.intent_id: e.warnings + _mismatch_warning(e, node.name)
                               for e in ss.entries if e.intent_id}
            for intent in ss.intents:
                key = intent_key(name, intent.id)
                warnings: list[str] = list(sender_warnings.get(intent.id, ()))
                if intent.is_noop:
                    warnings.append(NOOP_WARNING)
                warnings.extend(pattern_warnings(intent.command_regex))
                warnings.extend(_owner_warnings(intent))
                base = (name, intent)
                if not intent.selects_node(node.name, node.labels):
                    reason = NOT_FOR_THIS_NODE_REASON.format(node=_describe_node(node.name, node.labels))
                    out.append(
                        IntentStatus(*base, IntentState.NOT_FOR_THIS_NODE, reason, 0, 0.0, (), ss.generation)
                    )
                    continue
                st = stats.get(key) if stats is not None else None
                if effect.intents.get(key) != intent or st is None:
                    out.append(
                        IntentStatus(*base, IntentState.PENDING, "", 0, 0.0, tuple(warnings), ss.generation)
                    )
                    continue
                state, reason = IntentState.APPLIED, ""
                if effect.error:
                    state, reason = IntentState.FAILED, f"policy could not be built: {effect.error}"
                elif backend_state != BackendState.RUNNING.value:
                    state, reason = IntentState.FAILED, f"backend is {backend_state}: {backend_reason}"
                elif st.pending_failures:
                    state = IntentState.FAILED
                    why = st.last_error or "write failed"
                    reason = f"{st.pending_failures} task entries not written: {why}"
                    if st.pending_reasons.get(FailureReason.MAP_FULL):
                        warnings.append(MAP_FULL_WARNING)
                elif st.unwritten:
                    state, reason = IntentState.PENDING, f"{st.unwritten} task entries being written"
                if st.matched_tasks == 0:
                    warnings.append(NO_MATCH_WARNING)
                elif st.applied_tasks == 0:
                    warnings.append(f"matches {st.matched_tasks} tasks, but other intents win all of them")
                for winner, n in sorted(st.overlaps.items()):
                    warnings.append(f"overlaps with {winner} on {n} tasks: {winner} wins")
                out.append(
                    IntentStatus(*base, state, reason, st.applied_tasks, 0.0, tuple(warnings), ss.generation)
                )
        return out

    def _backend_state(self) -> tuple[str, str]:
        if self.engine is None:
            return ("starting" if not self._stopped.is_set() else "stopped"), ""
        es = self.engine.stats()
        state = es.backend_state or BackendState.RUNNING.value
        return state, es.last_ejection_reason if state != BackendState.RUNNING.value else ""

    def _summary(self) -> AgentSummary:
        state, reason = self._backend_state()
        return AgentSummary(
            node_name=self.config.node.name,
            node_labels=dict(self.config.node.labels),
            backend=self.backend.name if self.backend is not None else "",
            backend_reason=self.backend_reason,
            scheduler_state=state,
            scheduler_reason=reason,
            ready=self.ready,
            matched_tasks=self._matched_tasks,
            version=__version__,
            warnings=self._agent_warnings(),
            capabilities=self.capabilities,
            cgroup_cpu_max=describe(self.cgroup_limits.latest(), self.cpu_max_enforced(),
                                    self.backend.name if self.backend is not None else "no",
                                    self.cpu_max_by_scheduler()),
        )

    def _agent_warnings(self) -> tuple[str, ...]:
        out: list[str] = []
        if self.config.rest.enabled and self.config.rest.insecure_allow_plain_http:
            out.append(INSECURE_REST_WARNING.format(listen=self.config.rest.listen))
        if self.config.security.unprivileged_tasks == "allowed":
            effect = self.policies.effect()
            takeable = sum(1 for i in effect.intents.values() if i.priority > 0 and not i.names_owner)
            if takeable:
                out.append(ANY_USER_WARNING.format(count=takeable))
        return tuple(out)

    def status(self, source: str = "") -> StatusSnapshot:
        """Per-intent status (of one source, or all) and the agent summary."""
        intents = [s for s in self.board.intents() if not source or s.source == source]
        sources = self.store.snapshot()
        local_errors = tuple(f"{path}: {err}" for path, err in sorted(self.local.errors().items()))
        notes = {LOCAL_SOURCE: tuple(self.local.notes()),
                 MANAGER: tuple(self.rest.notes()) if self.rest is not None else ()}
        rows: list[SourceStatus] = []
        names = set(sources) | ({LOCAL_SOURCE} if local_errors else set())
        names |= {name for name, lines in notes.items() if lines}
        for name in sorted(names):
            if source and name != source:
                continue
            ss = sources.get(name)
            rows.append(
                SourceStatus(
                    name,
                    ss.generation if ss else 0,
                    len(ss.intents) if ss else 0,
                    ss.updated if ss else 0.0,
                    local_errors if name == LOCAL_SOURCE else (),
                    notes.get(name, ()),
                )
            )
        return StatusSnapshot(self._summary(), tuple(rows), tuple(intents))

    def matches(self, intent: str = "") -> list[MatchRow]:
        """The tasks intents govern (of one `source/id`, or all), as the engine last published them: at
        most `Engine.publish_interval_s` old while tasks change, current after `sync`."""
        frame = self._frame()
        if frame is None:
            return []
        found = sorted((m for m in frame.matches.values() if not intent or m.intent_key == intent),
                       key=lambda m: (m.tgid, m.tid))
        return [MatchRow(m.tid, m.tgid, m.comm, m.intent_key, m.priority, m.slice_ns, m.scope, m.overlaps)
                for m in found]

    def explain(self, *, tid: int = 0, pid: int = 0, comm_regex: str = "") -> list[Report]:
        """Why threads are (not) governed: gthulhu_node/explain.py, its one entry into the agent."""
        return explain_in_agent(self, tid=tid, pid=pid, comm_regex=comm_regex)

    def preview(self, source: str, intents: Sequence[Intent]) -> tuple[Preview, list[Displaced]]:
        """What intents not applied would do now: gthulhu_node/preview.py. Changes nothing."""
        return preview_in_agent(self, source, intents)

    def summary(self) -> str:
        """One line for systemd's STATUS=: readiness, backend, intents by state and tasks matched."""
        if self._stopped.is_set():
            return "stopped"
        if not self.ready:
            return "starting"
        counts = self._counts()
        backend = self.backend.name if self.backend is not None else "?"
        state, _ = self._backend_state()
        parts = [f"{counts[s.value]} {s.value.replace('_', ' ')}" for s in IntentState if counts.get(s.value)]
        return (
            f"backend {backend} ({state}); intents: {', '.join(parts) or 'none'}; "
            f"{self._matched_tasks} tasks matched"
        )

    def _counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for st in self.board.intents():
            counts[st.state.value] = counts.get(st.state.value, 0) + 1
        return counts

    def stats(self) -> AgentStats:
        """Counters for metrics."""
        return AgentStats(
            ready=self.ready,
            store=self.store.stats(),
            intents_by_state=self._counts(),
            matched_tasks=self._matched_tasks,
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


def _owner_warnings(intent: Intent) -> list[str]:
    """What a person should know about who this intent can boost (docs/security.md)."""
    unknown = resolve_users(intent.users)[1] if intent.users else ()  # asked for every intent every second
    out = [f"users entry {name!r} is no user on this node: it matches nothing" for name in unknown]
    if intent.executable_regex is not None and not intent.names_owner:
        out.append(EXECUTABLE_WARNING)
    return out


def _mismatch_warning(entry: SenderEntry, node_name: str) -> tuple[str, ...]:
    """A Manager entry naming another node is applied all the same (the Manager chose this node to send it
    to; docs/rest.md), with this warning, so a misconfigured node name is seen rather than silent."""
    target = entry.other_node(node_name)
    return (NODE_MISMATCH_WARNING.format(target=target, node=node_name),) if target else ()


def _failed_entries(source: str, ss: SourceSet, node_name: str) -> list[IntentStatus]:
    """Status rows for pushed entries that became no intent (a lenient sender's, docs/rest.md).

    Their `intent` carries the sender's values unvalidated (model_construct), for display only: it is
    never stored as an intent nor handed to the reconciler.
    """
    out: list[IntentStatus] = []
    for entry in ss.entries:
        if not entry.failed:
            continue
        shown = Intent.model_construct(
            id=entry.key,
            command_regex=_record_text(entry.record.get("commandRegex")),
            priority=_record_int(entry.record.get("priority")),
            execution_time=_record_int(entry.record.get("executionTime")),
            node_names=(target,) if (target := _record_text(entry.record.get("nodeID"))) else (),
        )
        out.append(IntentStatus(source, shown, IntentState.FAILED, entry.failed, 0, 0.0,
                                _mismatch_warning(entry, node_name), ss.generation))
    return out


def _record_text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _record_int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _describe_node(name: str, labels: dict[str, str]) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"node {name!r}" + (f" (labels {shown})" if shown else " (no labels)")
