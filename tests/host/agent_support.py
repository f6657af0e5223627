"""Helpers for tests that run a real agent (dry-run backend forced: this machine's threads are never
rescheduled) and talk to it over its real unix socket."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc
import yaml

from gthulhu_node.agent import Agent
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2_grpc as pb_grpc
from gthulhu_node.backends.base import Backend
from gthulhu_node.config import AgentConfig
from tests.host import unprivileged

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
T = TypeVar("T")


def short_dir() -> Path:
    """A fresh directory with a short path (unix socket paths are limited to 108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="gn-", dir="/tmp"))
    d.chmod(0o755)
    return d


def config_dict(base: Path, **sections: dict[str, Any]) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "node": {"name": "test-node", "labels": {"gpu": "gb10"}},
        "backend": {"kind": "dry-run"},
        "api": {"socket": str(base / "run" / "api.sock")},
        "state": {"directory": str(base / "state")},
        "policies": {"directory": str(base / "policies.d")},
        "metrics": {"listen": ""},
        "watch": {"rescan_interval_s": 2.0},
    }
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    return doc


def write_config(base: Path, **sections: dict[str, Any]) -> Path:
    path = base / "config.yaml"
    path.write_text(yaml.safe_dump(config_dict(base, **sections)))
    return path


@contextmanager
def running_agent(
    base: Path | None = None, *, backend: Backend | None = None, backend_kind: str = "",
    **sections: dict[str, Any]
) -> Iterator[Agent]:
    """An agent of the test config; `backend` given as an object, or as the config's `backend.kind` (the
    lab's guests run the real ones)."""
    own = base is None
    base = base or short_dir()
    doc = config_dict(base, **sections)
    if backend_kind:
        doc["backend"] = {"kind": backend_kind}
    agent = Agent(AgentConfig.model_validate(doc), backend=backend)
    agent.start()
    try:
        yield agent
    finally:
        agent.stop()
        if own:
            shutil.rmtree(base, ignore_errors=True)


@contextmanager
def client(socket: Path) -> Iterator[pb_grpc.NodeAgentStub]:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        yield pb_grpc.NodeAgentStub(channel)


def stub_of(agent: Agent) -> Any:
    return client(agent.config.api.socket)


def intent(id: str, regex: str = "^gn-none$", priority: int = 5, **kw: Any) -> pb.Intent:
    return pb.Intent(id=id, command_regex=regex, priority=priority, **kw)


def wait_for(fn: Callable[[], T | None], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll until fn() returns something truthy. The timeout is a safety net, not a measurement."""
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def statuses(stub: Any, source: str = "") -> dict[str, Any]:
    return {s.key: s for s in stub.GetStatus(pb.GetStatusRequest(source=source)).intents}


_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NAME = 15


class NamedThread:
    """A thread of this test process that renames itself (prctl PR_SET_NAME) and idles until stopped."""

    def __init__(self, comm: str) -> None:
        self.comm = comm
        self.tid = 0
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._rename = threading.Event()
        self._new_name = ""
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        self._set(self.comm)
        self._ready.set()
        while not self._stop.is_set():
            if self._rename.wait(0.05):
                self._rename.clear()
                self._set(self._new_name)
                self._ready.set()

    @staticmethod
    def _set(name: str) -> None:
        if _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NAME)")

    def rename(self, name: str) -> None:
        self._ready.clear()
        self._new_name = name
        self._rename.set()
        self._ready.wait(5)
        self.comm = name

    def __enter__(self) -> NamedThread:
        self._thread.start()
        self._ready.wait(5)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def run_cli(
    *args: str, user: str | None = None, check: bool = False, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess (optionally as another user: tests/host/unprivileged.py, which works
    wherever the checkout is, unlike runuser)."""
    if user is not None:
        proc = unprivileged.cli(user, *args, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"{args} failed ({proc.returncode}): {proc.stderr}")
        return proc
    cmd = [str(PYTHON), "-m", "gthulhu_node", *args]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd="/")
    if check and proc.returncode != 0:
        raise AssertionError(f"{args} failed ({proc.returncode}): {proc.stderr}")
    return proc


class AgentProcess:
    """`gthulhu-node run` as its own process. By default this checkout's package under the project's venv;
    `python` with `installed=True` runs the package installed in another environment (a wheel, the Debian
    package) without this checkout on the path, so the test proves what was installed works."""

    def __init__(self, config: Path, socket: Path, python: Path = PYTHON, installed: bool = False) -> None:
        self.config = config
        self.socket = socket
        self.python = python
        self.installed = installed
        self.log = config.with_name("agent.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(self.python),
                    "-m",
                    "gthulhu_node",
                    "run",
                    "--config",
                    str(self.config),
                    "--log-format",
                    "json",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd="/",
                env=self._env(),
            )
        wait_for(self._serving, timeout=60, what="the agent process to serve")

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if not self.installed:
            env["PYTHONPATH"] = str(REPO)
        return env

    def _serving(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"agent exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        if not self.socket.exists():
            return False
        try:
            with client(self.socket) as stub:
                return stub.GetStatus(pb.GetStatusRequest(), timeout=2).agent.ready
        except grpc.RpcError:
            return False

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(30)


@contextmanager
def agent_process(base: Path, python: Path = PYTHON, installed: bool = False,
                  **sections: dict[str, object]) -> Iterator[AgentProcess]:
    cfg = write_config(base, **sections)
    p = AgentProcess(cfg, base / "run" / "api.sock", python=python, installed=installed)
    p.start()
    try:
        yield p
    finally:
        if p.proc is not None and p.proc.poll() is None:
            p.proc.kill()
            p.proc.wait(30)
