"""The agent's command line run in a child forked from the calling (already warm) guest script.

Lab scenario scripts run in children of the guest's zygote (tests/vm/zygote.py), which imported the agent's
modules once per boot. A scenario that then starts `gthulhu-node run` or `gthulhu-node status` as a new
program pays those imports again: 16-25 s per start under TCG, minutes for a scenario that starts the
agent and polls its status. `spawn_cli` forks instead and calls the console script's own entry point
(`gthulhu_node.cli.main`) in the child, so what runs is the same code as the installed command, minus the
interpreter start. Tests of the installed command itself (the systemd unit, the package) keep exec'ing it.

Fork only from a single-threaded process: a lock held by another thread at the fork stays held in the
child. Every caller here forks before it starts threads of its own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any


class WarmProcess:
    """The part of subprocess.Popen the lab scripts use, for a forked child."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _fileno(target: IO[Any] | int | None) -> int | None:
    if target == subprocess.DEVNULL:
        return os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    if target is None or isinstance(target, int):
        return target
    target.flush()
    return target.fileno()


def spawn(body: Callable[[], int | None], *, stdout: IO[Any] | int | None = None,
          stderr: IO[Any] | int | None = None, preexec: Callable[[], None] | None = None) -> WarmProcess:
    """Fork; in the child, point stdout/stderr where asked (None: inherited), run `body` and exit with its
    return value (a SystemExit's code, 1 on any other exception). Buffered output is flushed before the
    child exits: os._exit would drop it."""
    out_fd, err_fd = _fileno(stdout), _fileno(stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd, target in ((out_fd, stdout), (err_fd, stderr)):
            if target == subprocess.DEVNULL and fd is not None:
                os.close(fd)
        return WarmProcess(pid)
    code = 1
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if out_fd is not None:
            os.dup2(out_fd, 1)
        if err_fd is not None:
            os.dup2(err_fd, 2)
        if preexec is not None:
            preexec()
        try:
            result = body()
            code = 0 if result is None else int(result)
        except SystemExit as exc:
            if isinstance(exc.code, int) or exc.code is None:
                code = exc.code or 0
            else:  # as the interpreter does with sys.exit("message")
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def spawn_cli(args: Sequence[str], *, stdout: IO[Any] | int | None = None,
              stderr: IO[Any] | int | None = None, preexec: Callable[[], None] | None = None) -> WarmProcess:
    """`gthulhu-node ARGS...` in a forked child (see the module's docstring)."""

    def body() -> int:
        from gthulhu_node.cli import main

        sys.argv = ["gthulhu-node", *args]
        return main(list(args))

    return spawn(body, stdout=stdout, stderr=stderr, preexec=preexec)


def single_threaded() -> bool:
    """Whether this process runs one thread only, so that forking it is safe."""
    return len(os.listdir("/proc/self/task")) == 1


def start_cli(args: Sequence[str], *, stdout: IO[Any] | int | None = None,
              stderr: IO[Any] | int | None = None,
              preexec: Callable[[], None] | None = None) -> WarmProcess | subprocess.Popen[bytes]:
    """`gthulhu-node ARGS...` started warm when this process may fork, else exec'd as usual."""
    if single_threaded():
        return spawn_cli(args, stdout=stdout, stderr=stderr, preexec=preexec)
    exe = os.path.join(os.path.dirname(sys.executable), "gthulhu-node")
    return subprocess.Popen([exe, *args], stdout=stdout, stderr=stderr, preexec_fn=preexec)


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


def run_cli(args: Sequence[str], timeout: float = 300) -> Completed:
    """`gthulhu-node ARGS...` to its end, output captured (through files: a pipe the child filled while
    nobody read it would block it)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = spawn_cli(args, stdout=out, stderr=err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        text = []
        for f in (out, err):
            f.seek(0)
            text.append(f.read().decode(errors="replace"))
        return Completed(code, text[0], text[1])
