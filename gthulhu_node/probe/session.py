"""One measurement: keep the kernel's target map in step with a target source, then read the results.

The kernel side only knows tid -> intent index; the names (intent keys, comm, tgid) and the history of the
filter (when each thread was added and removed) live here.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from gthulhu_node.probe.histogram import WaitHistogram
from gthulhu_node.probe.loader import MAX_INTENTS, RunqueueProbe
from gthulhu_node.probe.preflight import ProbeUnavailable
from gthulhu_node.probe.targets import Target, TargetSource
from gthulhu_node.workers import Flag, WorkerThread, WorkQueue

log = structlog.get_logger(__name__)

METHOD = "log2 histograms of run-queue wait (wakeup or preemption -> running); percentiles interpolated " \
    "linearly within a power-of-two bucket, so each is exact to within a factor of two"


@dataclass
class ThreadRecord:
    """A thread the probe measured at some point of the session, with its place in the filter over time."""

    target: Target
    added_s: float
    removed_s: float | None = None
    dropped: bool = False  # the target map was full


@dataclass
class ProbeResult:
    duration_s: float
    intents: dict[str, WaitHistogram]
    threads: list[tuple[ThreadRecord, WaitHistogram]]
    tids_at_end: list[int]
    filter_added: int
    filter_removed: int
    map_full_errors: int
    source_errors: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "method": METHOD,
            "duration_s": round(self.duration_s, 3),
            "intents": [
                {"intent": key, "threads": sum(1 for r, _ in self.threads if r.target.intent == key)}
                | hist.summary()
                for key, hist in sorted(self.intents.items())
            ],
            "threads": [
                {
                    "tid": r.target.tid,
                    "tgid": r.target.tgid,
                    "comm": r.target.comm,
                    "intent": r.target.intent,
                    "added_s": round(r.added_s, 3),
                    "removed_s": None if r.removed_s is None else round(r.removed_s, 3),
                }
                | hist.summary()
                for r, hist in self.threads
            ],
            "filter": {
                "tids_at_end": self.tids_at_end,
                "added": self.filter_added,
                "removed": self.filter_removed,
                "map_full_errors": self.map_full_errors,
                "source_errors": self.source_errors,
            },
        }


@dataclass
class Session:
    """Drives one RunqueueProbe from one TargetSource. Call `sync()` every poll interval."""

    probe: RunqueueProbe
    source: TargetSource
    started: float = field(default_factory=time.monotonic)
    intent_index: dict[str, int] = field(default_factory=dict)
    records: dict[int, ThreadRecord] = field(default_factory=dict)
    history: list[ThreadRecord] = field(default_factory=list)
    added: int = 0
    removed: int = 0

    def _index(self, intent: str) -> int | None:
        idx = self.intent_index.get(intent)
        if idx is not None:
            return idx
        if len(self.intent_index) < MAX_INTENTS:
            idx = self.intent_index[intent] = len(self.intent_index)
            return idx
        # Full (a long-running agent sees intents come and go): reuse the index of one with no thread now.
        in_use = {rec.target.intent for rec in self.records.values()}
        idle = next((key for key in self.intent_index if key not in in_use), None)
        if idle is None:
            log.warning("probe_too_many_intents", intent=intent, limit=MAX_INTENTS)
            return None
        idx = self.intent_index.pop(idle)
        self.probe.clear_intent(idx)
        self.intent_index[intent] = idx
        return idx

    def sync(self) -> None:
        """Bring the kernel's target map to what the source wants now."""
        want = self.source.poll()
        now = time.monotonic() - self.started
        for tid, rec in list(self.records.items()):
            target = want.get(tid)
            if target is None or target.intent != rec.target.intent or target.tgid != rec.target.tgid:
                self.probe.remove_target(tid)
                rec.removed_s = now
                del self.records[tid]
                self.removed += 1
        for tid, target in want.items():
            if tid in self.records:
                self.records[tid].target = target  # a rename keeps its place in the filter
                continue
            idx = self._index(target.intent)
            if idx is None:
                continue
            rec = ThreadRecord(target, now)
            if not self.probe.add_target(tid, idx):
                rec.dropped = True
                continue
            self.records[tid] = rec
            self.history.append(rec)
            self.added += 1

    def result(self) -> ProbeResult:
        by_index = self.probe.intent_histograms()
        intents = {key: by_index.get(idx, WaitHistogram()) for key, idx in self.intent_index.items()}
        per_thread = self.probe.thread_histograms()
        return ProbeResult(
            duration_s=time.monotonic() - self.started,
            intents=intents,
            threads=[(rec, per_thread.get(rec.target.tid, WaitHistogram())) for rec in self.history],
            tids_at_end=sorted(self.probe.target_tids()),
            filter_added=self.added,
            filter_removed=self.removed,
            map_full_errors=self.probe.map_full_errors,
            source_errors=getattr(self.source, "errors", 0),
        )


def open_source(
    *, regex: str | None = None, intent: str | None = None, socket_path: Any = None
) -> TargetSource:
    """The regex source when a pattern is given, else the agent's matches (one intent or all)."""
    from gthulhu_node.probe.targets import AgentTargets, RegexTargets

    if regex is not None:
        return RegexTargets(regex)
    if socket_path is None:
        raise ProbeUnavailable("gthulhu-node probe: no agent socket given")
    return AgentTargets(socket_path, intent)


class BackgroundProbe:
    """A measurement that runs while the caller does something else (the demo runs its workload):
    compiles and attaches in the constructor (seconds; raises ProbeUnavailable), then follows the
    target source from a thread until `stop()`, which returns the result and frees everything."""

    def __init__(
        self,
        *,
        regex: str | None = None,
        intent: str | None = None,
        socket_path: Any = None,
        poll_s: float = 0.5,
        per_thread: bool = True,
    ) -> None:
        self._probe = RunqueueProbe(per_thread=per_thread)
        try:
            self._source = open_source(regex=regex, intent=intent, socket_path=socket_path)
        except BaseException:
            self._probe.close()
            raise
        self.session = Session(self._probe, self._source)
        self.session.sync()
        # sync() (the follower thread) and snapshot() (a caller reading mid-run) both walk the maps
        self._lock = threading.Lock()
        self._poll = poll_s
        self._follower = WorkerThread("probe-follower", self._follow, join_timeout_s=None)
        self._follower.start()

    def _follow(self, stop: Flag) -> None:
        """The `probe-follower` thread: the probe's targets synced every poll interval until stopped."""
        WorkQueue(period_s=self._poll).serve(stop, self._sync)

    def _sync(self) -> None:
        with self._lock:
            self.session.sync()

    def snapshot(self) -> ProbeResult:
        """The cumulative result so far, while the probe keeps running (`gthulhu-node compare` takes one
        at each window's ends)."""
        with self._lock:
            return self.session.result()

    def tids(self) -> list[int]:
        """The threads the probe follows right now."""
        with self._lock:
            return sorted(self.session.records)

    def stop(self) -> ProbeResult:
        self._follower.stop()
        try:
            self.session.sync()
            return self.session.result()
        finally:
            self._source.close()
            self._probe.close()


def measure(
    duration_s: float,
    *,
    regex: str | None = None,
    intent: str | None = None,
    socket_path: Any = None,
    poll_s: float = 0.5,
    per_thread: bool = True,
) -> ProbeResult:
    """Measure run-queue waits for `duration_s` seconds (after compiling and attaching, which takes
    seconds) and return per-intent and per-thread histograms. Raises ProbeUnavailable with a one-line
    message when the probe cannot run here. This is the entry point for tools (the demo, tests)."""
    background = BackgroundProbe(regex=regex, intent=intent, socket_path=socket_path, poll_s=poll_s,
                                 per_thread=per_thread)
    time.sleep(max(0.0, background.session.started + duration_s - time.monotonic()))
    return background.stop()
