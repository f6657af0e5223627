"""The gRPC server: NodeAgent over a root-only unix socket, optionally TCP with mutual TLS, plus the
standard health service.

Security model: the default listener is a unix socket (mode 0600, in a 0700 directory the agent creates),
so only root can talk to the agent. TCP is opt-in (`api.tcp_listen`) and then only with TLS and a client
certificate signed by `api.tls_client_ca`; starting TCP without the three TLS files is refused. Every
request is bounded: message size (`api.max_message_bytes`), intents per source, pattern length (256 bytes,
RE2 with a memory cap), and handler threads. Validation errors are INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import os
import socket
import stat
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gthulhu_node.api import convert, decoding
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2_grpc as pb_grpc
from gthulhu_node.config import ApiConfig
from gthulhu_node.errors import GthulhuError, InvalidInput, LimitExceeded, edge_of
from gthulhu_node.explain import Report
from gthulhu_node.intents.model import Intent, check_source
from gthulhu_node.intents.parse import IntentValidationError, check_set
from gthulhu_node.intents.status import MatchRow, StatusBoard, StatusEvent, StatusSnapshot
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.lifecycle import Health
from gthulhu_node.preview import Displaced, Preview
from gthulhu_node.workers import Flag

log = structlog.get_logger(__name__)

SERVICE_NAME = "gthulhu.node.v1.NodeAgent"
# Responses can be larger than requests (status of every source); bounded all the same.
MAX_SEND_BYTES = 64 << 20
WATCH_POLL_S = 0.5

T = TypeVar("T")


class AgentAPI(Protocol):
    """What the server needs from the agent."""

    store: IntentStore
    board: StatusBoard

    def status(self, source: str = "") -> StatusSnapshot: ...

    def matches(self, intent: str = "") -> list[MatchRow]: ...

    def explain(self, *, tid: int = 0, pid: int = 0, comm_regex: str = "") -> list[Report]: ...

    def preview(self, source: str, intents: Sequence[Intent]) -> tuple[Preview, list[Displaced]]: ...

    def sync(self, timeout: float = 5.0) -> None:
        """Wait until the last store change is in effect and status reflects it (best effort)."""


class ApiConfigError(InvalidInput):
    """The API cannot start as configured (missing TLS files, socket in use, ...)."""


@dataclass(slots=True)
class ApiStats:
    requests: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # by status code name
    watch_streams: int = 0


def grpc_status(exc: GthulhuError) -> grpc.StatusCode:
    """The gRPC edge's one mapping of our exceptions (gthulhu_node/errors.py, the `grpc` column)."""
    return grpc.StatusCode[edge_of(exc).grpc]


class NodeAgentService(pb_grpc.NodeAgentServicer):
    """The NodeAgent RPCs. Writes go to the store; the agent turns store changes into scheduling."""

    def __init__(self, agent: AgentAPI, *, max_watchers: int) -> None:
        self._agent = agent
        self._max_watchers = max_watchers
        self._lock = threading.Lock()
        self._stats = ApiStats()
        self._stop = Flag()

    def stats(self) -> ApiStats:
        with self._lock:
            return ApiStats(dict(self._stats.requests), dict(self._stats.errors), self._stats.watch_streams)

    def stop(self) -> None:
        self._stop.set()

    def _call(self, method: str, context: grpc.ServicerContext, fn: Callable[[], T]) -> T:
        with self._lock:
            self._stats.requests[method] = self._stats.requests.get(method, 0) + 1
        try:
            return fn()
        except GthulhuError as exc:
            self._fail(method, context, grpc_status(exc), str(exc))
        except OSError as exc:
            self._fail(method, context, grpc.StatusCode.UNAVAILABLE, f"could not persist intents: {exc}")
        raise AssertionError("unreachable")  # context.abort raises

    def _fail(self, method: str, context: grpc.ServicerContext, code: grpc.StatusCode, msg: str) -> None:
        with self._lock:
            self._stats.errors[code.name] = self._stats.errors.get(code.name, 0) + 1
        log.info("api_request_refused", method=method, code=code.name, error=msg[:500])
        context.abort(code, msg)

    def refuse_invalid(self, method: str, context: grpc.ServicerContext, message: str) -> None:
        """A request that could not even be decoded (api/decoding.py): counted and refused like the rest."""
        with self._lock:
            self._stats.requests[method] = self._stats.requests.get(method, 0) + 1
        self._fail(method, context, grpc.StatusCode.INVALID_ARGUMENT, message)

    @staticmethod
    def _client_source(source: str) -> str:
        try:
            return check_source(source)
        except ValueError as exc:
            raise IntentValidationError("source", str(exc)) from None

    def ApplyIntents(
        self, request: pb.ApplyIntentsRequest, context: grpc.ServicerContext
    ) -> pb.ApplyIntentsResponse:
        def run() -> pb.ApplyIntentsResponse:
            source = self._client_source(request.source)
            intents = convert.intents_from_pb(
                request.intents, max_count=self._agent.store.max_intents_per_source
            )
            outcome = self._agent.store.apply(source, request.generation, intents)
            if outcome.changed:
                self._agent.sync()
            return pb.ApplyIntentsResponse(generation=outcome.generation, changed=outcome.changed)

        return self._call("ApplyIntents", context, run)

    def DeleteIntent(
        self, request: pb.DeleteIntentRequest, context: grpc.ServicerContext
    ) -> pb.DeleteIntentResponse:
        def run() -> pb.DeleteIntentResponse:
            source = self._client_source(request.source)
            self._agent.store.delete(source, request.id)
            self._agent.sync()
            return pb.DeleteIntentResponse()

        return self._call("DeleteIntent", context, run)

    def GetStatus(
        self, request: pb.GetStatusRequest, context: grpc.ServicerContext
    ) -> pb.GetStatusResponse:
        return self._call(
            "GetStatus", context, lambda: convert.snapshot_to_pb(self._agent.status(request.source))
        )

    def ListMatches(
        self, request: pb.ListMatchesRequest, context: grpc.ServicerContext
    ) -> pb.ListMatchesResponse:
        return self._call(
            "ListMatches",
            context,
            lambda: pb.ListMatchesResponse(
                matches=[convert.match_to_pb(m) for m in self._agent.matches(request.intent)]
            ),
        )

    def Explain(self, request: pb.ExplainRequest, context: grpc.ServicerContext) -> pb.ExplainResponse:
        def run() -> pb.ExplainResponse:
            reports = self._agent.explain(tid=request.tid, pid=request.pid, comm_regex=request.comm_regex)
            return pb.ExplainResponse(threads=[convert.report_to_pb(r) for r in reports])

        return self._call("Explain", context, run)

    def Preview(self, request: pb.PreviewRequest, context: grpc.ServicerContext) -> pb.PreviewResponse:
        def run() -> pb.PreviewResponse:
            source = self._client_source(request.source or "cli")
            limit = self._agent.store.max_intents_per_source
            intents = convert.intents_from_pb(request.intents, max_count=limit)
            check_set(intents, max_count=limit)
            return convert.preview_to_pb(*self._agent.preview(source, intents))

        return self._call("Preview", context, run)

    def WatchStatus(
        self, request: pb.WatchStatusRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StatusEvent]:
        def admit() -> None:
            with self._lock:
                if self._stats.watch_streams >= self._max_watchers:
                    raise LimitExceeded(f"at most {self._max_watchers} status watchers at a time")
                self._stats.watch_streams += 1

        self._call("WatchStatus", context, admit)
        try:
            yield from self._watch(request.source, context)
        finally:
            with self._lock:
                self._stats.watch_streams -= 1

    def _watch(self, source: str, context: grpc.ServicerContext) -> Iterator[pb.StatusEvent]:
        with self._agent.board.subscribe() as sub:
            yield convert.event_to_pb(StatusEvent(snapshot=self._agent.status(source)))
            while context.is_active() and not self._stop.is_set():
                ev = sub.get(WATCH_POLL_S)
                if sub.closed:
                    return
                if ev is None:
                    continue
                if source and ev.changed is not None and ev.changed.source != source:
                    continue
                if source and ev.removed is not None and not ev.removed.startswith(source + "/"):
                    continue
                yield convert.event_to_pb(ev)


class ApiServer:
    """The grpc.Server with its listeners and the health service."""

    def __init__(self, config: ApiConfig, agent: AgentAPI) -> None:
        self.config = config
        workers = config.workers
        self.service = NodeAgentService(agent, max_watchers=max(1, workers - 2))
        self.grpc_health = health.HealthServicer()
        options = [
            ("grpc.max_receive_message_length", config.max_message_bytes),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
            ("grpc.so_reuseport", 0),
        ]
        if config.tcp_listen:
            # Bounds per peer for the TCP listener: a flood of connections (or of peers that never finish
            # the handshake) must not take the file descriptors the agent needs to read /proc.
            options += [
                ("grpc.max_allowed_incoming_connections", config.tcp_max_connections),
                ("grpc.server_handshake_timeout_ms", int(config.tcp_handshake_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(config.tcp_idle_timeout_s * 1000)),
            ]
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
            options=options,
            maximum_concurrent_rpcs=workers * 8,
        )
        decoding.add_servicer(pb_grpc.add_NodeAgentServicer_to_server, self.service, self._server,
                              self.service.refuse_invalid)
        health_pb2_grpc.add_HealthServicer_to_server(self.grpc_health, self._server)
        self._set_health(False)
        self.socket_path: Path | None = config.socket
        self.tcp_port: int | None = None
        self._listening = False

    def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            self.grpc_health.set(name, status)

    def start(self) -> None:
        """Bind the listeners and start serving (health NOT_SERVING until `set_ready`)."""
        path = self.config.socket
        _prepare_socket_path(path)
        # The socket is created 0600 (umask) and chmod-ed again after start: no window in which another
        # user could connect, even in a directory that is not 0700. Only this thread creates files now.
        old_umask = os.umask(0o177)
        try:
            bound = self._server.add_insecure_port(f"unix://{path}")
            if bound == 0:
                raise ApiConfigError(f"cannot listen on unix socket {path}")
            if self.config.tcp_listen:
                self.tcp_port = self._add_tls_port(self.config)
            self._server.start()
        finally:
            os.umask(old_umask)
        os.chmod(path, 0o600)
        self._listening = True
        log.info("api_listening", socket=str(path), tcp=self.config.tcp_listen, tcp_port=self.tcp_port)

    def _add_tls_port(self, config: ApiConfig) -> int:
        cert, key, ca = read_tls_files(config)
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        assert config.tcp_listen is not None
        port = self._server.add_secure_port(config.tcp_listen, creds)
        if port == 0:
            raise ApiConfigError(f"cannot listen on {config.tcp_listen}")
        return port

    name = "api"  # a lifecycle Component (gthulhu_node/lifecycle.py)

    def health(self) -> Health:
        return Health(self._listening, "" if self._listening else "not listening")

    def set_ready(self, ready: bool) -> None:
        self._set_health(ready)

    def stop(self, grace: float = 2.0) -> None:
        self._listening = False
        self._set_health(False)
        self.grpc_health.enter_graceful_shutdown()
        self.service.stop()
        self._server.stop(grace).wait(grace + 1)
        path = self.config.socket
        try:
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        except OSError:
            pass


def read_tls_files(config: ApiConfig) -> tuple[bytes, bytes, bytes]:
    """The TCP listener's certificate, key and client CA. Raises ApiConfigError naming the setting."""
    files = {
        "tls_cert": config.tls_cert,
        "tls_key": config.tls_key,
        "tls_client_ca": config.tls_client_ca,
    }
    missing = [name for name, p in files.items() if p is None]
    if missing:
        raise ApiConfigError(
            f"api.tcp_listen is set but {', '.join('api.' + m for m in missing)} not: TCP is served "
            "only with TLS and client certificate verification"
        )
    out: list[bytes] = []
    for name, p in files.items():
        assert p is not None
        try:
            out.append(p.read_bytes())
        except OSError as exc:
            raise ApiConfigError(f"api.{name}: cannot read {p}: {exc.strerror or exc}") from None
    return out[0], out[1], out[2]


def _prepare_socket_path(path: Path) -> None:
    """Create the socket's directory (0700) and remove a stale socket; refuse one that is in use."""
    parent = path.parent
    if not parent.exists():
        parent.mkdir(parents=True, mode=0o700)
        os.chmod(parent, 0o700)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ApiConfigError(f"{path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: left over from a crash
        return
    finally:
        probe.close()
    raise ApiConfigError(f"{path} is in use: another gthulhu-node agent is running")
