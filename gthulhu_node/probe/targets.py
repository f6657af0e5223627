"""Which threads the probe measures: what the agent's intents match now, or an ad-hoc regex on comm.

Each source answers `poll()` with the full set it wants measured now (tid -> Target); the session diffs
that against the kernel's target map. The agent source asks the running agent (gRPC ListMatches) on every
poll. The regex source needs no agent: one /proc snapshot, then proc connector events (fork, comm, exec,
exit) as the fast path, and a fresh snapshot every few seconds (or on every poll when the connector is
unavailable) as the ground truth.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from gthulhu_node.intents.model import compile_pattern
from gthulhu_node.probe.preflight import ProbeUnavailable
from gthulhu_node.tasks import procfs
from gthulhu_node.tasks.events import EventKind, EventsUnavailable, ProcEventSource

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Target:
    """One thread to measure and the intent (or regex) it is measured for."""

    tid: int
    tgid: int
    comm: str
    intent: str


class TargetSource(Protocol):
    def poll(self) -> dict[int, Target]: ...

    def close(self) -> None: ...


def regex_label(pattern: str) -> str:
    """The name an ad-hoc regex goes by in the output, where an intent key would be."""
    return f"regex:{pattern}"


class RegexTargets:
    """Threads whose comm matches an RE2 pattern (unanchored search, like an intent's commandRegex)."""

    def __init__(self, pattern: str, proc_root: Path = Path("/proc"), rescan_s: float = 5.0) -> None:
        try:
            self._regex: Any = compile_pattern(pattern)
        except ValueError as exc:
            raise ProbeUnavailable(f"gthulhu-node probe: --regex: {exc}") from None
        self.label = regex_label(pattern)
        self._proc_root = proc_root
        self._rescan_s = rescan_s
        self._events: ProcEventSource | None = ProcEventSource()
        try:
            self._events.open()
        except EventsUnavailable as exc:
            log.warning("probe_proc_events_unavailable", error=str(exc), fallback="rescan on every poll")
            self._events = None
        self._current: dict[int, Target] = {}
        self._last_scan = 0.0
        self._rescan()

    def _matches(self, comm: str) -> bool:
        return self._regex.search(comm) is not None

    def _rescan(self) -> None:
        snap = procfs.snapshot(self._proc_root)
        self._current = {
            t.tid: Target(t.tid, t.tgid, t.comm, self.label)
            for t in snap.tasks.values()
            if self._matches(t.comm) and not self._exited(t.tgid, t.tid)
        }
        self._last_scan = time.monotonic()

    def _exited(self, tgid: int, tid: int) -> bool:
        """A zombie (exited, not yet reaped) still has its /proc entry; it will never run again."""
        try:
            with open(f"{self._proc_root}/{tgid}/task/{tid}/stat", "rb") as f:
                data = f.read(1024)
        except OSError:
            return True
        state = data[data.rfind(b")") + 2 : data.rfind(b")") + 3]
        return state in (b"Z", b"X")

    def _reread(self, tgid: int, tid: int) -> None:
        try:
            task = procfs.read_task(tgid, tid, self._proc_root)
        except OSError:
            task = None
        if task is not None and self._matches(task.comm):
            self._current[tid] = Target(tid, task.tgid, task.comm, self.label)
        else:
            self._current.pop(tid, None)

    def poll(self) -> dict[int, Target]:
        if self._events is None or time.monotonic() - self._last_scan >= self._rescan_s:
            self._rescan()
            if self._events is not None:
                self._events.read_pending()  # already covered by the snapshot
            return dict(self._current)
        batch = self._events.read_pending()
        if batch.lost or batch.error:
            log.warning("probe_proc_events_lost", error=batch.error, lost=batch.lost)
            self._events.reopen()
            self._rescan()
            return dict(self._current)
        for ev in batch.events:
            if ev.kind is EventKind.EXIT:
                self._current.pop(ev.tid, None)
            elif ev.kind is EventKind.COMM and ev.comm is not None:
                if self._matches(ev.comm):
                    self._current[ev.tid] = Target(ev.tid, ev.tgid, ev.comm, self.label)
                else:
                    self._current.pop(ev.tid, None)
            else:  # FORK, EXEC: the name is not in the event, read it
                self._reread(ev.tgid, ev.tid)
        return dict(self._current)

    def close(self) -> None:
        if self._events is not None:
            self._events.close()


class AgentTargets:
    """The threads the running agent's intents govern now, from its ListMatches call.

    `intent`: one "source/id", or None for every intent.
    """

    def __init__(self, socket_path: Path, intent: str | None = None, timeout_s: float = 15.0) -> None:
        import grpc

        from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2, agent_pb2_grpc

        self._pb = agent_pb2
        self._socket = socket_path
        self._intent = intent
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(f"unix://{socket_path}")
        self._stub = agent_pb2_grpc.NodeAgentStub(self._channel)
        self._rpc_error: type[Exception] = grpc.RpcError
        self._last: dict[int, Target] = {}
        self.errors = 0
        try:
            self._last = self._fetch()
        except grpc.RpcError as exc:
            self.close()
            raise ProbeUnavailable(
                f"gthulhu-node probe: cannot list matches from the agent at {socket_path}: "
                f"{_rpc_text(exc)} (is it running? systemctl status gthulhu-node; or measure with --regex)"
            ) from None

    def _fetch(self) -> dict[int, Target]:
        request = self._pb.ListMatchesRequest(intent=self._intent or "")
        response = self._stub.ListMatches(request, timeout=self._timeout)
        return {m.tid: Target(m.tid, m.tgid, m.comm, m.intent) for m in response.matches}

    def poll(self) -> dict[int, Target]:
        """The agent's matches now; on a failed call the previous set stays (logged, counted)."""
        try:
            self._last = self._fetch()
        except self._rpc_error as exc:
            self.errors += 1
            log.warning("probe_list_matches_failed", socket=str(self._socket), error=_rpc_text(exc))
        return dict(self._last)

    def close(self) -> None:
        self._channel.close()


def _rpc_text(exc: Exception) -> str:
    details = getattr(exc, "details", None)
    code = getattr(exc, "code", None)
    if callable(details) and callable(code):
        return f"{code().name}: {details()}"
    return str(exc)
