"""The REST port's accept loop, with bounds per peer.

Why not aiohttp's TCPSite: it accepts every connection and keeps it, and asyncio keeps each peer that has
not finished its TLS handshake (~300 KB of buffers) for 60 s; plain TCP connects to the mutual-TLS port
(no certificate needed to connect) took the agent to its file-descriptor limit and 369 MB. Here:
- at most `max_connections` connections, handshaking or established, are held; one more is closed at
  once and counted (`refused`);
- a peer gets `handshake_timeout_s` to finish the TLS handshake, then it is dropped (`handshakes_failed`)
  and its buffers go with it;
- an accept that fails (EMFILE) is counted and retried shortly, never the end of the listener;
- plain HTTP on the TLS port (a Manager with mTLS off) gets an HTTP 400 saying what to set
  (plainhttp.py), counted (`plain_http`).
Idle keep-alive connections are aiohttp's to close (`keepalive_timeout`).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gthulhu_node.rest.plainhttp import PlainHttpAnswer, first_bytes, is_plain_http

log = structlog.get_logger(__name__)

ACCEPT_RETRY_S = 0.1
SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(slots=True)
class ListenerStats:
    refused: int = 0
    handshakes_failed: int = 0
    accept_errors: int = 0
    plain_http: int = 0


class BoundedListener:
    """`await BoundedListener(protocol_factory, sock, ssl_ctx, ...).run()` until cancelled."""

    def __init__(
        self,
        factory: Callable[[], asyncio.BaseProtocol],
        sock: socket.socket,
        ssl_ctx: ssl.SSLContext | None,
        *,
        max_connections: int,
        handshake_timeout_s: float,
        stats: ListenerStats,
    ) -> None:
        self._factory = factory
        self._sock = sock
        self._ssl = ssl_ctx
        self._max = max_connections
        self._handshake_timeout_s = handshake_timeout_s
        self.stats = stats
        # the accepted sockets themselves: asyncio closes this same object when the connection ends (for
        # TLS after the closing handshake), so fileno() == -1 tells a slot is free again
        self._live: set[socket.socket] = set()
        self._admitting: set[asyncio.Task[None]] = set()
        self._plain = PlainHttpAnswer()

    @property
    def held(self) -> int:
        """Connections held now: established (and not closed) plus those still handshaking."""
        self._live = {s for s in self._live if s.fileno() != -1}
        return len(self._live) + len(self._admitting)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        while True:
            try:
                conn, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                self.stats.accept_errors += 1
                log.warning("rest_accept_failed", error=str(exc))
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            if self.held >= self._max:
                self.stats.refused += 1
                conn.close()
                log.warning("rest_connection_refused", reason="too many connections", limit=self._max)
                continue
            task = asyncio.create_task(self._admit(conn))
            self._admitting.add(task)
            task.add_done_callback(self._admitting.discard)

    async def _admit(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self._ssl is None:
                await loop.connect_accepted_socket(self._factory, conn)
            else:
                started = loop.time()
                if await self._answered_plain_http(conn):
                    return
                await loop.connect_accepted_socket(
                    self._factory,
                    conn,
                    ssl=self._ssl,
                    # the peek's wait counts: one timeout in all for a peer to start and finish TLS
                    ssl_handshake_timeout=max(0.1, self._handshake_timeout_s - (loop.time() - started)),
                    ssl_shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                )
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            self.stats.handshakes_failed += 1
            conn.close()
            log.info("rest_handshake_failed", error=str(exc) or type(exc).__name__)
            return
        self._live.add(conn)

    async def _answered_plain_http(self, conn: socket.socket) -> bool:
        """Whether the peer spoke plain HTTP (and was answered); raises TimeoutError if it said nothing
        within the handshake timeout."""
        head = await first_bytes(conn, self._handshake_timeout_s)
        if head is None:
            raise TimeoutError("nothing received within rest.handshake_timeout_s")
        if not is_plain_http(head):
            return False
        self.stats.plain_http += 1
        await self._plain.answer(conn, self._handshake_timeout_s)
        return True

    def close(self) -> None:
        """Stop handshakes in progress; established connections are the web server's to close."""
        for task in list(self._admitting):
            task.cancel()
        self._live.clear()
