"""The service lifecycle against a real notify socket and real signals, with a stand-in agent: READY only
after start() returned, the watchdog fed from the engine hook (and silent once the engine stops calling
it), SIGHUP -> reload with RELOADING=1, SIGTERM -> STOPPING=1 and a clean stop, start failures -> exit 1."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.config import AgentConfig, LogConfig, MetricsConfig
from gthulhu_node.lifecycle import Component, Step
from gthulhu_node.service import Service
from gthulhu_node.systemd import Notifier


class FakeEngine:
    def __init__(self) -> None:
        self.stuck = threading.Event()
        self._stop = threading.Event()

    def add_periodic(self, name: str, interval_s: float, fn: Callable[[], None]) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s / 4):
                if not self.stuck.is_set():
                    fn()

        threading.Thread(target=loop, daemon=True).start()

    def add_latency_listener(self, listener: Callable[[float], None]) -> None:
        pass

    def close(self) -> None:
        self._stop.set()


class FakeAgent:
    def __init__(self, events: list[str], fail: bool = False) -> None:
        self.events = events
        self.fail = fail
        self.engine = FakeEngine()

    def start(self) -> None:
        time.sleep(0.3)
        if self.fail:
            raise RuntimeError("sched_ext is not available")
        self.events.append("agent.start returned")

    def stop(self) -> None:
        self.engine.close()
        self.events.append("agent.stop")

    def components(self) -> list[Component]:
        """The service starts the agent's parts through its supervisor: here one part, this agent."""
        return [Step("agent", self.start, self.stop)]

    def reload(self) -> None:
        self.events.append("agent.reload")

    def summary(self) -> str:
        return "ready: backend sched_ext, 1 intent applied, 2 tasks matched"

    def matches(self) -> list[Any]:
        return []

    def stats(self) -> None:
        return None


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    yield path, sock
    sock.close()


@pytest.fixture
def restore_signals() -> Iterator[None]:
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def config() -> AgentConfig:
    return AgentConfig(log=LogConfig(format="json"), metrics=MetricsConfig(listen="127.0.0.1:0"))


def collect(sock: socket.socket, events: list[str], done: threading.Event) -> None:
    sock.settimeout(0.1)
    while not done.is_set():
        try:
            events.append("notify " + sock.recv(4096).decode().replace("\n", " "))
        except TimeoutError:
            continue


def test_lifecycle(
    notify: tuple[str, socket.socket], restore_signals: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, sock = notify
    events: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: events.append("heap frozen"))
    agent = FakeAgent(events)
    done = threading.Event()
    reader = threading.Thread(target=collect, args=(sock, events, done))
    reader.start()

    def driver() -> None:
        while not any(e.startswith("notify READY=1") for e in events):
            time.sleep(0.05)
        while sum(e == "notify WATCHDOG=1" for e in events) < 2:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGHUP)
        while "agent.reload" not in events:
            time.sleep(0.05)
        agent.engine.stuck.set()
        time.sleep(0.2)  # pings sent before this point have been received by now
        events.append("engine stuck")
        time.sleep(1.0)  # five watchdog intervals
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=driver, daemon=True).start()
    notifier = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "400000"})
    code = Service(config(), agent_factory=lambda c: agent, notifier=notifier).run()
    time.sleep(0.3)
    done.set()
    reader.join()

    assert code == 0
    ready = next(i for i, e in enumerate(events) if e.startswith("notify READY=1"))
    assert events.index("agent.start returned") < ready
    assert "STATUS=ready: backend sched_ext" in events[ready]
    # once, after the parts started: the start-up heap, not the policy's first objects only
    assert events.count("heap frozen") == 1
    assert events.index("heap frozen") > events.index("agent.start returned")
    assert events[0].startswith("notify STATUS=starting")
    after_ready = events[ready:]
    assert "notify WATCHDOG=1" in after_ready[: after_ready.index("engine stuck")]
    reloading = [i for i, e in enumerate(events) if e.startswith("notify RELOADING=1 MONOTONIC_USEC=")]
    assert len(reloading) == 1 and "agent.reload" in events
    assert any(e.startswith("notify READY=1") for e in events[reloading[0]:])  # the reload's completion
    stuck = events.index("engine stuck")
    stopping = events.index("notify STOPPING=1")
    assert "notify WATCHDOG=1" not in events[stuck:stopping]  # a stuck engine stops the pings
    assert "agent.stop" in events[stuck:]


def test_start_failure_exits_1_without_ready(
    notify: tuple[str, socket.socket], restore_signals: None
) -> None:
    path, sock = notify
    events: list[str] = []
    notifier = Notifier({"NOTIFY_SOCKET": path})
    code = Service(config(), agent_factory=lambda c: FakeAgent(events, fail=True), notifier=notifier).run()
    sock.settimeout(0.2)
    messages = []
    while True:
        try:
            messages.append(sock.recv(4096).decode())
        except TimeoutError:
            break
    assert code == 1
    assert not any("READY=1" in m for m in messages)
    assert messages[-1] == "STATUS=failed to start: sched_ext is not available"


class CountingNotifier(Notifier):
    def __init__(self, environ: dict[str, str]) -> None:
        super().__init__(environ)
        self.pings = 0

    def watchdog(self) -> bool:
        self.pings += 1
        return True


def test_watchdog_pinged_every_half_watchdog_sec(monkeypatch: pytest.MonkeyPatch) -> None:
    """WatchdogSec=30 means a ping every 15 s (sd_watchdog_enabled's half), not every 7.5 s: the notifier's
    interval is already the half, the engine hook must not halve it again."""
    notifier = CountingNotifier({"WATCHDOG_USEC": "30000000"})
    assert notifier.watchdog_interval_s == 15.0
    service = Service(config(), notifier=notifier)
    clock = [1000.0]
    monkeypatch.setattr("gthulhu_node.service.time.monotonic", lambda: clock[0])
    for _ in range(600):  # 60 s of engine hook calls, one every 0.1 s, the main loop alive throughout
        clock[0] += 0.1
        service._main_alive = clock[0]
        service._feed_watchdog()
    assert notifier.pings == 4


def test_privileges_are_released_before_anything_starts_a_thread(
    notify: tuple[str, socket.socket], restore_signals: None
) -> None:
    """Capabilities are per thread (gthulhu_node/capabilities.py): the drop must come before the agent,
    the metrics listener or the start worker exist, and status shows what it did."""
    path, _sock = notify
    events: list[str] = []
    created: list[FakeAgent] = []

    class Released:
        def describe(self) -> str:
            return "CAP_SYS_ADMIN dropped at start"

    def release(cfg: AgentConfig) -> Released:
        events.append("release")
        return Released()

    def factory(cfg: AgentConfig) -> FakeAgent:
        events.append("agent created")
        agent = FakeAgent(events, fail=True)
        agent.capabilities = ""  # type: ignore[attr-defined]
        created.append(agent)
        return agent

    service = Service(config(), agent_factory=factory, notifier=Notifier({"NOTIFY_SOCKET": path}),
                      release_privileges=release)
    assert service.run() == 1
    assert events[:2] == ["release", "agent created"]
    assert created[0].capabilities == "CAP_SYS_ADMIN dropped at start"  # type: ignore[attr-defined]
