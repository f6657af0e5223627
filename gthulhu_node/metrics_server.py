"""The /metrics HTTP endpoint, with a bound on what any local user can make it hold.

Why not prometheus-client's `start_http_server`: it starts a thread per connection and waits for the
request forever, so any local user can open connections until the agent runs out of file descriptors
(1,120 idle connections did: policies.d and /proc could no longer be read). Here:
- at most `max_connections` connections are served at a time; one more is closed at once (counted);
- a peer that sends nothing for `idle_timeout_s` is dropped;
- one request per connection (HTTP/1.0), so a served scrape gives its slot back at once.
"""

from __future__ import annotations

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

MAX_CONNECTIONS = 16
IDLE_TIMEOUT_S = 5.0


class _Handler(BaseHTTPRequestHandler):
    server: BoundedMetricsServer
    protocol_version = "HTTP/1.0"

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.server.idle_timeout_s)

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


class BoundedMetricsServer(ThreadingHTTPServer):
    """A ThreadingHTTPServer that serves at most `max_connections` peers at once (module docstring)."""

    daemon_threads = True
    request_queue_size = 64

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        *,
        max_connections: int = MAX_CONNECTIONS,
        idle_timeout_s: float = IDLE_TIMEOUT_S,
    ) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.registry = registry
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.refused = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def serve(host: str, port: int, registry: CollectorRegistry) -> tuple[BoundedMetricsServer, threading.Thread]:
    """Bind and serve in a daemon thread; raises OSError when the address cannot be bound."""
    server = BoundedMetricsServer((host, port), registry)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return server, thread
