"""The real `gthulhu-node run` process as systemd drives it, on this machine (dry-run backend forced):
the sd_notify conversation over a real socket (READY only once the intents are applied, STATUS, WATCHDOG
pings, RELOADING on SIGHUP, STOPPING on SIGTERM), the Prometheus endpoint over HTTP, and exit codes.
The same in a real systemd with the real scheduler: tests/vm/test_service.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from tests.host.agent_support import PYTHON, REPO, NamedThread, client, short_dir, wait_for, write_config
from tests.prom import scrape

pytestmark = pytest.mark.host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NotifyListener:
    """What systemd's notify socket would receive, in order."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue

    def first(self, prefix: str) -> str | None:
        return next((m for m in list(self.messages) if m.startswith(prefix)), None)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@contextmanager
def agent_process(
    base: Path, config: Path, **env: str
) -> Iterator[tuple[subprocess.Popen[bytes], NotifyListener]]:
    """The real `gthulhu-node run` with systemd's notify socket in `base` and its output in base/agent.log;
    killed at the end if it is still running."""
    listener = NotifyListener(base / "notify")
    with (base / "agent.log").open("wb") as out:
        proc = subprocess.Popen([str(PYTHON), "-m", "gthulhu_node", "run", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, cwd="/",
                                env=dict(os.environ, PYTHONPATH=str(REPO), NOTIFY_SOCKET=str(base / "notify"),
                                         **env))
        try:
            yield proc, listener
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            listener.close()


@pytest.fixture
def base() -> Iterator[Path]:
    d = short_dir()
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def test_run_under_a_notify_socket(base: Path) -> None:
    port = free_port()
    config = write_config(base, metrics={"listen": f"127.0.0.1:{port}"}, log={"format": "json"})
    (base / "policies.d").mkdir()
    (base / "policies.d" / "svc.yaml").write_text(yaml.safe_dump(
        [{"id": "svc", "commandRegex": "^gn-svc-T[0-9]$", "priority": 10, "executionTime": 2000000}]))
    with (NamedThread("gn-svc-T0") as t0, NamedThread("gn-svc-T1"),
          agent_process(base, config, WATCHDOG_USEC="2000000", WATCHDOG_PID="") as (proc, listener)):
        def metric(name: str, *labels: tuple[str, str]) -> float:
            return scrape("127.0.0.1", port)[name][tuple(labels)]

        ready = wait_for(lambda: listener.first("READY=1"), timeout=60, what="READY=1")
        # READY carries the summary computed once the saved and local intents were applied
        assert "intents: 1 applied; 2 tasks matched" in ready, ready
        assert listener.messages[0].startswith("STATUS=starting")
        wait_for(lambda: listener.first("WATCHDOG=1"), timeout=10, what="a watchdog ping")

        got = scrape("127.0.0.1", port)
        assert got["gthulhu_node_matched_tasks"][(("intent", "local/svc"),)] == 2
        assert got["gthulhu_node_intent_applied_tasks"][(("intent", "local/svc"),)] == 2
        assert got["gthulhu_node_backend_writes_total"][(("op", "upsert"),)] >= 2
        assert got["gthulhu_node_intents"][(("state", "applied"),)] == 1
        assert got["gthulhu_node_ready"][()] == 1
        before = got["gthulhu_node_reaction_latency_seconds_count"][()]

        t0.rename("gn-other")  # an event after READY: its map write is observed in the histogram
        wait_for(lambda: metric("gthulhu_node_reaction_latency_seconds_count") > before,
                 timeout=10, what="the reaction latency to be observed")
        # the engine publishes the write with the reconciler's figures (at most 0.1 s after it, the
        # latency being observed during the write), the agent's status follows the published frames
        wait_for(lambda: metric("gthulhu_node_intent_applied_tasks", ("intent", "local/svc")) == 1,
                 timeout=10, what="the published figures to show 1 task")
        wait_for(lambda: metric("gthulhu_node_matched_tasks", ("intent", "local/svc")) == 1,
                 timeout=10, what="the intent status to show 1 task")
        got = scrape("127.0.0.1", port)
        assert got["gthulhu_node_backend_writes_total"][(("op", "delete"),)] >= 1

        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: listener.first("RELOADING=1"), timeout=10, what="RELOADING=1")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    messages = listener.messages
    reloading = next(i for i, m in enumerate(messages) if m.startswith("RELOADING=1"))
    assert any(m.startswith("READY=1") for m in messages[reloading + 1:])  # the reload finished
    assert "STOPPING=1" in messages
    text = (base / "agent.log").read_text()
    assert '"event": "service_ready"' in text and '"event": "service_stopped"' in text
    assert '"watchdog_from_engine": true' in text


def test_configuration_error_is_one_line_and_exit_2(base: Path) -> None:
    bad = base / "config.yaml"
    bad.write_text("metrics: {listen: 9812, bogus: 1}\n")
    proc = subprocess.run([str(PYTHON), "-m", "gthulhu_node", "run", "--config", str(bad)],
                          capture_output=True, text=True, timeout=60, cwd="/",
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gthulhu-node: configuration error: ")
    assert "bogus" in lines[0]


@pytest.mark.parametrize(
    ("sections", "words"),
    [
        ({"rest": {"enabled": True}}, "rest.jwt_private_key is required"),
        ({"rest": {"enabled": True, "jwt_private_key": "/nonexistent/key.pem"}}, "/nonexistent/key.pem"),
        ({"rest": {"enabled": True, "listen": "nowhere"}}, "rest.listen 'nowhere'"),
        ({"api": {"tcp_listen": "127.0.0.1:0"}}, "api.tls_cert, api.tls_key, api.tls_client_ca not"),
        ({"api": {"tcp_listen": "127.0.0.1:0", "tls_cert": "/nonexistent/c", "tls_key": "/nonexistent/k",
                  "tls_client_ca": "/nonexistent/ca"}}, "api.tls_cert: cannot read /nonexistent/c"),
        ({"metrics": {"listen": "localhost"}}, "metrics.listen 'localhost'"),
    ],
)
def test_configuration_errors_of_every_section_exit_2_before_any_socket_opens(
    base: Path, sections: dict, words: str  # type: ignore[type-arg]
) -> None:
    """These used to exit 1 with a traceback after the gRPC socket was open; systemd restarted them."""
    config = write_config(base, **sections)
    proc = subprocess.run([str(PYTHON), "-m", "gthulhu_node", "run", "--config", str(config)],
                          capture_output=True, text=True, timeout=60, cwd="/",
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gthulhu-node: configuration error: "), proc.stderr
    assert words in lines[0]
    assert not (base / "run").exists()  # the API socket's directory was never created


CAP_SYS_ADMIN = 1 << 21
CAP_SYS_NICE = 1 << 23


def thread_caps(pid: int) -> dict[int, dict[str, int]]:
    """{tid: {"CapEff": bits, ...}} of every thread of the process, from the kernel."""
    out: dict[int, dict[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        lines = (task / "status").read_text().splitlines()
        out[int(task.name)] = {k: int(v, 16) for k, v in (line.split(":\t") for line in lines
                                                          if line.startswith("Cap"))}
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="the agent must start with CAP_SYS_ADMIN to drop it: root")
def test_the_running_agent_holds_cap_sys_admin_in_no_thread(base: Path) -> None:
    """It used to hold CAP_SYS_ADMIN for its whole life (issue 18). Capabilities are per thread, so every
    thread is read: gRPC's, the engine's, the metrics listener's, the file watcher's."""
    config = write_config(base, metrics={"listen": f"127.0.0.1:{free_port()}"}, log={"format": "json"})
    with agent_process(base, config) as (proc, listener):
        wait_for(lambda: listener.first("READY=1"), timeout=60, what="READY=1")
        threads = thread_caps(proc.pid)
        assert len(threads) >= 5, threads
        for tid, caps in threads.items():
            held = caps["CapEff"] | caps["CapPrm"] | caps["CapInh"] | caps["CapAmb"]
            assert not held & CAP_SYS_ADMIN, (tid, caps)
            assert not caps["CapBnd"] & CAP_SYS_ADMIN, (tid, caps)  # root here: CAP_SETPCAP allows it
            assert caps["CapEff"] & CAP_SYS_NICE, (tid, caps)  # only CAP_SYS_ADMIN went
        with client(base / "run" / "api.sock") as stub:
            summary = stub.GetStatus(pb.GetStatusRequest(), timeout=30).agent
        assert summary.capabilities.startswith("CAP_SYS_ADMIN dropped at start, in every thread"), summary
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert '"event": "capabilities_dropped"' in (base / "agent.log").read_text()
