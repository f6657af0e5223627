"""The /metrics HTTP endpoint, with a bound on what any local user can make it hold.

Why not prometheus-client's `start_http_server`: it starts a thread per connection and waits for the
request forever, so any local user can open connections until the agent runs out of file descriptors
(1,120 idle connections did: policies.d and /proc could no longer be read). Why not a cap alone: 16
connections from `nobody` sending a byte every 3 s held all 16 slots and kept every scrape out (issue 38).
Here connections are admitted by a `PeerTable` (gthulhu_node/peers.py):
- at most `max_connections` at a time, `max_per_peer` of them per local user (per address for a remote
  peer); past either cap a new connection evicts the slowest one whose request head has not arrived, or
  is closed at once when every slot is serving a request (counted);
- the request head must arrive within `head_deadline_s` of the connect, however it trickles in; a peer
  that sends nothing for `idle_timeout_s` is dropped too;
- a connection is refused (or evicts) while the process has fewer than the fd reserve left;
- one request per connection (HTTP/1.0), so a served scrape gives its slot back at once.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from gthulhu_node.peers import FdBudget, Peer, PeerStats, PeerTable, peer_key
from gthulhu_node.workers import Spawned, spawn

MAX_CONNECTIONS = 16
MAX_PER_PEER = 4
IDLE_TIMEOUT_S = 5.0
HEAD_DEADLINE_S = 3.0
POLL_S = 0.25  # how often unfinished connections are checked against their deadline


class _Handler(BaseHTTPRequestHandler):
    server: BoundedMetricsServer
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout_s)

    def parse_request(self) -> bool:
        ok = super().parse_request()
        self.server.head_received(self.connection)
        return ok

    def do_GET(self) -> None:
        if self.path.split("?", 1)[0] not in ("/metrics", "/"):
            self.send_error(404, "only /metrics is served here")
            return
        body = generate_latest(self.server.registry)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not news; refusals are counted in the server instead."""


def _drop(conn: socket.socket) -> None:
    """End a connection another thread serves: its blocked read returns and that thread closes it (closing
    here could hand the fd number to a new socket while the old thread still uses it)."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class BoundedMetricsServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that admits connections through a PeerTable (module docstring)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        *,
        max_connections: int = MAX_CONNECTIONS,
        max_per_peer: int = MAX_PER_PEER,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
        head_deadline_s: float = HEAD_DEADLINE_S,
        budget: FdBudget | None = None,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.registry = registry
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.peers = PeerTable(max_connections, max_per_peer, head_deadline_s,
                               budget if budget is not None else FdBudget())
        self._serving: dict[socket.socket, Peer] = {}
        self._serving_lock = threading.Lock()
        super().__init__(address, _Handler)

    @property
    def refused(self) -> int:
        return self.peers.stats().refused

    def peer_stats(self) -> PeerStats:
        return self.peers.stats()

    def process_request(self, request: Any, client_address: Any) -> None:
        peer = self.peers.admit(peer_key(request), lambda: _drop(request))
        if peer is None:
            self.shutdown_request(request)
            return
        with self._serving_lock:
            self._serving[request] = peer
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def head_received(self, request: socket.socket) -> None:
        with self._serving_lock:
            peer = self._serving.get(request)
        if peer is not None:
            self.peers.finish(peer)

    def _release(self, request: socket.socket) -> None:
        with self._serving_lock:
            peer = self._serving.pop(request, None)
        if peer is not None:
            self.peers.release(peer)

    def service_actions(self) -> None:
        """Called by serve_forever every POLL_S: drop the connections whose head is late."""
        self.peers.expire()


def serve(host: str, port: int, registry: CollectorRegistry) -> tuple[BoundedMetricsServer, Spawned]:
    """Bind and serve in a daemon thread; raises OSError when the address cannot be bound."""
    server = BoundedMetricsServer((host, port), registry)
    thread = spawn("metrics-http", lambda: server.serve_forever(poll_interval=POLL_S))
    return server, thread
