"""Metrics: names, types and values as a Prometheus scrape over HTTP sees them, and the monotonic
run-queue wait counter as tasks come, go and reuse TIDs."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.agent import AgentStats
from gthulhu_node.api.server import ApiStats
from gthulhu_node.backends.base import BackendHealth, BackendState, Entry, EntryKey, KeyKind
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.backends.supervisor import SupervisorStats
from gthulhu_node.engine import EngineStats
from gthulhu_node.feed import EngineFrame, StatusFeed
from gthulhu_node.intents.localfiles import LocalFilesStats
from gthulhu_node.intents.store import StoreStats
from gthulhu_node.logs import LogStats
from gthulhu_node.metrics import (
    AgentCollector,
    ApiCollector,
    BackendView,
    CgroupLimitsCollector,
    EngineCollector,
    EngineSnapshot,
    LogCollector,
    Metrics,
    PolicyFilesCollector,
    RestCollector,
    RunqueueWaitTracker,
    StoreCollector,
    histogram_count,
    histogram_quantile,
    parse_listen,
)
from gthulhu_node.reconciler import ReconcilerStats
from gthulhu_node.rest.stats import RestStats
from gthulhu_node.status_projection import IntentStats
from gthulhu_node.tasks.cgroup_limits import CgroupLimitsStats
from tests.fakecgroup import tree
from tests.prom import Samples, scrape


@dataclass
class Row:
    tid: int
    tgid: int
    intent: str


def write_schedstat(root: Path, tgid: int, tid: int, wait_ns: int) -> None:
    d = root / str(tgid) / "task" / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "schedstat").write_text(f"123 {wait_ns} 7\n")


def test_runqueue_wait_is_monotonic_across_exit_and_tid_reuse(tmp_path: Path) -> None:
    tracker = RunqueueWaitTracker(tmp_path)
    write_schedstat(tmp_path, 10, 11, 1_000)
    write_schedstat(tmp_path, 10, 12, 5_000)
    rows = [Row(11, 10, "local/vllm"), Row(12, 10, "local/vllm")]
    tracker.sample(rows)  # first sight: baseline only
    assert tracker.totals_ns == {"local/vllm": 0}
    write_schedstat(tmp_path, 10, 11, 3_000)
    write_schedstat(tmp_path, 10, 12, 9_000)
    tracker.sample(rows)
    assert tracker.totals_ns["local/vllm"] == 6_000
    (tmp_path / "10" / "task" / "12" / "schedstat").unlink()  # 12 exits: what it contributed stays
    write_schedstat(tmp_path, 10, 11, 4_000)
    tracker.sample(rows)
    assert tracker.totals_ns["local/vllm"] == 7_000
    write_schedstat(tmp_path, 20, 11, 500)  # TID 11 reused by another process: lower value, new baseline
    tracker.sample([Row(11, 20, "local/vllm")])
    assert tracker.totals_ns["local/vllm"] == 7_000
    write_schedstat(tmp_path, 20, 11, 2_500)
    tracker.sample([Row(11, 20, "local/other")])  # moved to another intent: the growth goes there
    assert tracker.totals_ns == {"local/vllm": 7_000, "local/other": 2_000}
    assert tracker.totals_seconds()["local/other"] == pytest.approx(2e-6)


def test_runqueue_wait_from_real_schedstat() -> None:
    """A thread of ours that waits behind busy siblings accumulates run-queue wait from the real /proc."""
    stop = threading.Event()
    ready = threading.Event()
    tid: list[int] = []

    def worker() -> None:
        tid.append(threading.get_native_id())
        ready.set()
        while not stop.is_set():
            sum(range(1000))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    ready.wait()
    tracker = RunqueueWaitTracker()
    rows = [Row(t, os.getpid(), "test/busy") for t in tid]
    tracker.sample(rows)
    before = dict(tracker._last)
    stop.wait(0.5)
    tracker.sample(rows)
    stop.set()
    for t in threads:
        t.join()
    assert set(before) == set(tid)
    assert tracker.totals_ns["test/busy"] == sum(tracker._last[t][1] - before[t][1] for t in tid)
    assert tracker.totals_ns["test/busy"] > 0  # 4 busy threads (plus the GIL) on at most 2 CPUs must wait


@dataclass
class FakeIntentStatus:
    key: str
    matched_tasks: int


@dataclass
class FakeSnapshot:
    intents: tuple[FakeIntentStatus, ...]


def agent_stats() -> AgentStats:
    """The agent's real stats types, so a renamed field fails here as it fails mypy in metrics.py."""
    return AgentStats(
        ready=True,
        store=StoreStats(applies=3, refused_stale=1, refused_invalid=2, intents={"local": 1}),
        intents_by_state={"applied": 1},
        local_files=LocalFilesStats(files=1, bad_files=1, reloads=2, load_errors=4),
        rest=RestStats(insecure=True, requests={"200": 3, "401": 2}, tokens_issued=1, auth_refused=2,
                       pushes_refused=1),
    )


class FakeBackend(DryRunBackend):
    name = "sched_ext"

    def health(self) -> BackendHealth:
        return BackendHealth(BackendState.RUNNING)

    def counters(self) -> dict[str, int]:
        return {"boosted_dispatches": 17}


class FakeReconciler:
    backend = FakeBackend()

    def stats(self) -> ReconcilerStats:
        return ReconcilerStats(events={"fork": 5, "comm": 2, "exec": 1, "exit": 4}, events_lost=1, scans=3,
                               scan_duration_total_s=0.3, tasks=40, upserts=7, deletes=2, write_failures=3,
                               map_full=1, matched_tasks=2)

    def intent_stats(self) -> dict[str, IntentStats]:
        return {"local/vllm": IntentStats("local/vllm", applied_tasks=2)}


class FakeEngine:
    """Publishes a frame of its reconciler's and backend's figures when its feed is read, as the real
    engine publishes one when they change (gthulhu_node/feed.py); collectors read only the feed."""

    running = True
    reconciler = FakeReconciler()

    def __init__(self) -> None:
        self._feed = StatusFeed()

    @property
    def feed(self) -> StatusFeed:
        r, b = self.reconciler, self.reconciler.backend
        self._feed.publish(EngineFrame(self._feed.latest().version + 1, 0.0, True, r.stats(),
                                       r.intent_stats(), {}, b.health(), b.counters(), b.gauges()))
        return self._feed

    def stats(self) -> EngineStats:
        backend = SupervisorStats(state="running", ejections=1, reloads=2, reload_failures=3, tick_failures=4)
        return EngineStats(events_available=True, hook_failures=1, backend=backend)


class FakeAgent:
    backend = FakeReconciler.backend
    backend_reason = "the kernel has sched_ext"
    sched_ext_refused = ""
    sched_ext_given_up = ""
    engine = FakeEngine()

    def stats(self) -> AgentStats:
        return agent_stats()

    def status(self) -> FakeSnapshot:
        return FakeSnapshot((FakeIntentStatus("local/vllm", 2),))

    def matches(self) -> list[Row]:
        return [Row(os.getpid(), os.getpid(), "local/vllm")]


def scrape_of(metrics: Metrics) -> Samples:
    assert metrics.address is not None
    return scrape(*metrics.address)


def test_scrape_over_http_shows_component_stats() -> None:
    metrics = Metrics()
    metrics.attach(FakeAgent())
    assert metrics.serve("127.0.0.1:0") is not None
    try:
        metrics.observe_reaction(0.0015)
        got = scrape_of(metrics)
    finally:
        metrics.close()
    assert all(name.startswith("gthulhu_node_") for name in got)
    assert got["gthulhu_node_matched_tasks"][(("intent", "local/vllm"),)] == 2
    assert got["gthulhu_node_intents"][(("state", "applied"),)] == 1
    assert got["gthulhu_node_intents"][(("state", "failed"),)] == 0
    assert got["gthulhu_node_intent_pushes_refused_total"][(("reason", "invalid"),)] == 2
    assert got["gthulhu_node_policy_file_errors_total"][()] == 4
    assert got["gthulhu_node_proc_events_lost_total"][()] == 1
    assert got["gthulhu_node_proc_events_total"][(("kind", "fork"),)] == 5
    assert got["gthulhu_node_backend_writes_total"][(("op", "upsert"),)] == 7
    assert got["gthulhu_node_backend_write_failures_total"][(("reason", "map_full"),)] == 1
    assert got["gthulhu_node_backend_write_failures_total"][(("reason", "other"),)] == 2
    assert got["gthulhu_node_scan_duration_seconds_count"][()] == 3
    assert got["gthulhu_node_scan_duration_seconds_sum"][()] == pytest.approx(0.3)
    info = (("kind", "sched_ext"), ("reason", "the kernel has sched_ext"))
    assert got["gthulhu_node_backend_info"][info] == 1
    assert got["gthulhu_node_scheduler_state"][(("state", "running"),)] == 1
    assert got["gthulhu_node_scheduler_ejections_total"][()] == 1
    assert got["gthulhu_node_scheduler_reloads_total"][()] == 2
    assert got["gthulhu_node_scheduler_reload_failures_total"][()] == 3
    assert got["gthulhu_node_engine_hook_failures_total"][()] == 1 + 4  # hooks + ticks
    assert got["gthulhu_node_intent_applied_tasks"][(("intent", "local/vllm"),)] == 2
    assert got["gthulhu_node_scheduler_events_total"][(("counter", "boosted_dispatches"),)] == 17
    assert got["gthulhu_node_reaction_latency_seconds_bucket"][(("le", "0.002"),)] == 1
    assert got["gthulhu_node_reaction_latency_seconds_bucket"][(("le", "0.001"),)] == 0
    assert (("intent", "local/vllm"),) in got["gthulhu_node_matched_runqueue_wait_seconds_total"]
    assert got["gthulhu_node_ready"][()] == 1
    assert got["gthulhu_node_rest_insecure"][()] == 1
    assert got["gthulhu_node_rest_requests_total"][(("code", "401"),)] == 2
    assert got["gthulhu_node_rest_auth_refused_total"][()] == 2
    assert got["gthulhu_node_rest_pushes_total"][(("outcome", "refused"),)] == 1


class BrokenAgent(FakeAgent):
    def status(self) -> FakeSnapshot:
        raise RuntimeError("boom")


def scrape_agent(agent: Any) -> tuple[Metrics, Samples]:
    """One scrape over HTTP of a Metrics attached to `agent`."""
    metrics = Metrics()
    metrics.attach(agent)
    metrics.serve("127.0.0.1:0")
    try:
        return metrics, scrape_of(metrics)
    finally:
        metrics.close()


def test_a_failing_component_costs_only_its_own_metrics() -> None:
    _, got = scrape_agent(BrokenAgent())
    assert "gthulhu_node_matched_tasks" not in got
    assert got["gthulhu_node_ready"][()] == 1


def test_empty_listen_means_no_endpoint() -> None:
    assert Metrics().serve("") is None


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:9812") == ("127.0.0.1", 9812)
    assert parse_listen("[::1]:9812") == ("::1", 9812)
    with pytest.raises(ValueError, match=r"metrics\.listen"):
        parse_listen("localhost")


class DryRunReconciler(FakeReconciler):
    backend = DryRunBackend()


class DryRunEngine(FakeEngine):
    reconciler = DryRunReconciler()


class DryRunAgent(FakeAgent):
    backend = DryRunReconciler.backend
    engine = DryRunEngine()


def family_types(metrics: Metrics) -> dict[str, str]:
    return {f.name: f.type for f in metrics.registry.collect()}


def test_backend_sizes_are_gauges_and_counter_families_hold_only_counters() -> None:
    """A backend's current sizes (the dry run's entries, the scheduler's live map entries) go up and down:
    inside a counter family, rate() would read every shrink as a reset."""
    from gthulhu_node.scheduler.layout import STAT_COUNTERS, STAT_GAUGES, GthulhuBss, GthulhuCounters

    backend = DryRunReconciler.backend
    backend.start()
    backend.apply({EntryKey(KeyKind.TID, 7): Entry(5, 0, 1), EntryKey(KeyKind.TID, 8): Entry(5, 0, 1)}, [])
    try:
        metrics, got = scrape_agent(DryRunAgent())
    finally:
        backend.stop()
    assert (("counter", "entries"),) not in got["gthulhu_node_scheduler_events_total"]
    assert got["gthulhu_node_scheduler_events_total"][(("counter", "batches"),)] == 1
    assert got["gthulhu_node_scheduler_gauges"][(("gauge", "entries"),)] == 2
    assert family_types(metrics)["gthulhu_node_scheduler_gauges"] == "gauge"
    assert set(STAT_GAUGES) == {"live_tid_entries", "live_tgid_entries"}
    assert not set(STAT_GAUGES) & set(STAT_COUNTERS)
    # the scheduler keeps them apart: counters per CPU in their own map, gauges in .bss
    assert [name for name, _ in GthulhuCounters._fields_] == list(STAT_COUNTERS)
    assert [name for name, _ in GthulhuBss._fields_[0][1]._fields_] == list(STAT_GAUGES)


class Recorder:
    """Stands in for a stats object and records which fields a collector reads."""

    def __init__(self, real: object) -> None:
        self.__dict__["_real"] = real
        self.__dict__["read"] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._real, name)


def unread(real: Any, families: Callable[[Any], Any]) -> set[str]:
    rec = Recorder(real)
    list(families(rec))
    return {f.name for f in dataclasses.fields(real)} - rec.read


# Fields of the components' stats that no collector exports, by name. A field added or renamed lands here
# by failing the test below: export it, or list it with the reason.
NOT_EXPORTED: dict[str, set[str]] = {
    "agent": {"store", "local_files", "api", "rest", "cgroup_limits",  # their own collectors read them
              "matched_tasks"},  # the reconciler's matched_tasks_all is the same figure
    "store": {"applies_unchanged", "loaded_intents", "persist_writes"},
    "engine": {"submitted"},
    "supervisor": {"gave_up_reason"},  # status and sched_ext_given_up
    "reconciler": {"policy_updates", "scan_duration_last_s", "tasks_vanished"},
}


def test_each_collector_reads_every_field_of_its_component_stats() -> None:
    """One collector per component, each reading its typed stats by field name: a field renamed in the
    stats (and not in the collector) is a mypy error, and one added without its metric fails here."""
    assert unread(AgentStats(), AgentCollector(lambda: None).families) == NOT_EXPORTED["agent"]
    assert unread(StoreStats(), StoreCollector(lambda: None).families) == NOT_EXPORTED["store"]
    assert unread(LocalFilesStats(), PolicyFilesCollector(lambda: None).families) == set()
    assert unread(ApiStats(), ApiCollector(lambda: None).families) == set()
    assert unread(RestStats(), RestCollector(lambda: None).families) == set()
    assert unread(LogStats(), LogCollector(lambda: None).families) == set()
    assert unread(CgroupLimitsStats(), CgroupLimitsCollector(lambda: None).families) == set()
    supervisor = Recorder(SupervisorStats())
    engine = Recorder(EngineStats(backend=supervisor))  # type: ignore[arg-type]
    reconciler = Recorder(ReconcilerStats())
    backend = Recorder(BackendView("dry-run", "given", 8, "", ""))
    snap = EngineSnapshot(engine, reconciler, {}, None, {}, {}, backend)  # type: ignore[arg-type]
    list(EngineCollector(lambda: None).families(snap))
    fields = {name: {f.name for f in dataclasses.fields(cls)}
              for name, cls in (("engine", EngineStats), ("reconciler", ReconcilerStats),
                                ("backend", BackendView), ("supervisor", SupervisorStats))}
    assert fields["engine"] - engine.read == NOT_EXPORTED["engine"]
    assert fields["supervisor"] - supervisor.read == NOT_EXPORTED["supervisor"]
    assert fields["reconciler"] - reconciler.read == NOT_EXPORTED["reconciler"]
    assert fields["backend"] - backend.read == set()


def test_every_family_from_a_real_agent_has_samples(tmp_path: Path) -> None:
    """A real agent (dry-run backend) with one intent governing this process and one refused gRPC call:
    each family its collectors export carries at least one sample, read from the real components."""
    import grpc

    from gthulhu_node.agent import Agent
    from gthulhu_node.api.client import Target, stub
    from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
    from gthulhu_node.config import AgentConfig
    from gthulhu_node.intents.parse import parse_intent

    cfg = AgentConfig.model_validate({
        "state": {"directory": str(tmp_path / "state")},
        "policies": {"directory": str(tmp_path / "policies")},
        "api": {"socket": str(tmp_path / "api.sock")},
        "watch": {"cgroup_root": str(tree(tmp_path / "cgroup"))},  # the host's may be cgroup v1: unknown
    })
    agent = Agent(cfg, backend=DryRunBackend())
    agent.start()
    try:
        me = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        agent.store.apply("test", 1, [parse_intent({"id": "me", "commandRegex": f"^{me}$", "priority": 5})])
        agent.sync()
        channel, client = stub(Target(cfg.api.socket, None, None, None, None, None))
        with channel, pytest.raises(grpc.RpcError):
            client.DeleteIntent(pb.DeleteIntentRequest(source="test", id="nobody"), timeout=5)
        metrics = Metrics()
        metrics.attach(agent, log_stats=lambda: LogStats(records=1, suppressed={"x": 1}))
        families = {f.name: f for f in metrics.registry.collect()}
    finally:
        agent.stop()
    empty = sorted(name for name, f in families.items() if not f.samples)
    assert empty == []
    assert {"gthulhu_node_source_intents", "gthulhu_node_policy_files", "gthulhu_node_api_errors",
            "gthulhu_node_proc_events", "gthulhu_node_backend", "gthulhu_node_matched_tasks",
            "gthulhu_node_log_records"} <= set(families)
    codes = {s.labels["code"] for s in families["gthulhu_node_api_errors"].samples}
    assert codes == {"NOT_FOUND"}


def test_status_metrics_and_matches_run_nothing_on_the_engine_thread(tmp_path: Path) -> None:
    """Status is produced by the engine (gthulhu_node/feed.py), not pulled from it: a metrics scrape, the
    status rows, the matches and the systemd summary of a real agent submit no work to its engine (each
    used to recompute per-intent figures or task rows there, 8 ms a scrape at 1,000 intents), and still
    show the intent governing this thread."""
    from gthulhu_node.agent import Agent
    from gthulhu_node.config import AgentConfig
    from gthulhu_node.intents.parse import parse_intent

    cfg = AgentConfig.model_validate({
        "state": {"directory": str(tmp_path / "state")},
        "policies": {"directory": str(tmp_path / "policies")},
        "api": {"socket": str(tmp_path / "api.sock")},
        "watch": {"cgroup_root": str(tree(tmp_path / "cgroup"))},
    })
    agent = Agent(cfg, backend=DryRunBackend())
    agent.start()
    try:
        me = threading.get_native_id()
        comm = Path(f"/proc/self/task/{me}/comm").read_text().strip()
        agent.store.apply("test", 1, [parse_intent({"id": "me", "commandRegex": f"^{comm}$", "priority": 5})])
        agent.sync()
        assert agent.engine is not None
        submitted = agent.engine.stats().submitted
        metrics = Metrics()
        metrics.attach(agent)
        families = {f.name: f for f in metrics.registry.collect()}
        agent.refresh_status()
        snapshot = agent.status()
        rows = agent.matches("test/me")
        summary = agent.summary()
        assert agent.engine.stats().submitted == submitted
    finally:
        agent.stop()
    applied = {s.labels["intent"]: s.value for s in families["gthulhu_node_intent_applied_tasks"].samples}
    assert applied["test/me"] >= 1
    [status] = [s for s in snapshot.intents if s.key == "test/me"]
    assert status.state.value == "applied" and status.matched_tasks >= 1
    assert me in {r.tid for r in rows}
    assert "1 applied" in summary


def test_p50_and_p99_are_read_from_the_reaction_histogram() -> None:
    """The histogram is the only record of reaction latency; quantiles come from its buckets as PromQL's
    histogram_quantile computes them (linear within a bucket)."""
    metrics = Metrics()
    assert histogram_quantile(metrics.reaction_latency, 0.5) == 0.0
    for seconds in [0.0003] * 50 + [0.0015] * 49 + [0.03]:
        metrics.observe_reaction(seconds)
    assert histogram_count(metrics.reaction_latency) == 100
    assert histogram_quantile(metrics.reaction_latency, 0.50) == pytest.approx(0.0005)
    assert histogram_quantile(metrics.reaction_latency, 0.99) == pytest.approx(0.002)
    assert histogram_quantile(metrics.reaction_latency, 1.0) == pytest.approx(0.05)
