"""Who a connecting peer is, how many connections each peer may hold, and the agent's file-descriptor reserve.

Why (issue 38, items 4 and 5): a cap on the total number of connections alone lets one peer take every
slot. Sixteen connections from `nobody` sending a byte every 3 s kept every metrics scrape out (0 of 15
answered); 200 half-finished TLS handshakes let the Manager through 4 times in 25; and with the agent's fd
limit at its baseline + 64, the listeners' caps (16 + 64) took the descriptors the agent needs to read
/proc, policies.d and to answer on its status socket. So every listener admits through a `PeerTable`:
- a peer is a user on this host, an address otherwise (`peer_key`): every local client connects from
  127.0.0.1, so an address says nothing there. A loopback TCP peer's uid is the owner of its socket,
  asked of the kernel by the socket's exact addresses (sock_diag netlink, ~20 us; the socket table in
  /proc/net/tcp, tcp6, when that fails: ~12 ms on a host with a thousand sockets, which on every accept
  of a flood made scrapes wait 0.9 s); a unix socket peer's is SO_PEERCRED. A uid that cannot be read
  (the socket is gone: the peer already closed) falls back to the address;
- each peer holds at most `max_per_peer` connections; one more evicts that peer's slowest unfinished
  connection (unfinished: its TLS handshake or request head has not arrived; slowest: unfinished for the
  longest), or is refused when all of that peer's are finished;
- at `max_total`, or when the process has fewer than `FdBudget.reserve` descriptors left, a new
  connection evicts the slowest unfinished connection of the peer holding the most connections, or is
  refused when none is unfinished;
- an unfinished connection past `deadline_s` is dropped (`expire`, called by the listener's loop).
Leaf module (docs/design.md, "Layers"): it imports nothing of ours.
"""

from __future__ import annotations

import ipaddress
import os
import resource
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_SO_PEERCRED = getattr(socket, "SO_PEERCRED", 17)
# fds the listeners never take: status socket connections, /proc reads (a few at a time per thread),
# policy files, the state file and its journal, the proc connector, gRPC's own wakeup fds
FD_RESERVE = 48


class FdBudget:
    """The descriptors the process may still give to connections: its soft RLIMIT_NOFILE minus what is
    open minus the reserve. Counted from /proc/self/fd at each question (~0.1 ms at a few hundred fds):
    what the other parts hold changes, and a count kept by the listeners alone would miss it."""

    def __init__(self, reserve: int = FD_RESERVE, fd_dir: str = "/proc/self/fd") -> None:
        self.reserve = reserve
        self._fd_dir = fd_dir

    def limit(self) -> int:
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    def open_fds(self) -> int:
        """Descriptors open now; the whole limit when they cannot even be listed (EMFILE)."""
        try:
            return len(os.listdir(self._fd_dir)) - 1  # the listing's own descriptor
        except OSError:
            return self.limit()

    def room(self) -> int:
        return self.limit() - self.reserve - self.open_fds()


def _hex_endpoint(family: int, host: str, port: int) -> str:
    """An endpoint as /proc/net/tcp{,6} writes it: the address in the kernel's byte order, then the port."""
    packed = socket.inet_pton(family, host)
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return "".join(f"{w:08X}" for w in words) + f":{port:04X}"


_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG_ERROR = 2
_NLMSGHDR = struct.Struct("=IHHII")
# request: struct inet_diag_req_v2 (family, protocol, ext, pad, states), then struct inet_diag_sockid
# (sport, dport big-endian, src[16], dst[16], interface, cookie[2]: ~0 is "no cookie")
_DIAG_UID_OFFSET = _NLMSGHDR.size + 4 + 48 + 12  # inet_diag_msg: 4 bytes, sockid, expires/rqueue/wqueue


def _diag_uid(family: int, local: tuple[str, int], remote: tuple[str, int]) -> int | None:
    """The uid of the TCP socket whose own end is `local` and whose peer is `remote`, asked of the kernel
    by its exact address (sock_diag): one hash lookup, where /proc/net/tcp formats every socket of the
    host (a few ms with a thousand of them, on every accept of a flood)."""
    src = socket.inet_pton(family, local[0]).ljust(16, b"\0")  # the socket's own end: source, sport
    dst = socket.inet_pton(family, remote[0]).ljust(16, b"\0")
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
    req += struct.pack("!HH", local[1], remote[1]) + src + dst
    req += struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)
    msg = _NLMSGHDR.pack(_NLMSGHDR.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + req
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.send(msg)
        reply = nl.recv(8192)
    if len(reply) < _DIAG_UID_OFFSET + 4 or _NLMSGHDR.unpack_from(reply)[1] == _NLMSG_ERROR:
        return None
    return int(struct.unpack_from("=I", reply, _DIAG_UID_OFFSET)[0])


def loopback_uid(peer: tuple[str, int], ours: tuple[str, int], net_dir: str = "/proc/net") -> int | None:
    """The uid owning the socket at the other end of our TCP connection `ours` <- `peer`, both on this
    host's loopback; None when no such socket exists (it closed meanwhile) or it cannot be asked. Asked of
    the kernel by sock_diag; the socket table in /proc/net (`net_dir`) when that fails."""
    family = socket.AF_INET6 if ":" in peer[0] else socket.AF_INET
    if net_dir == "/proc/net":
        try:
            return _diag_uid(family, peer, ours)
        except OSError:
            pass
    return _table_uid(family, peer, ours, net_dir)


def _table_uid(family: int, peer: tuple[str, int], ours: tuple[str, int], net_dir: str) -> int | None:
    local = _hex_endpoint(family, peer[0], peer[1])
    remote = _hex_endpoint(family, ours[0], ours[1])
    table = "tcp6" if family == socket.AF_INET6 else "tcp"
    try:
        with open(f"{net_dir}/{table}", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > 7 and fields[1] == local and fields[2] == remote:
            return int(fields[7])
    return None


def _is_loopback(host: str) -> bool:
    try:
        addr = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(addr, "ipv4_mapped", None)
    return bool(addr.is_loopback or (mapped is not None and mapped.is_loopback))


def peer_key(sock: socket.socket, net_dir: str = "/proc/net") -> str:
    """`uid:N` for a unix socket or loopback peer, `addr:IP` otherwise (module docstring)."""
    if sock.family == socket.AF_UNIX:
        _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, _SO_PEERCRED, 12))
        return f"uid:{uid}"
    try:
        peer = sock.getpeername()
        ours = sock.getsockname()
    except OSError:
        return "addr:?"
    host = str(peer[0])
    if _is_loopback(host):
        uid = loopback_uid((host, int(peer[1])), (str(ours[0]), int(ours[1])), net_dir)
        if uid is not None:
            return f"uid:{uid}"
    return f"addr:{host}"


@dataclass(slots=True, eq=False)
class Peer:
    """One admitted connection. `close` drops it (from any thread); `alive` says whether it still holds
    its slot (a listener that learns of the end only lazily gives one)."""

    key: str
    since: float
    close: Callable[[], None]
    alive: Callable[[], bool] | None = None
    finished: bool = False


@dataclass(slots=True)
class PeerStats:
    refused: int = 0  # new connections closed at once: their peer's slots, or every slot, were finished
    evicted: int = 0  # unfinished connections dropped to make room for a new one
    expired: int = 0  # unfinished connections dropped at their deadline
    held: int = 0
    peers: int = 0


@dataclass(slots=True)
class PeerTable:
    """The admission rule of one listener (module docstring). Thread-safe."""

    max_total: int
    max_per_peer: int
    deadline_s: float
    budget: FdBudget | None = None
    clock: Callable[[], float] = time.monotonic
    _peers: list[Peer] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stats: PeerStats = field(default_factory=PeerStats)

    def admit(
        self, key: str, close: Callable[[], None], alive: Callable[[], bool] | None = None
    ) -> Peer | None:
        """Admit a new connection of `key` (already accepted: it holds an fd), evicting what the rule
        says; None when it must be closed (counted as refused; the caller closes it)."""
        evict: list[Peer] = []
        with self._lock:
            self._prune()
            mine = [p for p in self._peers if p.key == key]
            if len(mine) >= self.max_per_peer and not self._evict_from(mine, evict):
                self._stats.refused += 1
                return None
            while len(self._peers) >= self.max_total or self._short_of_fds(len(evict)):
                if not self._evict_from(self._peers, evict):
                    self._stats.refused += 1
                    self._restore(evict)
                    return None
            peer = Peer(key, self.clock(), close, alive)
            self._peers.append(peer)
            self._stats.evicted += len(evict)
        for victim in evict:
            victim.close()
        return peer

    def _short_of_fds(self, freeing: int) -> bool:
        # the new connection's fd is already open; the victims chosen so far will give theirs back
        return self.budget is not None and self.budget.room() + freeing < 0

    def _evict_from(self, pool: list[Peer], evict: list[Peer]) -> bool:
        """Evict the slowest unfinished connection of `pool`, taken from the peer that holds the most:
        at the total (or the fd reserve) one user's flood gives up its own connections before another
        user's single connection whose head is still on its way."""
        unfinished = [p for p in pool if not p.finished and p not in evict]
        if not unfinished:
            return False
        held: dict[str, int] = {}
        for p in self._peers:
            held[p.key] = held.get(p.key, 0) + 1
        victim = min(unfinished, key=lambda p: (-held[p.key], p.since))
        self._peers.remove(victim)
        evict.append(victim)
        return True

    def _restore(self, evict: list[Peer]) -> None:
        """A refusal evicts nobody: the victims chosen for it keep their slots."""
        self._peers.extend(evict)
        evict.clear()

    def finish(self, peer: Peer) -> None:
        """Its handshake and request head are in: no longer evictable, no longer under the deadline."""
        peer.finished = True

    def release(self, peer: Peer) -> None:
        """The connection is closed: its slot (and its fd) are free."""
        with self._lock:
            if peer in self._peers:
                self._peers.remove(peer)

    def expire(self) -> int:
        """Drop the unfinished connections past their deadline; how many were."""
        now = self.clock()
        with self._lock:
            late = [p for p in self._peers if not p.finished and now - p.since > self.deadline_s]
            for p in late:
                self._peers.remove(p)
            self._stats.expired += len(late)
        for p in late:
            p.close()
        return len(late)

    def _prune(self) -> None:
        self._peers = [p for p in self._peers if p.alive is None or p.alive()]

    def stats(self) -> PeerStats:
        with self._lock:
            self._prune()
            s = self._stats
            keys = {p.key for p in self._peers}
            return PeerStats(s.refused, s.evicted, s.expired, len(self._peers), len(keys))
