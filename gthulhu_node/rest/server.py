"""The REST listener: its own thread and asyncio loop, started and stopped by the Agent.

Why a thread of its own: the agent's other parts (gRPC handlers, reconciler) are threads, not asyncio;
the listener must neither block them nor be blocked by them. All it shares is the thread-safe intent
store (and a status function).

Refuses to start without mutual TLS unless `insecure_allow_plain_http` is set; then it says so at start,
again every `insecure_warning_interval_s`, and in its stats (`insecure`), because a plain-HTTP listener
hands a token to anyone who has the (public) key.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import ssl
from collections.abc import Callable
from typing import Any

import structlog
from aiohttp import web

from gthulhu_node.config import RestConfig
from gthulhu_node.errors import InvalidInput
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.lifecycle import Health
from gthulhu_node.rest.app import DecisionMakerApi
from gthulhu_node.rest.auth import KeyFileError, TokenAuthority
from gthulhu_node.rest.intent_routes import StatusFn
from gthulhu_node.rest.listener import BoundedListener, ListenerStats
from gthulhu_node.rest.private_views import ExplainFn, PreviewFn
from gthulhu_node.rest.runtime_config import RuntimeConfig
from gthulhu_node.rest.stats import RestStats
from gthulhu_node.rest.tls import server_context
from gthulhu_node.workers import Flag, Spawned, spawn

log = structlog.get_logger(__name__)

__all__ = ["RestConfigError", "RestServer", "RestStats"]


class RestConfigError(InvalidInput):
    """The `rest` section cannot be served as configured; the message names the setting."""


def parse_listen(listen: str) -> tuple[str, int]:
    """`host:port` or `[v6]:port` -> (host, port)."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not host:
        raise RestConfigError(f"rest.listen {listen!r}: expected host:port")
    host = host.removeprefix("[").removesuffix("]")
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise RestConfigError(f"rest.listen {listen!r}: bad port")
    return host, int(port_text)


def prepare(cfg: RestConfig) -> tuple[TokenAuthority, ssl.SSLContext | None]:
    """Load the token keys and the TLS context the `rest` section names. Raises RestConfigError naming
    the setting (preflight.py calls it before anything listens, so a bad section exits 2)."""
    if cfg.jwt_private_key is None:
        raise RestConfigError("rest.jwt_private_key is required: the RSA key tokens are signed with")
    try:
        authority = TokenAuthority.from_files(
            cfg.jwt_private_key,
            cfg.jwt_public_key,
            ttl_s=cfg.token_ttl_s,
            trusted_client_path=cfg.trusted_client_public_key,
            expected_client_id=cfg.expected_client_id,
        )
    except KeyFileError as exc:
        raise RestConfigError(str(exc)) from None
    if cfg.insecure_allow_plain_http:
        return authority, None
    missing = [
        name
        for name, value in (
            ("rest.tls_cert", cfg.tls_cert),
            ("rest.tls_key", cfg.tls_key),
            ("rest.tls_client_ca", cfg.tls_client_ca),
        )
        if value is None
    ]
    if missing:
        raise RestConfigError(
            f"{', '.join(missing)} required: the REST listener needs mutual TLS "
            "(or rest.insecure_allow_plain_http: true, not recommended)"
        )
    assert cfg.tls_cert and cfg.tls_key and cfg.tls_client_ca
    try:
        return authority, server_context(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    except ValueError as exc:
        raise RestConfigError(str(exc)) from None


def _report_request_heads(server: web.Server, listener: BoundedListener) -> None:
    """Tell the listener when a connection's first request head is in: from then on it is finished (no
    longer under the head deadline, no longer evicted for a newer peer). aiohttp builds each request
    through `request_factory` once the head is parsed."""
    make = server.request_factory

    def factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
        listener.head_received(protocol)
        return make(message, payload, protocol, writer, task)

    server.request_factory = factory


class RestServer:
    """`RestServer(config.rest, agent.store, node_name=...).start()` ... `.stop()`."""

    def __init__(
        self,
        config: RestConfig,
        store: IntentStore,
        *,
        node_name: str,
        status: StatusFn | None = None,
        metrics_text: Callable[[], bytes] | None = None,
        backend_name: Callable[[], str] = lambda: "sched_ext",
        explain: ExplainFn | None = None,
        preview: PreviewFn | None = None,
    ) -> None:
        """`explain`, `preview`: served only under mutual TLS (DecisionMakerApi).
        `metrics_text`: when given, `GET /metrics` (no token, like upstream's) serves what it returns
        (Prometheus text); otherwise that route is absent and metrics stay on the agent's own listener.
        `backend_name`: the backend running now (what a runtime-config field can change depends on it)."""
        self._config = config
        self._store = store
        self._node_name = node_name
        self._status = status
        self._metrics_text = metrics_text
        self._backend_name = backend_name
        self._explain = explain
        self._preview = preview
        self._stats = RestStats(insecure=config.insecure_allow_plain_http)
        self._listener_stats = ListenerStats()
        self._thread: Spawned | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = Flag()
        self._start_error: BaseException | None = None
        self._port = 0
        self._api: DecisionMakerApi | None = None
        self._listener: BoundedListener | None = None

    name = "rest"  # a lifecycle Component (gthulhu_node/lifecycle.py)

    def health(self) -> Health:
        alive = self._thread is not None and self._thread.is_alive()
        return Health(alive, "" if alive else "not serving")

    @property
    def port(self) -> int:
        """The bound port (useful with `listen: host:0`)."""
        return self._port

    @property
    def scheme(self) -> str:
        return "http" if self._config.insecure_allow_plain_http else "https"

    def notes(self) -> list[str]:
        """What status shows under the `manager` source (runtime-config fields and their effect)."""
        return self._api.runtime_notes() if self._api is not None else []

    def stats(self) -> RestStats:
        """A copy of the counters (the listener's thread keeps counting in the original)."""
        ls = self._listener_stats
        peers = self._listener.peers.stats() if self._listener is not None else None
        return dataclasses.replace(
            self._stats,
            requests=dict(self._stats.requests),
            connections_refused=ls.refused,
            connections_evicted=peers.evicted if peers else 0,
            connections_held=peers.held if peers else 0,
            handshakes_failed=ls.handshakes_failed,
            accept_errors=ls.accept_errors,
            plain_http_refused=ls.plain_http,
            node_name_mismatches=self._api.node_name_mismatches() if self._api is not None else 0,
        )

    def start(self, timeout: float = 30.0) -> None:
        """Bind and serve; returns once the listener accepts connections. Raises RestConfigError or
        OSError (address in use, ...) without leaving a thread behind."""
        if self._thread is not None:
            raise RuntimeError("RestServer already started")
        host, port = parse_listen(self._config.listen)
        authority, ssl_ctx = prepare(self._config)
        api = DecisionMakerApi(
            self._store,
            authority,
            node_name=self._node_name,
            max_body_bytes=self._config.max_body_bytes,
            stats=self._stats,
            status=self._status,
            metrics_text=self._metrics_text,
            node_silence_s=self._config.node_policy_silence_s,
            runtime_config=RuntimeConfig(self._store.state_dir, frozenset(self._config.runtime_config_allow)),
            backend_name=self._backend_name,
            explain=self._explain,
            preview=self._preview,
            private_views=not self._config.insecure_allow_plain_http,
        )
        self._api = api
        api.check_state()
        app = api.app()
        self._thread = spawn("gthulhu-rest", lambda: self._run(app, host, port, ssl_ctx))
        if not self._started.wait(timeout):
            raise TimeoutError("REST listener did not start")
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            raise self._start_error
        log.info(
            "rest_listening",
            listen=f"{host}:{self._port}",
            scheme=self.scheme,
            mutual_tls=ssl_ctx is not None,
            node_name=self._node_name,
        )
        if ssl_ctx is None:
            self._warn_insecure()

    def _warn_insecure(self) -> None:
        log.warning(
            "rest_insecure_plain_http",
            listen=self._config.listen,
            risk="plain HTTP without client certificates: anyone holding the public key gets a token "
            "and can change this node's scheduling",
        )

    def _run(
        self, app: web.Application, host: str, port: int, ssl_ctx: ssl.SSLContext | None
    ) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve(app, host, port, ssl_ctx))
        except BaseException as exc:  # reported to start() if it happened before the listener was up
            if not self._started.is_set():
                self._start_error = exc
                self._started.set()
            else:
                log.exception("rest_server_failed")
        finally:
            loop.close()

    async def _serve(
        self, app: web.Application, host: str, port: int, ssl_ctx: ssl.SSLContext | None
    ) -> None:
        self._stop = asyncio.Event()
        cfg = self._config
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=2.0,
                               keepalive_timeout=cfg.keepalive_timeout_s)
        await runner.setup()
        assert runner.server is not None  # set by setup()
        sock: socket.socket | None = None
        accepting: asyncio.Task[None] | None = None
        listener: BoundedListener | None = None
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=128)
            self._port = int(sock.getsockname()[1])  # how `listen: host:0` learns its port
            listener = BoundedListener(
                runner.server,
                sock,
                ssl_ctx,
                max_connections=cfg.max_connections,
                handshake_timeout_s=cfg.handshake_timeout_s,
                stats=self._listener_stats,
            )
            self._listener = listener
            _report_request_heads(runner.server, listener)
            accepting = asyncio.create_task(listener.run())
            self._started.set()
            interval = cfg.insecure_warning_interval_s
            while True:
                try:
                    await asyncio.wait_for(self._stop.wait(), timeout=interval if ssl_ctx is None else None)
                    break
                except TimeoutError:
                    self._warn_insecure()
        finally:
            if accepting is not None:
                accepting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await accepting
            if listener is not None:
                listener.close()
            if sock is not None:
                sock.close()
            await runner.cleanup()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, finish in-flight requests (up to 2 s), end the thread. Idempotent."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)
        self._thread = None
        log.info("rest_stopped")
