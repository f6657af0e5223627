"""The agent's status: the `intent-status` thread that turns the engine's last frame, the store and the
policy in effect into status rows (gthulhu_node/status_rows.py) and the agent summary, the board it
publishes them on, and the answers read from them (status, matches, systemd's STATUS= line, counts).

When: on a frame published by the engine (at most every `STATUS_MIN_INTERVAL_S` since the last refresh),
at once when the policy in effect, readiness or stop changed (`wake_now`), and every `STATUS_INTERVAL_S`
for what no frame carries (cgroup limits). It never asks the engine thread for status: it reads the
engine's last published frame (gthulhu_node/feed.py).

Why apart from the Agent: the Agent wires parts; this is one part, with its own thread (a `WorkerThread`
serving one coalescing `WorkQueue`, gthulhu_node/workers.py) and its own rules.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Protocol

import structlog

from gthulhu_node import __version__
from gthulhu_node.backends.base import BackendState
from gthulhu_node.backends.supervisor import SupervisedBackend
from gthulhu_node.config import AgentConfig
from gthulhu_node.engine import Engine
from gthulhu_node.feed import EngineFrame
from gthulhu_node.intents.localfiles import SOURCE as LOCAL_SOURCE
from gthulhu_node.intents.localfiles import LocalPolicies
from gthulhu_node.intents.status import (
    AgentSummary,
    IntentState,
    MatchRow,
    SourceStatus,
    StatusBoard,
    StatusSnapshot,
)
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.policy_builder import PolicyBuilder
from gthulhu_node.status_rows import intent_rows
from gthulhu_node.tasks.cgroup_limits import CpuMaxWatch, describe
from gthulhu_node.workers import Flag, WorkerThread, WorkQueue

if TYPE_CHECKING:  # imported only when REST is enabled (aiohttp and the token machinery)
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
INSECURE_REST_WARNING = (
    "the REST API on {listen} serves plain HTTP without client certificates "
    "(rest.insecure_allow_plain_http): anyone who can reach it and has the public key can change this "
    "node's scheduling"
)
MANAGER = "manager"  # the REST node-policy source (gthulhu_node.rest.intent_routes.NODE_SOURCE)
SCHED_EXT = "sched_ext"  # the backend that takes cpu.max away from the kernel (docs/scheduler.md)


class StatusInputs(Protocol):
    """What status reads of the agent (gthulhu_node/agent.py's Agent): its parts, read at each refresh
    (the engine and REST exist only once started, the configuration may be replaced before the backend
    starts)."""

    config: AgentConfig
    store: IntentStore
    local: LocalPolicies
    policies: PolicyBuilder
    cgroup_limits: CpuMaxWatch
    engine: Engine | None
    rest: RestServer | None
    capabilities: str

    @property
    def backend(self) -> SupervisedBackend | None: ...
    @property
    def backend_reason(self) -> str: ...
    @property
    def ready(self) -> bool: ...


class AgentStatus:
    """The status part: `start` and `stop` run its thread (in the agent's `status` step); the other
    methods answer from any thread."""

    def __init__(self, agent: StatusInputs, stopped: Flag) -> None:
        """`stopped`: the agent's stop signal (set at the start of its stop): status says "stopped" and
        the thread ends."""
        self._agent = agent
        self._stopped = stopped
        self.board = StatusBoard()
        self._refresh_lock = threading.Lock()
        # woken by frames (at most every STATUS_MIN_INTERVAL_S since the last refresh), at once by a
        # policy in effect, readiness or stop, and every STATUS_INTERVAL_S
        self._refreshes = self._refresh_queue()
        self._thread = WorkerThread("intent-status", self._run_status, join_timeout_s=5)
        self.matched_tasks = 0
        self._refreshed_at = 0.0  # monotonic time of the last refresh

    # ---- the thread ---------------------------------------------------------------------------------

    def start(self) -> None:
        engine = self._agent.engine
        if engine is not None:
            engine.feed.add_listener(self._on_frame)
        self._refreshes.open()
        self._thread.start()
        self.refresh()

    def stop(self) -> None:
        self._stopped.set()
        self.wake_now()
        self._thread.stop()

    def _on_frame(self, _frame: EngineFrame) -> None:
        """On the engine thread, after each publication: wake the status thread, which refreshes at once
        or when `STATUS_MIN_INTERVAL_S` since its last refresh is up, whichever is later."""
        self._refreshes.wake()

    def wake_now(self) -> None:
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
            self.refresh()
        except Exception:
            log.exception("status_refresh_failed")

    # ---- the rows -----------------------------------------------------------------------------------

    def _frame(self) -> EngineFrame | None:
        """The engine's last published frame while it runs (its figures stand while it is busy: a busy
        engine has undone nothing)."""
        engine = self._agent.engine
        if engine is None or not engine.running:
            return None
        frame = engine.feed.latest()
        return frame if frame.version else None

    def refresh(self) -> None:
        """Turn the engine's last frame, the store and the policy in effect into status rows; publish the
        changes. Runs nothing on the engine thread."""
        with self._refresh_lock:
            frame = self._frame()
            stats = frame.intents if frame is not None else None
            if frame is not None:
                self.matched_tasks = len(frame.matches)
            node = self._agent.config.node
            statuses = intent_rows(self._agent.store.snapshot(), stats, self._agent.policies.effect(),
                                   self._backend_state(), node.name, node.labels)
            self.board.publish(statuses, self._summary())
            self._refreshed_at = time.monotonic()

    def _backend_state(self) -> tuple[str, str]:
        engine = self._agent.engine
        if engine is None:
            return ("starting" if not self._stopped.is_set() else "stopped"), ""
        sup = engine.stats().backend
        state = sup.state or BackendState.RUNNING.value
        return state, sup.last_ejection_reason if state != BackendState.RUNNING.value else ""

    # ---- cgroup cpu.max -----------------------------------------------------------------------------

    def cpu_max_enforced(self) -> bool:
        """Whether cgroup cpu.max holds now. While our sched_ext scheduler runs, the kernel's CFS bandwidth
        control does not apply to its tasks and the scheduler enforces cpu.max itself, unless it could not
        track every cgroup (its counter `cgroups_untracked`, from the engine's latest frame). True for the
        other backends, and while the scheduler is ejected."""
        backend = self._agent.backend
        if backend is None or backend.name != SCHED_EXT:
            return True
        return not self._scheduler_running() or (backend.enforces_cpu_max and not self._cgroups_untracked())

    def _cgroups_untracked(self) -> int:
        engine = self._agent.engine
        if engine is None:
            return 0
        return engine.feed.latest().counters.get("cgroups_untracked", 0)

    def _scheduler_running(self) -> bool:
        return self._backend_state()[0] in (BackendState.RUNNING.value, "starting")

    def cpu_max_by_scheduler(self) -> str:
        """Where our own scheduler takes cpu.max from when it is what holds it now; "" when it is not."""
        backend = self._agent.backend  # cpu_max_source is "" for every backend but sched_ext
        if backend is None or not self._scheduler_running() or not self.cpu_max_enforced():
            return ""
        return backend.cpu_max_source

    # ---- the summary and the answers ----------------------------------------------------------------

    def _summary(self) -> AgentSummary:
        agent = self._agent
        state, reason = self._backend_state()
        return AgentSummary(
            node_name=agent.config.node.name,
            node_labels=dict(agent.config.node.labels),
            backend=agent.backend.name if agent.backend is not None else "",
            backend_reason=agent.backend_reason,
            scheduler_state=state,
            scheduler_reason=reason,
            ready=agent.ready,
            matched_tasks=self.matched_tasks,
            version=__version__,
            warnings=self._agent_warnings(),
            capabilities=agent.capabilities,
            cgroup_cpu_max=describe(agent.cgroup_limits.latest(), self.cpu_max_enforced(),
                                    agent.backend.name if agent.backend is not None else "no",
                                    self.cpu_max_by_scheduler()),
        )

    def _agent_warnings(self) -> tuple[str, ...]:
        config = self._agent.config
        out: list[str] = []
        if config.rest.enabled and config.rest.insecure_allow_plain_http:
            out.append(INSECURE_REST_WARNING.format(listen=config.rest.listen))
        if config.security.unprivileged_tasks == "allowed":
            effect = self._agent.policies.effect()
            takeable = sum(1 for i in effect.intents.values() if i.priority > 0 and not i.names_owner)
            if takeable:
                out.append(ANY_USER_WARNING.format(count=takeable))
        return tuple(out)

    def status(self, source: str = "") -> StatusSnapshot:
        """Per-intent status (of one source, or all) and the agent summary."""
        agent = self._agent
        intents = [s for s in self.board.intents() if not source or s.source == source]
        sources = agent.store.snapshot()
        local_errors = tuple(f"{path}: {err}" for path, err in sorted(agent.local.errors().items()))
        notes = {LOCAL_SOURCE: tuple(agent.local.notes()),
                 MANAGER: tuple(agent.rest.notes()) if agent.rest is not None else ()}
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
        most `Engine.publish_interval_s` old while tasks change, current after `Agent.sync`."""
        frame = self._frame()
        if frame is None:
            return []
        found = sorted((m for m in frame.matches.values() if not intent or m.intent_key == intent),
                       key=lambda m: (m.tgid, m.tid))
        return [MatchRow(m.tid, m.tgid, m.comm, m.intent_key, m.priority, m.slice_ns, m.scope, m.overlaps)
                for m in found]

    def summary(self) -> str:
        """One line for systemd's STATUS=: readiness, backend, intents by state and tasks matched."""
        if self._stopped.is_set():
            return "stopped"
        if not self._agent.ready:
            return "starting"
        counts = self.counts()
        backend = self._agent.backend
        state, _ = self._backend_state()
        parts = [f"{counts[s.value]} {s.value.replace('_', ' ')}" for s in IntentState if counts.get(s.value)]
        return (
            f"backend {backend.name if backend is not None else '?'} ({state}); intents: "
            f"{', '.join(parts) or 'none'}; {self.matched_tasks} tasks matched"
        )

    def counts(self) -> dict[str, int]:
        """Intents by state, as last published."""
        counts: dict[str, int] = {}
        for st in self.board.intents():
            counts[st.state.value] = counts.get(st.state.value, 0) + 1
        return counts
