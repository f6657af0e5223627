"""The admission rule every listener uses (gthulhu_node/peers.py): per-peer and total caps, the slowest
unfinished connection evicted, deadlines, the fd reserve, and who a loopback peer is."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from gthulhu_node.peers import FdBudget, PeerTable, loopback_uid, peer_key
from tests.host import unprivileged


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def table(
    total: int = 4, per_peer: int = 2, budget: FdBudget | None = None
) -> tuple[PeerTable, Clock, list[str]]:
    clock, closed = Clock(), list[str]()
    return PeerTable(total, per_peer, 3.0, budget, clock), clock, closed


def test_a_peer_past_its_share_evicts_its_own_slowest_unfinished_connection() -> None:
    t, clock, closed = table()
    a1 = t.admit("uid:65534", lambda: closed.append("a1"))
    clock.now = 1
    a2 = t.admit("uid:65534", lambda: closed.append("a2"))
    clock.now = 2
    a3 = t.admit("uid:65534", lambda: closed.append("a3"))
    assert a1 and a2 and a3 and closed == ["a1"]
    t.finish(a2)
    t.finish(a3)
    assert t.admit("uid:65534", lambda: None) is None  # every one of its slots serves a request
    assert t.admit("uid:0", lambda: None) is not None  # another user still gets in
    s = t.stats()
    assert (s.refused, s.evicted, s.held, s.peers) == (1, 1, 3, 2)


def test_at_the_total_the_slowest_unfinished_connection_of_anyone_goes() -> None:
    t, clock, closed = table(total=3, per_peer=3)
    first = t.admit("addr:10.0.0.1", lambda: closed.append("first"))
    clock.now = 1
    t.admit("addr:10.0.0.2", lambda: closed.append("second"))
    clock.now = 2
    done = t.admit("addr:10.0.0.3", lambda: closed.append("done"))
    assert first and done
    t.finish(first)  # finished: never evicted, however old
    assert t.admit("addr:10.0.0.4", lambda: None) is not None
    assert closed == ["second"]
    t.finish(done)
    t.release(first)
    assert t.stats().held == 2


def test_at_the_total_the_biggest_holder_gives_first() -> None:
    """One user's flood must not push out another user's single connection still sending its head."""
    t, clock, closed = table(total=4, per_peer=4)
    t.admit("uid:0", lambda: closed.append("scrape"))  # the oldest of all, unfinished
    for n in range(3):
        clock.now = 1 + n
        t.admit("uid:65534", lambda n=n: closed.append(f"flood{n}"))
    clock.now = 10
    assert t.admit("uid:65534", lambda: None) is not None
    assert closed == ["flood0"]


def test_unfinished_connections_past_the_deadline_are_dropped() -> None:
    t, clock, closed = table()
    slow = t.admit("uid:65534", lambda: closed.append("slow"))
    quick = t.admit("uid:0", lambda: closed.append("quick"))
    assert slow and quick
    t.finish(quick)
    clock.now = 3.5
    assert t.expire() == 1 and closed == ["slow"] and t.stats().expired == 1


class Budget(FdBudget):
    def __init__(self, room: int) -> None:
        super().__init__(reserve=0)
        self.left = room

    def room(self) -> int:
        return self.left


def test_the_fd_reserve_is_never_given_to_a_connection() -> None:
    budget = Budget(room=0)
    t, clock, closed = table(total=100, per_peer=100, budget=budget)
    assert t.admit("uid:1", lambda: closed.append("old")) is not None  # fits exactly
    budget.left = -1  # the next connection's fd is already one too many
    clock.now = 1
    newer = t.admit("uid:2", lambda: None)
    assert newer is not None and closed == ["old"]  # the unfinished one made room
    t.finish(newer)
    assert t.admit("uid:3", lambda: None) is None  # nothing unfinished to give back: refused
    assert t.stats().held == 1


def test_fd_budget_counts_this_process() -> None:
    budget = FdBudget(reserve=10)
    before = budget.open_fds()
    r, w = os.pipe()
    try:
        assert budget.open_fds() == before + 2
        assert budget.room() == budget.limit() - 10 - before - 2
    finally:
        os.close(r)
        os.close(w)


def test_a_loopback_peer_is_its_user_and_a_unix_peer_too() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server, \
            socket.create_connection(server.getsockname()) as client:
        conn, _ = server.accept()
        with conn:
            assert peer_key(conn) == f"uid:{os.geteuid()}"
            assert loopback_uid(client.getsockname(), server.getsockname()) == os.geteuid()
    a, b = socket.socketpair()
    with a, b:
        assert peer_key(a) == f"uid:{os.geteuid()}"


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
def test_a_loopback_peer_of_another_user_is_that_user(host: str) -> None:
    """The kernel is asked for the peer's socket, not ours (both ends are on this host: asked the wrong
    way round, sock_diag answers with our own socket, uid 0, for every peer)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.create_server((host, 0), family=family) as server:
        port = server.getsockname()[1]
        client = subprocess.Popen(unprivileged.command(
            "nobody", "", "import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2])))"
            "; sys.stdin.read()", host, str(port)), stdin=subprocess.PIPE, cwd="/")
        try:
            conn, _ = server.accept()
            with conn:
                assert peer_key(conn) == "uid:65534"
        finally:
            client.kill()
            client.wait()


def test_loopback_uid_reads_the_peer_row_of_the_kernel_table(tmp_path: Path) -> None:
    # 127.0.0.1:40000 -> 127.0.0.1:9812, owned by 65534; the listener's own row is uid 0
    (tmp_path / "tcp").write_text(
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0100007F:2654 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1\n"
        "   1: 0100007F:9C40 0100007F:2654 01 00000000:00000000 00:00000000 00000000 65534        0 2\n"
    )
    assert loopback_uid(("127.0.0.1", 40000), ("127.0.0.1", 9812), str(tmp_path)) == 65534
    assert loopback_uid(("127.0.0.1", 40001), ("127.0.0.1", 9812), str(tmp_path)) is None
