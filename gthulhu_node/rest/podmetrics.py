"""Upstream's `gthulhu_pod_*` metrics, for the Manager's pod metrics page and its adaptive clustering.

The Manager scrapes `GET /metrics` of every Decision Maker every 10 s and keeps the families it knows,
keyed by the labels `pod_name`, `namespace` (and `node_name`) (Gthulhu/Gthulhu@c969a96b,
api/manager/client/deicison_maker_metrics.go; the names and labels are upstream's
api/decisionmaker/service/pod_metric_collector.go). We compute them from what we measure: the tasks the
pod's intents govern right now (the reconciler's matches), and each task's own
/proc/<tgid>/task/<tid>/schedstat (run time, run-queue wait, times run), status (context switches) and
sched (`se.nr_migrations`: moves to another CPU, counted by the kernel for every scheduling class).
Upstream sums every process of the pod but its pause container; we sum the tasks the intents govern,
thread by thread. What we cannot measure is absent, never 0: the SMT/L3/NUMA migration families, and
`cpu_migrations` of a pod one of whose tasks has no readable `sched` file (a kernel without
CONFIG_SCHED_DEBUG); a pod none of whose tasks is governed now has no series (upstream: a pod without
processes has none either).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gthulhu_node.intents.model import intent_key
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.rest.translate import pod_record_of

LABELS = ["pod_name", "pod_uid", "namespace", "node_name"]


class Governed(Protocol):
    """A task an intent governs (Agent.matches() rows)."""

    @property
    def tid(self) -> int: ...

    @property
    def tgid(self) -> int: ...

    @property
    def intent(self) -> str: ...


@dataclass(frozen=True, slots=True)
class PodTarget:
    """The pod an intent belongs to, as the Manager named it."""

    pod_name: str
    pod_uid: str
    namespace: str
    node_name: str

    def labels(self) -> list[str]:
        return [self.pod_name, self.pod_uid, self.namespace, self.node_name]


@dataclass(slots=True)
class _Sums:
    cpu_ns: int = 0
    wait_ns: int = 0
    runs: int = 0
    voluntary: int = 0
    involuntary: int = 0
    migrations: int | None = 0  # None once a task's count could not be read
    tgids: set[int] = field(default_factory=set)


def _task_figures(proc_root: Path, tgid: int, tid: int) -> tuple[int, int, int, int, int] | None:
    base = proc_root / str(tgid) / "task" / str(tid)
    try:
        cpu, wait, runs = (int(v) for v in (base / "schedstat").read_text().split()[:3])
        status = (base / "status").read_text()
    except (OSError, ValueError):
        return None  # the task exited between the match and now
    switches = {k: int(v) for k, _, v in (line.partition(":\t") for line in status.splitlines())
                if k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches") and v.strip().isdigit()}
    return cpu, wait, runs, switches.get("voluntary_ctxt_switches", 0), \
        switches.get("nonvoluntary_ctxt_switches", 0)


def _migrations(proc_root: Path, tgid: int, tid: int) -> int | None:
    """`se.nr_migrations` of /proc/<tgid>/task/<tid>/sched, None when it cannot be read."""
    try:
        text = (proc_root / str(tgid) / "task" / str(tid) / "sched").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "se.nr_migrations" and value.strip().isdigit():
            return int(value.strip())
    return None


class PodMetrics(Collector):
    """One scrape: the governed tasks of every pod intent, summed per pod."""

    def __init__(self, targets: Mapping[str, PodTarget], governed: Iterable[Governed],
                 proc_root: Path = Path("/proc")) -> None:
        """`targets`: intent key (`manager-pods/<id>`) -> its pod."""
        self._targets = targets
        self._governed = list(governed)
        self._proc_root = proc_root

    def _sums(self) -> dict[PodTarget, _Sums]:
        out: dict[PodTarget, _Sums] = {}
        for row in self._governed:
            pod = self._targets.get(row.intent)
            figures = _task_figures(self._proc_root, row.tgid, row.tid) if pod is not None else None
            if pod is None or figures is None:
                continue
            sums = out.setdefault(pod, _Sums())
            sums.cpu_ns += figures[0]
            sums.wait_ns += figures[1]
            sums.runs += figures[2]
            sums.voluntary += figures[3]
            sums.involuntary += figures[4]
            moved = _migrations(self._proc_root, row.tgid, row.tid)
            sums.migrations = None if moved is None or sums.migrations is None else sums.migrations + moved
            sums.tgids.add(row.tgid)
        return out

    def collect(self) -> Iterable[Metric]:
        sums = self._sums()
        families: list[tuple[str, str, str]] = [
            ("cpu_time_nanoseconds", "cpu_ns", "CPU time of the pod's governed tasks (schedstat), ns."),
            ("wait_time_nanoseconds", "wait_ns", "Run-queue wait of the pod's governed tasks, ns."),
            ("run_count", "runs", "Times the pod's governed tasks were scheduled on a CPU (schedstat)."),
            ("voluntary_ctx_switches", "voluntary", "Voluntary context switches of its governed tasks."),
            ("involuntary_ctx_switches", "involuntary",
             "Involuntary context switches of its governed tasks."),
        ]
        for name, attr, doc in families:
            counter = CounterMetricFamily(f"gthulhu_pod_{name}", doc, labels=LABELS)
            for pod, s in sorted(sums.items(), key=lambda kv: kv[0].labels()):
                counter.add_metric(pod.labels(), float(getattr(s, attr)))
            yield counter
        moves = CounterMetricFamily("gthulhu_pod_cpu_migrations", "Moves of the pod's governed tasks to "
                                    "another CPU (se.nr_migrations).", labels=LABELS)
        for pod, s in sorted(sums.items(), key=lambda kv: kv[0].labels()):
            if s.migrations is not None:
                moves.add_metric(pod.labels(), float(s.migrations))
        yield moves
        gauge = GaugeMetricFamily("gthulhu_pod_process_count", "Processes with a governed task in the pod.",
                                  labels=LABELS)
        for pod, s in sorted(sums.items(), key=lambda kv: kv[0].labels()):
            gauge.add_metric(pod.labels(), float(len(s.tgids)))
        yield gauge


def render(targets: Mapping[str, PodTarget], governed: Iterable[Governed],
           proc_root: Path = Path("/proc")) -> bytes:
    """Prometheus text of the pod metrics."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(PodMetrics(targets, governed, proc_root))
    return generate_latest(registry)


def manager_pods_text(source: str, current: SourceSet | None, governed: Callable[[], Iterable[Governed]],
                      node_name: str, proc_root: Path = Path("/proc")) -> bytes:
    """The pod metrics of the Manager's pod intents (`current`: the store's `source`, `manager-pods`): one
    target per intent, labelled from its pushed record (the node's own name when it names none); the
    governed tasks are read only when there is a target."""
    targets: dict[str, PodTarget] = {}
    for entry in current.entries if current is not None else ():
        if entry.intent_id:
            rec = pod_record_of(entry)
            targets[intent_key(source, entry.intent_id)] = PodTarget(
                rec.pod_name, rec.pod_id, rec.namespace, rec.node_id or node_name
            )
    return render(targets, governed() if targets else (), proc_root)
