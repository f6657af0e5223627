"""Plain HTTP arriving on the mutual-TLS port: answered with an HTTP error that says what to change.

Why: upstream's Helm chart defaults to `mtls.enabled: false`, so a Manager installed with its defaults
speaks plain HTTP to this TLS port. A TLS server sees garbage instead of a ClientHello and closes the
connection: the Manager logs an empty reply and this node logs a failed handshake, neither says why. The
first bytes of a connection tell the two apart (a TLS record starts with 0x16, an HTTP request with a
method name), so before the handshake we peek at them and answer an HTTP request with a 400 in upstream's
error envelope, naming the settings on both sides. Nothing is served over it: the connection is closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket

import structlog

log = structlog.get_logger(__name__)

TLS_HANDSHAKE = 0x16  # the content type of the record that carries a ClientHello
METHODS = (b"GET ", b"POST ", b"PUT ", b"DELETE ", b"HEAD ", b"PATCH ", b"OPTIONS ", b"CONNECT ", b"TRACE ")
PEEK_BYTES = 8
REQUEST_HEAD_MAX = 16 * 1024  # what we read of the request before answering
LINGER_S = 1.0  # how long the answer waits for the client to read it and close
PEERS_REMEMBERED = 1024  # peers told once at warning level; later ones (and repeats) at debug
MESSAGE = (
    "this port speaks HTTPS with mutual TLS, and the request came as plain HTTP. Either set the Manager "
    "to mutual TLS (Helm mtls.enabled: true; its config [mtls] enable = true) with a client certificate "
    "signed by this node's rest.tls_client_ca, or set rest.insecure_allow_plain_http: true on this node "
    "(plain mode: listen on the pod IP, admit only the Manager; docs/kubernetes.md)"
)


async def first_bytes(conn: socket.socket, timeout_s: float) -> bytes | None:
    """The first bytes the peer sent, left in the socket for the TLS handshake; None when it sent nothing
    within `timeout_s` (the handshake timeout: the peer would be dropped then anyway)."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    fd = conn.fileno()
    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await asyncio.wait_for(ready, timeout_s)
    except TimeoutError:
        return None
    finally:
        loop.remove_reader(fd)
    try:
        return conn.recv(PEEK_BYTES, socket.MSG_PEEK)
    except OSError:
        return b""


def is_plain_http(head: bytes) -> bool:
    return bool(head) and head[0] != TLS_HANDSHAKE and head.startswith(METHODS)


def response() -> bytes:
    body = json.dumps({"success": False, "error": MESSAGE}).encode()
    head = (
        "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


class PlainHttpAnswer:
    """Answers plain HTTP on the TLS port; logs once per peer address (a Manager retries every cycle)."""

    def __init__(self) -> None:
        self._told: set[str] = set()
        self.answered = 0

    async def answer(self, conn: socket.socket, timeout_s: float) -> None:
        """Read the request head, send the 400, let the client read it, close."""
        self.answered += 1
        peer = _peer(conn)
        first = peer not in self._told and len(self._told) < PEERS_REMEMBERED
        if first:
            self._told.add(peer)
        (log.warning if first else log.debug)(
            "rest_plain_http_on_tls_port", peer=peer, error=MESSAGE,
            note="logged once per peer" if first else "",
        )
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                await _read_head(loop, conn)
                await loop.sock_sendall(conn, response())
                conn.shutdown(socket.SHUT_WR)
            # closing with unread bytes would send a reset, which can destroy the answer before the client
            # reads it: wait for its close (or a moment) and discard what it still sends
            async with asyncio.timeout(LINGER_S):
                while await loop.sock_recv(conn, 4096):
                    pass
        except (OSError, TimeoutError):
            pass
        finally:
            conn.close()


async def _read_head(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    seen = b""
    while b"\r\n\r\n" not in seen and len(seen) < REQUEST_HEAD_MAX:
        chunk = await loop.sock_recv(conn, 4096)
        if not chunk:
            return
        seen += chunk


def _peer(conn: socket.socket) -> str:
    with contextlib.suppress(OSError):
        return str(conn.getpeername()[0])
    return ""
