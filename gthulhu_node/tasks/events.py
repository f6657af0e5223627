"""Task events from the kernel's netlink proc connector: fork, exec, comm (rename), uid change and exit,
per thread.

The constants (message codes, multicast group) come from pyroute2's `cn_proc` module, but the socket is
read here with plain `socket` calls and `struct`: pyroute2 0.9's socket wraps an asyncio transport with
its own buffering, and the lab saw a COMM event handed over only when the next datagram arrived. Reading
the datagrams ourselves lets one wakeup drain every pending message with non-blocking `recv_into` until
EAGAIN, at a few microseconds per event (docs/watching.md has the measurements).

On lost events (ENOBUFS: the receive buffer overflowed) or any socket error, `read_pending` reports it
in the batch; the owner then opens a fresh socket and does a full rescan at once.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import os
import socket
import struct
import time
from dataclasses import dataclass, field

import structlog
from pyroute2.netlink import NETLINK_CONNECTOR, NLMSG_DONE
from pyroute2.netlink.connector.cn_proc import (
    CN_IDX_PROC,
    CN_VAL_PROC,
    PROC_CN_MCAST_IGNORE,
    PROC_CN_MCAST_LISTEN,
    PROC_EVENT_COMM,
    PROC_EVENT_EXEC,
    PROC_EVENT_EXIT,
    PROC_EVENT_FORK,
    PROC_EVENT_UID,
)

from gthulhu_node.errors import Unavailable

log = structlog.get_logger(__name__)

SO_RCVBUFFORCE = getattr(socket, "SO_RCVBUFFORCE", 33)
DEFAULT_RCVBUF = 16 << 20

# struct nlmsghdr (16) + struct cn_msg (20), then struct proc_event: what, cpu, timestamp_ns, event_data.
_NLMSGHDR = struct.Struct("=IHHII")
_CN_MSG = struct.Struct("=IIIIHH")
_EVENT_HEAD = struct.Struct("=IIQ")
_HEAD_SIZE = _NLMSGHDR.size + _CN_MSG.size  # 36
_DATA_OFFSET = _HEAD_SIZE + _EVENT_HEAD.size  # 52
_PID_PAIR = struct.Struct("=II")
_FORK = struct.Struct("=IIII")
_COMM_LEN = 16
_MAX_DATAGRAM = 65536


class EventKind(enum.IntEnum):
    FORK = PROC_EVENT_FORK
    EXEC = PROC_EVENT_EXEC
    COMM = PROC_EVENT_COMM
    UID = PROC_EVENT_UID
    EXIT = PROC_EVENT_EXIT


@dataclass(frozen=True, slots=True)
class ProcEvent:
    """One task event. For FORK, tid/tgid name the new task; `comm` is set only for COMM events.

    `timestamp_ns` is the kernel's CLOCK_MONOTONIC time of the event (comparable with
    time.monotonic_ns()), so the reaction latency can be measured from the event itself.
    """

    kind: EventKind
    tid: int
    tgid: int
    timestamp_ns: int
    comm: str | None = None
    parent_tid: int = 0
    parent_tgid: int = 0


@dataclass(slots=True)
class EventBatch:
    """What one wakeup drained. `lost` means events were dropped: a full rescan is needed at once."""

    events: list[ProcEvent] = field(default_factory=list)
    lost: bool = False
    error: str = ""
    datagrams: int = 0


class EventsUnavailable(Unavailable, OSError):
    """The proc connector cannot be used here (not root, no CONFIG_PROC_EVENTS, another pid namespace)."""


def parse_datagram(buf: memoryview | bytes, size: int, out: list[ProcEvent]) -> None:
    """Append the task events in one datagram (one or more netlink messages) to `out`.

    Events other than fork/exec/comm/uid/exit (gid, sid, ptrace, coredump, the listen ack) are skipped. A
    uid event carries the new real and effective uid; only that it happened is kept: who the process is
    is read again from /proc (the owner selectors, docs/security.md).
    """
    offset = 0
    while offset + _DATA_OFFSET <= size:
        msg_len = _NLMSGHDR.unpack_from(buf, offset)[0]
        if msg_len < _DATA_OFFSET or offset + msg_len > size:
            break
        what, _cpu, ts = _EVENT_HEAD.unpack_from(buf, offset + _HEAD_SIZE)
        data = offset + _DATA_OFFSET
        if what == PROC_EVENT_FORK:
            ptid, ptgid, tid, tgid = _FORK.unpack_from(buf, data)
            out.append(ProcEvent(EventKind.FORK, tid, tgid, ts, None, ptid, ptgid))
        elif what == PROC_EVENT_COMM:
            tid, tgid = _PID_PAIR.unpack_from(buf, data)
            raw = bytes(buf[data + 8 : data + 8 + _COMM_LEN])
            comm = raw.split(b"\0", 1)[0].decode("utf-8", "replace")
            out.append(ProcEvent(EventKind.COMM, tid, tgid, ts, comm))
        elif what == PROC_EVENT_EXIT:
            tid, tgid = _PID_PAIR.unpack_from(buf, data)
            out.append(ProcEvent(EventKind.EXIT, tid, tgid, ts))
        elif what == PROC_EVENT_EXEC:
            tid, tgid = _PID_PAIR.unpack_from(buf, data)
            out.append(ProcEvent(EventKind.EXEC, tid, tgid, ts))
        elif what == PROC_EVENT_UID:
            tid, tgid = _PID_PAIR.unpack_from(buf, data)
            out.append(ProcEvent(EventKind.UID, tid, tgid, ts))
        offset += (msg_len + 3) & ~3


def _control_message(op: int) -> bytes:
    payload = struct.pack("=I", op)
    cn = _CN_MSG.pack(CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(payload), 0)
    total = _NLMSGHDR.size + len(cn) + len(payload)
    return _NLMSGHDR.pack(total, NLMSG_DONE, 0, 0, os.getpid()) + cn + payload


class ProcEventSource:
    """A non-blocking proc connector subscription. Not thread-safe: one owner thread reads it.

    Use `fileno()` with select/poll; on readiness call `read_pending()`, which drains every pending
    datagram. `reopen()` replaces the socket (after lost events or an error).
    """

    def __init__(self, rcvbuf: int = DEFAULT_RCVBUF) -> None:
        self._rcvbuf = rcvbuf
        self._sock: socket.socket | None = None
        self._buf = bytearray(_MAX_DATAGRAM)
        self._view = memoryview(self._buf)
        self.reopens = 0

    def open(self) -> None:
        """Subscribe. Raises EventsUnavailable when the kernel refuses."""
        self.close()
        try:
            sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        except OSError as exc:
            raise EventsUnavailable(exc.errno, f"proc connector socket: {exc.strerror}") from None
        try:
            for opt in (SO_RCVBUFFORCE, socket.SO_RCVBUF):
                try:
                    sock.setsockopt(socket.SOL_SOCKET, opt, self._rcvbuf)
                    break
                except PermissionError:
                    continue
            sock.bind((0, CN_IDX_PROC))
            sock.send(_control_message(PROC_CN_MCAST_LISTEN))
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise EventsUnavailable(exc.errno, f"proc connector subscribe: {exc.strerror}") from None
        self._sock = sock

    def reopen(self) -> None:
        self.reopens += 1
        self.open()

    def close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(OSError):
            self._sock.send(_control_message(PROC_CN_MCAST_IGNORE))
        self._sock.close()
        self._sock = None

    def fileno(self) -> int:
        if self._sock is None:
            raise EventsUnavailable(errno.EBADF, "proc connector socket is not open")
        return self._sock.fileno()

    @property
    def is_open(self) -> bool:
        return self._sock is not None

    def read_pending(self) -> EventBatch:
        """Drain every datagram pending now. Never blocks; errors are reported in the batch."""
        batch = EventBatch()
        sock = self._sock
        if sock is None:
            batch.error = "socket is not open"
            return batch
        recv_into, view, out = sock.recv_into, self._view, batch.events
        while True:
            try:
                size = recv_into(view)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    batch.lost = True
                    continue  # the socket stays usable; keep draining what is left
                batch.error = f"{exc.strerror} (errno {exc.errno})"
                break
            batch.datagrams += 1
            parse_datagram(view, size, out)
        return batch


def monotonic_ns() -> int:
    """The clock the kernel stamps proc events with."""
    return time.monotonic_ns()
