"""The agent's status thread (gthulhu_node/agent_status.py): when it rebuilds status after a frame."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from gthulhu_node import agent_status as agent_module
from gthulhu_node.agent_status import AgentStatus
from gthulhu_node.workers import Flag, WorkerThread


class StatusThread:
    """The status loop and wake-ups of a real AgentStatus, over a refresh that records when it ran."""

    def __init__(self) -> None:
        self._stopped = Flag()
        self._refreshed_at = 0.0
        self._refreshes = self._refresh_queue()
        self.refreshes: list[float] = []
        self.refreshed = threading.Event()

    def refresh(self) -> None:
        self._refreshed_at = time.monotonic()
        self.refreshes.append(self._refreshed_at)
        self.refreshed.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(AgentStatus, name).__get__(self)


@pytest.mark.timeout(60)
def test_a_frame_soon_after_a_refresh_is_shown_once_the_rate_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame within STATUS_MIN_INTERVAL_S of the last refresh used to leave only a note that the loop
    read before its next wait, not during it: the frame showed at the next STATUS_INTERVAL_S (measured 0.90
    s later). With that interval made an hour, the old loop never shows it and this test times out."""
    monkeypatch.setattr(agent_module, "STATUS_INTERVAL_S", 3600.0)
    st = StatusThread()
    loop = WorkerThread("test-status", st._run_status)
    loop.start()
    try:
        st.wake_now()  # a policy in effect: a refresh at once
        assert st.refreshed.wait(30)
        st.refreshed.clear()
        st._on_frame(None)  # a frame right after it
        assert st.refreshed.wait(30)
        assert st.refreshes[1] - st.refreshes[0] >= agent_module.STATUS_MIN_INTERVAL_S * 0.9
    finally:
        st._stopped.set()
        loop.stop()


@pytest.mark.timeout(60)
def test_frames_in_a_burst_are_shown_at_the_rate_not_each(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agent_module, "STATUS_INTERVAL_S", 3600.0)
    st = StatusThread()
    loop = WorkerThread("test-status", st._run_status)
    loop.start()
    try:
        st.wake_now()
        assert st.refreshed.wait(30)
        end = time.monotonic() + 1.0
        while time.monotonic() < end:  # ten frames a second, as the engine publishes at most
            st._on_frame(None)
            time.sleep(0.1)
        gaps = [b - a for a, b in zip(st.refreshes, st.refreshes[1:], strict=False)]
        assert gaps and min(gaps) >= agent_module.STATUS_MIN_INTERVAL_S * 0.9, st.refreshes
    finally:
        st._stopped.set()
        loop.stop()
