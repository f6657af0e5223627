"""The proc connector source on this machine's kernel: one wakeup hands over every pending event,
including the last one (docs/watching.md: the lab saw pyroute2 hold a COMM event back until the next
datagram arrived)."""

from __future__ import annotations

import ctypes
import select
import threading
import time

import pytest

from gthulhu_node.tasks.events import EventKind, ProcEvent, ProcEventSource

pytestmark = pytest.mark.host

_libc = ctypes.CDLL(None, use_errno=True)


def test_last_event_is_handed_over_without_a_following_datagram() -> None:
    src = ProcEventSource()
    src.open()
    renamed, release = threading.Event(), threading.Event()
    tid: list[int] = []

    def body() -> None:
        tid.append(threading.get_native_id())
        _libc.prctl(15, b"EngineCore_DP7", 0, 0, 0)
        renamed.set()
        release.wait()  # stays alive: no exit event follows the rename

    th = threading.Thread(target=body)
    try:
        before = time.monotonic_ns()
        th.start()
        assert renamed.wait(10)
        got: list[ProcEvent] = []
        deadline = time.monotonic() + 10
        while not any(e.kind is EventKind.COMM and e.tid == tid[0] for e in got):
            assert time.monotonic() < deadline, f"no COMM event for {tid[0]}: {got[-5:]}"
            select.select([src.fileno()], [], [], 1.0)
            got.extend(src.read_pending().events)
        ours = [e for e in got if e.tid == tid[0]]
        assert [e.kind for e in ours] == [EventKind.FORK, EventKind.COMM]
        assert ours[1].comm == "EngineCore_DP7" and ours[1].tgid == ours[0].tgid
        assert before <= ours[0].timestamp_ns <= ours[1].timestamp_ns <= time.monotonic_ns()
    finally:
        release.set()
        th.join()
        src.close()
