"""Prometheus metrics: one registry of our own, an HTTP endpoint, names `gthulhu_node_*` in base units.

Components do not import prometheus: they keep plain counters (`stats()`), which the collector here reads
at scrape time, so a scrape always shows the current values and a component has no metrics code to get
wrong. Only what must be observed per event (the reaction latency from a task event to its map write, the
duration of each full scan) is a histogram the service feeds through the engine's hooks.

`gthulhu_node_matched_runqueue_wait_seconds_total{intent}` is computed here from the second field of
/proc/<tgid>/task/<tid>/schedstat (nanoseconds the task waited on a run queue) of each matched task. It is a
counter: each sample adds the growth since the previous sample of the same task to its current intent, so
tasks that exit keep what they contributed, and a new task (or a reused TID, whose value starts lower)
starts from its first sample. Wait between a task's last sample and its exit is not counted; samples are
taken at every scrape and every few seconds by the service.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import structlog
from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from gthulhu_node import metrics_server
from gthulhu_node.backends.base import Backend, BackendHealth
from gthulhu_node.engine import EngineStats
from gthulhu_node.lifecycle import Health
from gthulhu_node.peers import PeerStats
from gthulhu_node.reconciler import ReconcilerStats
from gthulhu_node.status_projection import IntentStats
from gthulhu_node.workers import Spawned

if TYPE_CHECKING:  # the agent imports much (and REST aiohttp); metrics only needs their types
    from gthulhu_node.agent import AgentStats
    from gthulhu_node.api.server import ApiStats
    from gthulhu_node.engine import Engine
    from gthulhu_node.intents.localfiles import LocalFilesStats
    from gthulhu_node.intents.status import MatchRow, StatusSnapshot
    from gthulhu_node.intents.store import StoreStats
    from gthulhu_node.logs import LogStats
    from gthulhu_node.probe.continuous import ContinuousProbe
    from gthulhu_node.rest.stats import RestStats
    from gthulhu_node.tasks.cgroup_limits import CgroupLimitsStats

log = structlog.get_logger(__name__)

PREFIX = "gthulhu_node_"

# Reaction latency: from the task event (fork/comm/exec) to the entry being in the backend. Milliseconds
# matter (upstream takes up to 6 s); the top buckets catch the slow path.
REACTION_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 6.0)


def histogram_quantile(hist: Histogram, q: float) -> float:
    """PromQL's `histogram_quantile` over one unlabelled histogram (linear within a bucket, 0 when empty).

    For figures shown beside the metrics (benchmarks, tools): the histogram is the only record of a
    latency, so a p50 or p99 is read from its buckets, as a dashboard would.
    """
    buckets = [(float(s.labels["le"]), s.value) for m in hist.collect() for s in m.samples
               if s.name.endswith("_bucket")]
    total = buckets[-1][1] if buckets else 0.0
    if total <= 0:
        return 0.0
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


def histogram_count(hist: Histogram) -> int:
    return int(next((s.value for m in hist.collect() for s in m.samples if s.name.endswith("_count")), 0))


class RunqueueWaitTracker:
    """Per-intent total run-queue wait of matched tasks, monotonic while tasks come and go."""

    def __init__(self, proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self._lock = threading.Lock()
        self._last: dict[int, tuple[str, int]] = {}  # tid -> (intent, last wait ns)
        self.totals_ns: dict[str, int] = {}

    def _read_wait_ns(self, tgid: int, tid: int) -> int | None:
        try:
            fields = (self.proc_root / str(tgid) / "task" / str(tid) / "schedstat").read_text().split()
            return int(fields[1])
        except (OSError, IndexError, ValueError):
            return None  # the task exited (or schedstat is unavailable): normal

    def sample(self, matches: Iterable[MatchRow]) -> None:
        """Add each matched task's wait growth since its previous sample to its intent's total."""
        seen: dict[int, tuple[str, int]] = {}
        with self._lock:
            for row in matches:
                value = self._read_wait_ns(row.tgid, row.tid)
                if value is None:
                    continue
                self.totals_ns.setdefault(row.intent, 0)
                previous = self._last.get(row.tid)
                if previous is not None and value >= previous[1]:
                    self.totals_ns[row.intent] += value - previous[1]
                seen[row.tid] = (row.intent, value)
            self._last = seen

    def totals_seconds(self) -> dict[str, float]:
        with self._lock:
            return {intent: ns / 1e9 for intent, ns in self.totals_ns.items()}


T = TypeVar("T")


def _call(fn: Callable[[], T], name: str) -> T | None:
    """fn() if it works; a broken component must not break the whole scrape."""
    try:
        return fn()
    except Exception as exc:  # reported, then the rest of the scrape goes on
        log.warning("metrics_source_failed", source=name, error=str(exc))
        return None


def _counter(name: str, doc: str, value: float | None, labels: Mapping[str, str] | None = None) -> Metric:
    family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels or {}))
    if value is not None:
        family.add_metric(list((labels or {}).values()), value)
    return family


def _labelled(kind: type[CounterMetricFamily] | type[GaugeMetricFamily], name: str, doc: str, label: str,
              values: Mapping[str, float]) -> Metric:
    family = kind(PREFIX + name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([str(key)], float(value))
    return family


def _gauge(name: str, doc: str, value: float) -> Metric:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


class MetricsSource(Protocol):
    """What metrics read from the agent, typed end to end: a renamed stats field is a mypy error here,
    not a series that silently exports 0."""

    @property
    def backend(self) -> Backend | None: ...
    @property
    def backend_reason(self) -> str: ...
    @property
    def sched_ext_refused(self) -> str: ...
    @property
    def sched_ext_given_up(self) -> str: ...
    @property
    def engine(self) -> Engine | None: ...

    def stats(self) -> AgentStats: ...

    def status(self, source: str = "") -> StatusSnapshot: ...

    def matches(self, intent: str = "") -> list[MatchRow]: ...


@dataclasses.dataclass(frozen=True, slots=True)
class BackendView:
    """The backend in use, as the engine snapshot carries it: what metrics read of it, typed."""

    name: str
    reason: str
    capacity: int | None
    sched_ext_refused: str
    sched_ext_given_up: str


@dataclasses.dataclass
class EngineSnapshot:
    """Engine, reconciler and backend figures as the engine last published them together (one
    `EngineFrame` of its feed, gthulhu_node/feed.py), so the figures agree."""

    engine: EngineStats | None = None
    reconciler: ReconcilerStats | None = None
    intents: Mapping[str, IntentStats] = dataclasses.field(default_factory=dict)
    health: BackendHealth | None = None
    counters: Mapping[str, int] = dataclasses.field(default_factory=dict)
    gauges: Mapping[str, int] = dataclasses.field(default_factory=dict)
    backend: BackendView | None = None


def read_engine(agent: MetricsSource) -> EngineSnapshot:
    """The reconciler and backend figures are the engine's last published frame: a scrape runs nothing on
    the engine thread (it used to recompute per-intent figures there, 8 ms at 1,000 intents), and a busy
    engine costs these metrics no more than a frame's age (at most `Engine.refresh_s`)."""
    backend = agent.backend
    view = None if backend is None else BackendView(backend.name, agent.backend_reason, backend.capacity,
                                                    agent.sched_ext_refused, agent.sched_ext_given_up)
    snap = EngineSnapshot(backend=view)
    engine = agent.engine
    if engine is None:
        return snap
    snap.engine = _call(engine.stats, "engine")
    if not engine.running:
        return snap
    frame = engine.feed.latest()
    if frame.version == 0:  # nothing published yet
        return snap
    return EngineSnapshot(snap.engine, frame.reconciler, frame.intents, frame.health, frame.counters,
                          frame.gauges, view)


S = TypeVar("S")


class StatsCollector(Collector, Generic[S]):
    """One component's typed stats turned into its metric families at each scrape, the way
    prometheus_client's own collectors (ProcessCollector, ...) read their source when scraped. `families`
    reads the stats' fields by name: a renamed field is a mypy error, not a series stuck at 0. A component
    whose stats cannot be read costs only its own families."""

    component = ""

    def __init__(self, read: Callable[[], S | None]) -> None:
        self._read = read

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: label values depend on what the component reports

    def collect(self) -> Iterator[Metric]:
        stats = _call(self._read, self.component)
        if stats is not None:
            yield from self.families(stats)

    def families(self, stats: S) -> Iterator[Metric]:
        raise NotImplementedError


class AgentCollector(StatsCollector["AgentStats"]):
    """The agent's own figures: readiness, intents by state, policies handed to the reconciler."""

    component = "agent"

    def families(self, stats: AgentStats) -> Iterator[Metric]:
        yield _gauge("ready", "1 when the agent has loaded its backend and applied its saved intents.",
                     1.0 if stats.ready else 0.0)
        states = dict(stats.intents_by_state)
        for state in ("pending", "applied", "failed", "not_for_this_node"):
            states.setdefault(state, 0)
        yield _labelled(GaugeMetricFamily, "intents", "Intents known to the agent, by state.", "state",
                        states)
        yield _counter("policy_updates_total", "Policy sets handed to the reconciler.",
                       stats.policy_updates)
        yield _counter("policy_build_errors_total", "Intent sets that could not be compiled into a policy.",
                       stats.policy_errors)


class StoreCollector(StatsCollector["StoreStats"]):
    """The intent store (gthulhu_node/intents/store.py): pushes, refusals, deletes, the state file."""

    component = "store"

    def families(self, stats: StoreStats) -> Iterator[Metric]:
        yield _labelled(GaugeMetricFamily, "source_intents", "Accepted intents per source.", "source",
                        stats.intents)
        yield _counter("intent_applies_total", "Intent set pushes accepted (any source).",
                       stats.applies)
        refused = {"stale_generation": stats.refused_stale,
                   "invalid": stats.refused_invalid}
        yield _labelled(CounterMetricFamily, "intent_pushes_refused_total",
                        "Intent set pushes refused, by reason.", "reason", refused)
        yield _counter("intent_deletes_total", "Intent deletions.", stats.deletes)
        yield _counter("state_persist_errors_total", "Failed writes of the intent state file.",
                       stats.persist_errors)
        yield _counter("state_corrupt_files_total", "Corrupt state files moved aside at start.",
                       stats.corrupt_state_files)


class PolicyFilesCollector(StatsCollector["LocalFilesStats"]):
    """The local policy files (gthulhu_node/intents/localfiles.py)."""

    component = "policy-files"

    def families(self, stats: LocalFilesStats) -> Iterator[Metric]:
        yield _gauge("policy_files", "Local policy files read.", float(stats.files))
        yield _gauge("policy_files_invalid", "Local policy files refused now (unreadable, invalid).",
                     float(stats.bad_files))
        yield _counter("policy_file_errors_total", "Times a local policy file was refused.",
                       stats.load_errors)
        yield _counter("policy_reloads_total", "Reloads of the local policy directory.",
                       stats.reloads)
        yield _counter("policy_dir_errors_total", "Looks at the policy directory that failed "
                       "(unreadable or untrusted); its last good content was kept.",
                       stats.dir_errors)
        yield _gauge("policy_dir_unreadable", "1 while the policy directory cannot be read or is not "
                     "trusted (its last good content stays in effect).",
                     float(bool(stats.dir_unreadable)))


class ApiCollector(StatsCollector["ApiStats"]):
    """The gRPC API (gthulhu_node/api/server.py)."""

    component = "api"

    def families(self, stats: ApiStats) -> Iterator[Metric]:
        yield _labelled(CounterMetricFamily, "api_requests_total", "gRPC requests, by method.", "method",
                        stats.requests)
        yield _labelled(CounterMetricFamily, "api_errors_total", "gRPC errors, by status code.", "code",
                        stats.errors)
        yield _gauge("api_watch_streams", "Open WatchStatus streams.", float(stats.watch_streams))


class RestCollector(StatsCollector["RestStats"]):
    """The upstream Decision Maker listener, when enabled: refusals are bad input worth alerting on."""

    component = "rest"

    def families(self, stats: RestStats) -> Iterator[Metric]:
        yield _gauge("rest_insecure", "1 when the REST listener serves plain HTTP (insecure setting on).",
                     1.0 if stats.insecure else 0.0)
        codes = {str(k): v for k, v in stats.requests.items()}
        yield _labelled(CounterMetricFamily, "rest_requests_total", "REST requests, by HTTP status code.",
                        "code", codes)
        tokens = {"issued": stats.tokens_issued, "refused": stats.tokens_refused}
        yield _labelled(CounterMetricFamily, "rest_tokens_total", "Token requests, by outcome.", "outcome",
                        tokens)
        yield _counter("rest_auth_refused_total", "REST requests refused: missing, forged or expired token.",
                       stats.auth_refused)
        pushes = {"accepted": stats.pushes_accepted, "refused": stats.pushes_refused}
        yield _labelled(CounterMetricFamily, "rest_pushes_total", "Manager intent pushes, by outcome.",
                        "outcome", pushes)
        yield _counter("rest_deletes_total", "Manager intent deletions.", stats.deletes)
        yield _counter("rest_connections_refused_total", "Connections closed at once: every slot of the "
                       "peer, or every slot, was serving requests, or the fd reserve was reached.",
                       stats.connections_refused)
        yield _counter("rest_connections_evicted_total", "Unfinished connections (TLS handshake or first "
                       "request head not in) dropped to admit a newer one.", stats.connections_evicted)
        yield _gauge("rest_connections", "Connections held now, handshaking or established.",
                     float(stats.connections_held))
        yield _counter("rest_handshakes_failed_total", "Connections dropped before their TLS handshake and "
                       "first request head were in (deadline, no or bad certificate).",
                       stats.handshakes_failed)
        yield _counter("rest_plain_http_refused_total", "Plain HTTP requests on the mutual-TLS port, "
                       "answered with a 400 naming the settings (a Manager with mTLS off).",
                       stats.plain_http_refused)
        yield _gauge("rest_node_name_mismatch_entries", "Manager entries held that name another node than "
                     "this one (applied all the same: the Manager chose this node; check node.name).",
                     float(stats.node_name_mismatches))
        yield _counter("rest_accept_errors_total", "Failed accepts on the REST port (EMFILE, ...).",
                       stats.accept_errors)
        yield _counter("rest_entries_failed_total", "Manager entries accepted but not honoured (failed; "
                       "see status), per changed push.", stats.entries_failed)
        yield _counter("rest_node_policies_expired_total", "Times node policies were dropped because the "
                       "Manager stopped checking them (it holds none).", stats.node_policies_expired)
        yield _counter("rest_pod_intents_forgotten_total", "Pod intents of an old state file dropped at "
                       "start (the Manager re-pushes them).", stats.pod_intents_forgotten)


class EngineCollector(StatsCollector[EngineSnapshot]):
    """What the engine thread owns, as it last published it together so the figures agree: the engine
    (task events, ejections), the reconciler (scans, entries, writes, per intent) and the backend."""

    component = "engine"

    def families(self, stats: EngineSnapshot) -> Iterator[Metric]:
        yield from self._engine(stats)
        yield from self._backend(stats)

    def _engine(self, snap: EngineSnapshot) -> Iterator[Metric]:
        engine = snap.engine
        if engine is not None:
            yield _gauge("proc_events_available", "1 when the proc connector delivers task events (else "
                         "only periodic scans).", 1.0 if engine.events_available else 0.0)
            yield _counter("proc_events_reopens_total", "Proc connector sockets reopened after an error.",
                           engine.events_reopens)
            yield _counter("engine_wakeups_total", "Engine loop wakeups.", engine.loop_wakeups)
            backend = engine.backend
            yield _counter("scheduler_ejections_total", "Times the kernel removed the scheduler.",
                           backend.ejections)
            yield _counter("scheduler_reloads_total", "Scheduler reloads after an ejection.", backend.reloads)
            yield _counter("scheduler_reload_failures_total", "Failed scheduler reloads.",
                           backend.reload_failures)
            # the backend's tick is one of the periodic hooks (it runs at the supervisor's health check)
            yield _counter("engine_hook_failures_total", "Periodic hooks that raised.",
                           engine.hook_failures + backend.tick_failures)
        stats = snap.reconciler
        if stats is None:
            return
        events = stats.events
        yield _labelled(CounterMetricFamily, "proc_events_total", "Proc connector events handled, by kind.",
                        "kind", events)
        yield _counter("proc_events_lost_total", "Proc connector overruns (ENOBUFS) and socket errors; each "
                       "caused a full rescan.", stats.events_lost)
        yield _counter("proc_event_read_errors_total", "Errors reading the proc connector socket.",
                       stats.event_read_errors)
        yield _counter("scans_total", "Full /proc scans.", stats.scans)
        yield _counter("scans_incomplete_total", "Scans with permission or I/O errors (they never remove "
                       "strategies).", stats.scans_incomplete)
        yield _counter("scan_errors_total", "Permission or I/O errors met during scans.",
                       stats.scan_errors)
        yield _counter("process_owner_read_errors_total", "Reads of a process's cgroup or owner that failed "
                       "(not because it exited); podUID/owner selectors did not match it meanwhile.",
                       stats.owner_read_errors)
        yield SummaryMetricFamily(PREFIX + "scan_duration_seconds", "Duration of full /proc scans.",
                                  count_value=stats.scans,
                                  sum_value=stats.scan_duration_total_s)
        yield _gauge("tasks", "Tasks (threads) currently known.", float(stats.tasks))
        yield _gauge("processes", "Processes currently known.", float(stats.processes))
        yield _counter("tasks_seen_total", "Tasks reported by proc connector events (fork, exec, comm).",
                       sum(v for k, v in events.items() if k in ("fork", "exec", "comm")))
        yield _gauge("matched_tasks_all", "Tasks some intent governs right now (all intents).",
                     float(stats.matched_tasks))
        yield _labelled(GaugeMetricFamily, "backend_entries", "Strategy entries, desired and held by the "
                        "backend.", "table", {"desired": stats.entries_desired,
                                              "applied": stats.entries_applied})
        yield _counter("backend_batches_total", "Batches written to the backend.", stats.batches)
        yield _labelled(CounterMetricFamily, "backend_writes_total", "Entries written to the backend, by "
                        "operation.", "op", {"upsert": stats.upserts,
                                             "delete": stats.deletes})
        failures = int(stats.write_failures)
        full = int(stats.map_full)
        yield _labelled(CounterMetricFamily, "backend_write_failures_total", "Entries the backend refused, "
                        "by reason.", "reason", {"map_full": full, "other": max(0, failures - full)})
        yield _counter("backend_write_retries_total", "Refused entries written again after their backoff "
                       "(not at a full rescan).", stats.write_retries)
        yield _counter("backend_tasks_gone_total", "Writes skipped because the task had exited (normal).",
                       stats.tasks_gone)
        yield _counter("resyncs_total", "Full resynchronisations with the backend.", stats.resyncs)
        per_intent = snap.intents
        yield _labelled(GaugeMetricFamily, "intent_applied_tasks", "Tasks whose strategy is this intent's.",
                        "intent", {k: v.applied_tasks for k, v in per_intent.items()})
        yield _labelled(GaugeMetricFamily, "intent_lost_tasks", "Tasks an intent matches but another "
                        "intent wins (precedence).", "intent",
                        {k: v.lost_tasks for k, v in per_intent.items()})
        yield _labelled(CounterMetricFamily, "intent_write_failures_total", "Entries of an intent the "
                        "backend refused.", "intent",
                        {k: v.write_failures for k, v in per_intent.items()})

    def _backend(self, snap: EngineSnapshot) -> Iterator[Metric]:
        backend = snap.backend
        if backend is None:
            return
        info = InfoMetricFamily(PREFIX + "backend", "The backend in use and why it was chosen.",
                                labels=["kind", "reason"])
        info.add_metric([backend.name, backend.reason], {})
        yield info
        refused = backend.sched_ext_refused
        yield GaugeMetricFamily(PREFIX + "sched_ext_refused",
                                "1 when the kernel refused our sched_ext scheduler and backend auto fell "
                                "back to another backend (the reason is in gthulhu_node_backend_info).",
                                value=1.0 if refused else 0.0)
        given_up = backend.sched_ext_given_up
        yield GaugeMetricFamily(PREFIX + "sched_ext_given_up",
                                "1 when the kernel ejected our sched_ext scheduler scheduler.ejection_limit "
                                "times within scheduler.ejection_window_s and the agent stopped reloading it "
                                "(another backend runs; a restart tries the scheduler again).",
                                value=1.0 if given_up else 0.0)
        # What map use is measured against (the dashboard's gauge, the map-near-full alert): each of the
        # sched_ext scheduler's maps holds scheduler.map_capacity entries. Backends without such a limit
        # (EEVDF, an unbounded dry run) export no capacity.
        capacity = backend.capacity
        if capacity is not None:
            yield _gauge("backend_capacity_entries", "Entries each of the backend's maps holds at most "
                         "(scheduler.map_capacity); compare gthulhu_node_backend_entries{table=\"applied\"}.",
                         float(capacity))
        state = snap.engine.backend.state if snap.engine is not None else ""
        reason = snap.engine.backend.last_ejection_reason if snap.engine is not None else ""
        if snap.health is not None:
            state = snap.health.state.value
            reason = snap.health.reason or reason
        states = GaugeMetricFamily(PREFIX + "scheduler_state",
                                   "1 for the backend's current state (running, stopped, ejected).",
                                   labels=["state"])
        for name in ("running", "stopped", "ejected"):
            states.add_metric([name], 1.0 if state == name else 0.0)
        yield states
        if reason:
            last = InfoMetricFamily(PREFIX + "scheduler_exit", "Why the kernel last removed the scheduler.",
                                    labels=["reason"])
            last.add_metric([reason], {})
            yield last
        if snap.counters:
            yield _labelled(CounterMetricFamily, "scheduler_events_total",
                            "The BPF scheduler's own counters (boosted dispatches, preemptions, ...).",
                            "counter", snap.counters)
        if snap.gauges:
            yield _labelled(GaugeMetricFamily, "scheduler_gauges",
                            "The backend's own current sizes (live map entries, entries held, ...).",
                            "gauge", snap.gauges)


class MatchesCollector(Collector):
    """Per-intent matched tasks and their run-queue wait (sampled at each scrape)."""

    def __init__(self, agent: MetricsSource, runqueue: RunqueueWaitTracker | None) -> None:
        self.agent = agent
        self.runqueue = runqueue

    def collect(self) -> Iterator[Metric]:
        snapshot = _call(self.agent.status, "status")
        per_intent: dict[str, float] = {}
        if snapshot is not None:
            per_intent = {s.key: float(s.matched_tasks) for s in snapshot.intents}
            yield _labelled(GaugeMetricFamily, "matched_tasks", "Tasks an intent matches right now.",
                            "intent", per_intent)
        if self.runqueue is not None:
            matches = _call(self.agent.matches, "matches")
            if matches is not None:
                self.runqueue.sample(matches)
            yield _labelled(CounterMetricFamily, "matched_runqueue_wait_seconds",
                            "Time matched tasks spent waiting on a run queue while matched (schedstat).",
                            "intent", self.runqueue.totals_seconds())


class LogCollector(StatsCollector["LogStats"]):
    """The logging pipeline (gthulhu_node/logs.py): records written and suppressed."""

    component = "logs"

    def families(self, stats: LogStats) -> Iterator[Metric]:
        yield _counter("log_records_total", "Log records written.", stats.records)
        yield _labelled(CounterMetricFamily, "log_records_suppressed_total",
                        "Log records dropped by the per-event rate limit, by event.", "event",
                        stats.suppressed)
        yield _counter("log_send_errors_total", "Journald records that could not be sent.",
                       stats.send_errors)


class CgroupLimitsCollector(StatsCollector["CgroupLimitsStats"]):
    """cgroup v2 cpu.max limits on the node and whether they hold (gthulhu_node/tasks/cgroup_limits.py)."""

    component = "cgroup-limits"

    def families(self, stats: CgroupLimitsStats) -> Iterator[Metric]:
        limited = GaugeMetricFamily(PREFIX + "cgroup_cpu_max_limited",
                                    "Cgroups with a cpu.max quota at the last scan (none while unknown).")
        if stats.limited is not None:
            limited.add_metric([], float(stats.limited))
        yield limited
        yield _gauge("cgroup_cpu_max_enforced", "1 when the running backend leaves cgroup cpu.max to the "
                     "kernel or enforces it itself (sched_ext); 0 while the sched_ext scheduler runs but "
                     "could not track every cgroup (cgroups_untracked: limits may not hold).",
                     1.0 if stats.enforced else 0.0)
        yield _gauge("cgroup_scan_capped", "1 when the last cgroup scan stopped at its cap (the count is a "
                     "lower bound).", 1.0 if stats.capped else 0.0)
        yield _counter("cgroup_scan_errors_total", "Cgroup scans whose root could not be read, plus cgroups "
                       "whose cpu.max could not be read or parsed.", stats.errors)
        yield _counter("cgroup_scans_total", "Walks of the cgroup tree.", stats.scans)


def collectors(agent: MetricsSource, runqueue: RunqueueWaitTracker | None = None,
               log_stats: Callable[[], LogStats] | None = None,
               probe: ContinuousProbe | None = None) -> list[Collector]:
    """One collector per component, each reading that component's typed stats at scrape time (the
    probe's, when the service runs one)."""
    out: list[Collector] = [
        AgentCollector(agent.stats),
        StoreCollector(lambda: agent.stats().store),
        PolicyFilesCollector(lambda: agent.stats().local_files),
        ApiCollector(lambda: agent.stats().api),
        RestCollector(lambda: agent.stats().rest),
        EngineCollector(lambda: read_engine(agent)),
        MatchesCollector(agent, runqueue),
        CgroupLimitsCollector(lambda: agent.stats().cgroup_limits),
    ]
    if log_stats is not None:
        out.append(LogCollector(log_stats))
    if probe is not None:
        from gthulhu_node.probe.continuous import RunqueueLatencyCollector

        out.append(RunqueueLatencyCollector(probe))
    return out


class Metrics:
    """The registry, the per-event histograms and the HTTP endpoint."""

    name = "metrics"  # a lifecycle Component (gthulhu_node/lifecycle.py)

    def __init__(self, listen: str = "") -> None:
        """`listen`: "host:port" of the endpoint `start` opens; empty for none."""
        self.listen = listen
        self.error = ""  # why the endpoint could not be opened
        # node_exporter style: no `_created` series (they double the output and nobody graphs them)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=False)
        self.reaction_latency = Histogram(
            "reaction_latency_seconds", "From a task event (fork, comm, exec) to its entry being written.",
            namespace="gthulhu_node", buckets=REACTION_BUCKETS, registry=self.registry)
        self.runqueue = RunqueueWaitTracker()
        self._server: metrics_server.BoundedMetricsServer | None = None
        self._thread: Spawned | None = None
        self.address: tuple[str, int] | None = None

    def observe_reaction(self, seconds: float) -> None:
        self.reaction_latency.observe(seconds)

    def attach(self, agent: MetricsSource, log_stats: Callable[[], LogStats] | None = None,
               probe: ContinuousProbe | None = None) -> None:
        """One collector per component on this registry (`collectors`), and the endpoint's own."""
        for collector in collectors(agent, self.runqueue, log_stats, probe):
            self.registry.register(collector)
        self.registry.register(_EndpointCollector(self))

    def serve(self, listen: str) -> tuple[str, int] | None:
        """Start the HTTP endpoint on "host:port" ("[::1]:9812" for IPv6); empty means no endpoint."""
        if not listen:
            return None
        host, port = parse_listen(listen)
        self._server, self._thread = metrics_server.serve(host, port, self.registry)
        self.address = (host, int(self._server.server_address[1]))
        return self.address

    def start(self) -> None:
        """Open the endpoint. Never raises: no metrics is bad, no scheduling is worse (logged loudly)."""
        try:
            address = self.serve(self.listen)
        except (OSError, ValueError) as exc:
            self.error = str(exc)
            log.error("metrics_listen_failed", listen=self.listen, error=self.error)
            return
        if address is None:
            log.info("metrics_disabled")
        else:
            log.info("metrics_listening", listen=f"{address[0]}:{address[1]}")

    def stop(self) -> None:
        self.close()

    def health(self) -> Health:
        return Health(not self.error, self.error)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _EndpointCollector(Collector):
    """The endpoint's own admission figures (metrics_server.py, peers.py)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        server = self._metrics._server
        if server is not None:
            yield from peer_families("metrics", server.peer_stats())


def peer_families(listener: str, stats: PeerStats) -> Iterator[Metric]:
    """A listener's admission figures (gthulhu_node/peers.py), as `<listener>_connections_*`."""
    yield _counter(f"{listener}_connections_refused_total", "Connections closed at once: the peer's or every "
                   "slot was serving a request, or the fd reserve was reached.", stats.refused)
    yield _counter(f"{listener}_connections_evicted_total", "Unfinished connections (handshake or request "
                   "head not in) dropped to admit a newer one.", stats.evicted)
    yield _counter(f"{listener}_connections_expired_total", "Unfinished connections dropped at their "
                   "deadline (handshake or request head too slow).", stats.expired)
    yield _gauge(f"{listener}_connections", "Connections held now.", float(stats.held))
    yield _gauge(f"{listener}_connection_peers", "Distinct peers (local users, remote addresses) holding "
                 "them.", float(stats.peers))


def parse_listen(listen: str) -> tuple[str, int]:
    """ "host:port" / "[v6]:port" -> (host, port); raises ValueError naming the setting."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"metrics.listen {listen!r}: expected host:port")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)
