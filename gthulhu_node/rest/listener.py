"""The REST port's accept loop, with bounds per peer.

Why not aiohttp's TCPSite: it accepts every connection and keeps it, and asyncio keeps each peer that has
not finished its TLS handshake (~300 KB of buffers) for 60 s; plain TCP connects to the mutual-TLS port
(no certificate needed to connect) took the agent to its file-descriptor limit and 369 MB. Why not a cap
alone: 200 half-finished handshakes from one local user then left the Manager 4 answers in 25 (issue 38).
Here connections are admitted by a `PeerTable` (gthulhu_node/peers.py):
- at most `max_connections` connections, handshaking or established, `max_per_peer` of them per local
  user (per address for a remote peer); past either cap a new connection evicts the slowest unfinished
  one (TLS handshake or first request head not in yet), or is closed at once when all are finished;
- a peer gets `handshake_timeout_s` from its connect to finish the TLS handshake and send its first
  request head, then it is dropped (`handshakes_failed`) and its buffers go with it;
- a connection is refused (or evicts) while the process has fewer than the fd reserve left;
- an accept that fails (EMFILE) is counted and retried shortly, never the end of the listener;
- plain HTTP on the TLS port (a Manager with mTLS off) gets an HTTP 400 saying what to set
  (plainhttp.py), counted (`plain_http`).
Idle keep-alive connections are aiohttp's to close (`keepalive_timeout`).
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gthulhu_node.peers import FdBudget, Peer, PeerTable, peer_key
from gthulhu_node.rest.plainhttp import PlainHttpAnswer, first_bytes, is_plain_http

log = structlog.get_logger(__name__)

ACCEPT_RETRY_S = 0.1
EXPIRE_POLL_S = 0.25
SHUTDOWN_TIMEOUT_S = 5.0


@dataclass(slots=True)
class ListenerStats:
    refused: int = 0
    handshakes_failed: int = 0
    accept_errors: int = 0
    plain_http: int = 0


class _Conn:
    """One accepted connection while the listener holds it: how to drop it at each stage."""

    __slots__ = ("peer", "sock", "task", "transport")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.task: asyncio.Task[None] | None = None
        self.transport: asyncio.Transport | None = None
        self.peer: Peer | None = None

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        elif self.task is not None:
            self.task.cancel()
        else:
            self.sock.close()

    def alive(self) -> bool:
        # asyncio closes this same socket object when the connection ends (for TLS after the closing
        # handshake), so fileno() == -1 tells the slot is free again
        return self.sock.fileno() != -1


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
        max_per_peer: int | None = None,
        budget: FdBudget | None = None,
    ) -> None:
        self._factory = factory
        self._sock = sock
        self._ssl = ssl_ctx
        self._handshake_timeout_s = handshake_timeout_s
        self.stats = stats
        self.peers = PeerTable(max_connections, max_per_peer or max(1, max_connections // 4),
                               handshake_timeout_s, budget if budget is not None else FdBudget())
        self._by_protocol: dict[asyncio.BaseProtocol, _Conn] = {}
        self._admitting: set[_Conn] = set()
        self._plain = PlainHttpAnswer()

    @property
    def held(self) -> int:
        """Connections held now: established (and not closed) plus those still handshaking."""
        return self.peers.stats().held

    def head_received(self, protocol: asyncio.BaseProtocol) -> None:
        """The connection's first request head is in (aiohttp's request factory calls this)."""
        conn = self._by_protocol.pop(protocol, None)
        if conn is not None and conn.peer is not None:
            self.peers.finish(conn.peer)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._sock.setblocking(False)
        expiring = asyncio.create_task(self._expire_late())
        try:
            await self._accept_loop(loop)
        finally:
            expiring.cancel()

    async def _expire_late(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_POLL_S)
            if n := self.peers.expire():
                self.stats.handshakes_failed += n
                log.info("rest_connections_expired", count=n, deadline_s=self._handshake_timeout_s)
            self._by_protocol = {p: c for p, c in self._by_protocol.items() if c.alive()}

    async def _accept_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                sock, _ = await loop.sock_accept(self._sock)
            except OSError as exc:
                self.stats.accept_errors += 1
                log.warning("rest_accept_failed", error=str(exc))
                await asyncio.sleep(ACCEPT_RETRY_S)
                continue
            conn = _Conn(sock)
            conn.peer = self.peers.admit(peer_key(sock), conn.close, conn.alive)
            if conn.peer is None:
                self.stats.refused += 1
                sock.close()
                log.warning("rest_connection_refused", reason="no slot to spare: this peer's or every slot "
                            "serves requests, or the fd reserve is reached", limit=self.peers.max_total)
                continue
            conn.task = asyncio.create_task(self._admit(conn))
            # also when the task is cancelled before it ever ran (an eviction in the same burst of
            # accepts): then nothing in _admit closes the socket
            conn.task.add_done_callback(functools.partial(self._admitted, conn))
            self._admitting.add(conn)

    def _registered(self, conn: _Conn) -> Callable[[], asyncio.BaseProtocol]:
        """The protocol factory for `conn`: known by its protocol from its creation, before the handshake
        ends. Registered after `connect_accepted_socket` returned, a request head parsed first (the
        handler's task ran before this coroutine resumed) found no connection, so it stayed under the head
        deadline and was closed mid-request once its connect was that old (a 10,001-policy push under load
        got no answer)."""

        def make() -> asyncio.BaseProtocol:
            protocol = self._factory()
            self._by_protocol[protocol] = conn
            return protocol

        return make

    async def _admit(self, conn: _Conn) -> None:
        loop = asyncio.get_running_loop()
        try:
            if self._ssl is None:
                transport, _ = await loop.connect_accepted_socket(self._registered(conn), conn.sock)
            else:
                started = loop.time()
                if await self._answered_plain_http(conn.sock):
                    self._forget(conn)
                    return
                transport, _ = await loop.connect_accepted_socket(
                    self._registered(conn),
                    conn.sock,
                    ssl=self._ssl,
                    # the peek's wait counts: one timeout in all for a peer to start and finish TLS
                    ssl_handshake_timeout=max(0.1, self._handshake_timeout_s - (loop.time() - started)),
                    ssl_shutdown_timeout=SHUTDOWN_TIMEOUT_S,
                )
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            self.stats.handshakes_failed += 1
            self._forget(conn)
            log.info("rest_handshake_failed", error=str(exc) or type(exc).__name__)
            return
        conn.transport = transport

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

    def _admitted(self, conn: _Conn, _task: asyncio.Task[None]) -> None:
        """The handshake is over: established, failed, or cancelled (evicted, expired, stopping)."""
        self._admitting.discard(conn)
        conn.task = None
        if conn.transport is None:
            self._forget(conn)

    def _forget(self, conn: _Conn) -> None:
        conn.sock.close()
        if conn.peer is not None:
            self.peers.release(conn.peer)

    def close(self) -> None:
        """Stop handshakes in progress; established connections are the web server's to close."""
        for conn in list(self._admitting):
            conn.close()
        self._by_protocol.clear()
