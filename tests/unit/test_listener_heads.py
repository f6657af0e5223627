"""The REST listener's head deadline (gthulhu_node/rest/listener.py) on a real socket: a connection whose
first request head is in is finished, however soon after the connect the head is parsed."""

from __future__ import annotations

import asyncio
import socket

from gthulhu_node.rest.listener import BoundedListener, ListenerStats


class _HeadAtOnce(asyncio.Protocol):
    """A protocol whose request head is parsed as soon as it exists: the earliest aiohttp can do it."""

    listener: BoundedListener | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert self.listener is not None
        self.listener.head_received(self)


async def _held_after_the_deadline(deadline_s: float) -> tuple[bool, int]:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stats = ListenerStats()
    listener = BoundedListener(_HeadAtOnce, server, None, max_connections=4, handshake_timeout_s=deadline_s,
                               stats=stats)
    _HeadAtOnce.listener = listener
    running = asyncio.create_task(listener.run())
    client = socket.create_connection(server.getsockname())
    try:
        await asyncio.sleep(deadline_s * 4)
        client.setblocking(False)
        try:
            closed = client.recv(1) == b""
        except BlockingIOError:
            closed = False  # nothing to read and not closed: still held
        return not closed, stats.handshakes_failed
    finally:
        client.close()
        running.cancel()
        server.close()


def test_a_request_head_parsed_before_the_admission_resumed_finishes_the_connection() -> None:
    """Before the fix the connection was registered only after `connect_accepted_socket` returned, so a
    head parsed in between found nothing: the connection stayed under the deadline and was closed (a
    10,001-policy push under make test's load got no answer). Failed before: (False, 1)."""
    assert asyncio.run(_held_after_the_deadline(0.3)) == (True, 0)
