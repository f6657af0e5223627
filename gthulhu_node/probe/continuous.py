"""The probe inside the agent (config `probe.enabled`): per-intent histograms exported to Prometheus.

It runs in its own thread and never takes the agent down: if BCC, root or the kernel headers are missing,
it logs `probe_unavailable` with the one-line reason, exports `gthulhu_node_probe_up 0`, and stops. When it
runs, the in-kernel filter follows the agent's matches every `probe.poll_interval_s`, and each scrape
reads the per-intent log2 histograms as `gthulhu_node_runqueue_wait_latency_seconds{intent}` (cumulative
since the probe started; an intent's series restarts if its index had to be reused). Per-thread
histograms are not kept in this mode, so exited threads leave nothing behind in the kernel.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from gthulhu_node.lifecycle import Health
from gthulhu_node.probe.preflight import ProbeUnavailable
from gthulhu_node.probe.targets import Target
from gthulhu_node.workers import Flag, WorkerThread, WorkQueue

if TYPE_CHECKING:  # the session and BCC are imported when the probe thread starts
    from gthulhu_node.probe.histogram import WaitHistogram
    from gthulhu_node.probe.session import Session

log = structlog.get_logger(__name__)

METRIC = "gthulhu_node_runqueue_wait_latency_seconds"
# Bucket tops 2^k ns for k in this range: 1.024 us .. 17.2 s, then +Inf.
BUCKET_SLOTS = range(10, 35)


class MatchedTask(Protocol):
    """What the probe reads of a match (intents.status.MatchRow; read-only, as the frozen row is)."""

    @property
    def tid(self) -> int: ...
    @property
    def tgid(self) -> int: ...
    @property
    def comm(self) -> str: ...
    @property
    def intent(self) -> str: ...


class MatchesTargets:
    """A target source over a callable returning the agent's matches (Agent.matches)."""

    def __init__(self, matches: Callable[[], Iterable[MatchedTask]]) -> None:
        self._matches = matches
        self.errors = 0

    def poll(self) -> dict[int, Target]:
        return {m.tid: Target(m.tid, m.tgid, m.comm, m.intent) for m in self._matches()}

    def close(self) -> None:
        pass


@dataclass
class ProbeStats:
    up: bool
    state: str  # starting, running, unavailable, failed, stopped
    reason: str
    tracked_threads: int
    syncs: int
    sync_errors: int
    map_full_errors: int


class ContinuousProbe:
    """Owns the probe thread. `start()` returns at once; compiling takes seconds (13 s in the lab VM)."""

    def __init__(self, matches: Callable[[], Iterable[MatchedTask]], poll_interval_s: float = 1.0) -> None:
        self._source = MatchesTargets(matches)
        self._poll = poll_interval_s
        self._lock = threading.Lock()
        self._worker = WorkerThread("runqueue-probe", self._run, join_timeout_s=10.0)
        self._session: Session | None = None
        self.state = "starting"
        self.reason = ""
        self.syncs = 0
        self.sync_errors = 0

    name = "probe"  # a lifecycle Component (gthulhu_node/lifecycle.py)

    def health(self) -> Health:
        """A probe that cannot run is reported, never fatal: the agent goes on without it."""
        return Health(self.state in ("starting", "running"), self.reason)

    def start(self) -> None:
        self._worker.start()

    def stop(self) -> None:
        self._worker.stop()

    def _run(self, stop: Flag) -> None:
        """The `runqueue-probe` thread: compile and attach (seconds), then sync the probe's targets with the
        agent's matches at once and every poll interval until stopped."""
        from gthulhu_node.probe.loader import RunqueueProbe
        from gthulhu_node.probe.session import Session

        try:
            probe = RunqueueProbe(per_thread=False)
        except ProbeUnavailable as exc:
            self.state, self.reason = "unavailable", str(exc)
            log.warning("probe_unavailable", reason=str(exc))
            return
        except Exception as exc:  # anything else from BCC: the agent goes on without the probe
            self.state, self.reason = "failed", f"{type(exc).__name__}: {exc}"
            log.error("probe_failed", error=self.reason, exc_info=True)
            return
        with self._lock:
            self._session = Session(probe, self._source)
            self.state = "running"
        log.info("probe_started", poll_interval_s=self._poll)
        syncs = WorkQueue(period_s=self._poll)
        syncs.wake()  # the first sync at once
        try:
            syncs.serve(stop, self._sync)
        finally:
            with self._lock:
                self._session = None
                self.state = "stopped"
            probe.close()
            log.info("probe_stopped")

    def _sync(self) -> None:
        try:
            with self._lock:
                assert self._session is not None
                self._session.sync()
            self.syncs += 1
        except Exception as exc:  # a failing matches() call must not end the probe
            self.sync_errors += 1
            log.warning("probe_sync_failed", error=str(exc))

    def histograms(self) -> dict[str, WaitHistogram]:
        """intent key -> WaitHistogram, cumulative since start; empty when not running."""
        with self._lock:
            session = self._session
            if session is None:
                return {}
            by_index = session.probe.intent_histograms()
            return {key: by_index[idx] for key, idx in session.intent_index.items() if idx in by_index}

    def stats(self) -> ProbeStats:
        with self._lock:
            session = self._session
            tracked = len(session.records) if session is not None else 0
            full = session.probe.map_full_errors if session is not None else 0
        return ProbeStats(self.state == "running", self.state, self.reason, tracked, self.syncs,
                          self.sync_errors, full)


class RunqueueLatencyCollector(Collector):
    """Exports the probe's per-intent log2 histograms as a Prometheus histogram, read at scrape time."""

    def __init__(self, probe: ContinuousProbe) -> None:
        self.probe = probe

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            METRIC, "Run-queue wait of the threads each intent governs (wakeup or preemption to running), "
            "from the in-kernel BCC probe; buckets are powers of two nanoseconds.", labels=["intent"])
        try:
            hists = self.probe.histograms()
        except Exception as exc:  # a scrape must never fail because of the probe
            log.warning("probe_scrape_failed", error=str(exc))
            hists = {}
        for intent, hist in sorted(hists.items()):
            cumulative = hist.cumulative_buckets(BUCKET_SLOTS)
            buckets = [("+Inf" if math.isinf(le) else repr(le), float(n)) for le, n in cumulative]
            family.add_metric([intent], buckets, sum_value=hist.sum_ns / 1e9)
        yield family
        stats = self.probe.stats()
        yield GaugeMetricFamily("gthulhu_node_probe_up", "1 while the run-queue probe runs; 0 when it "
                                "could not start (reason in the log event probe_unavailable).",
                                value=1.0 if stats.up else 0.0)
        yield GaugeMetricFamily("gthulhu_node_probe_tracked_threads", "Threads in the probe's kernel filter.",
                                value=stats.tracked_threads)
        yield CounterMetricFamily("gthulhu_node_probe_target_map_full", "Threads the probe could not track "
                                  "because its kernel map was full.", value=stats.map_full_errors)

