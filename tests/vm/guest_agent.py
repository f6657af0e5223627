"""The lab guest agent: runs the harness's commands inside the guest (stdlib only, /usr/bin/python3).

It talks to tests/vm/lab.py over the virtio-serial port named "lab". Both directions carry frames: a
4-byte big-endian length, then that many bytes of UTF-8 JSON.

    request  {"id": 7, "op": "run", "argv": [...]} or {"id": 7, "op": "run", "shell": "..."},
             plus optional "timeout" (s), "input" (str), "env" (dict, added to the base env), "cwd"
    response {"id": 7, "returncode": 0, "stdout": "...", "stderr": "...", "timed_out": false,
              "duration": 0.12}
    request  {"id": 8, "op": "ping"}  ->  {"id": 8, "pong": true, "boot_id": "..."}
    at start the agent sends {"event": "hello", "boot_id": "...", "release": "..."}

Each request runs in its own thread, so a ping is answered while a long command runs. Each command runs
as root in its own session (process group); at its timeout the whole group is killed with SIGKILL and the
reply says timed_out. A command may leave children running in the background (`stress-ng ... &`); they
inherit its stdout/stderr, so once the command itself has exited the agent only drains what is already
there for a moment instead of waiting for the pipes to close.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

PORT_NAME = "lab"
HEADER = struct.Struct(">I")
DRAIN_IDLE = 0.3  # after the command exited: stop reading once its pipes were quiet this long
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "USER": "root",
    "LOGNAME": "root",
    "SHELL": "/bin/bash",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONUNBUFFERED": "1",
    "SYSTEMD_PAGER": "",
    "SYSTEMD_COLORS": "0",
    "PAGER": "cat",
}


def find_port(deadline: float) -> str:
    """The /dev node of the port named "lab" (udev's /dev/virtio-ports links do not exist without udev)."""
    base = "/sys/class/virtio-ports"
    while True:
        with contextlib.suppress(OSError):
            for entry in sorted(os.listdir(base)):
                with open(os.path.join(base, entry, "name")) as f:
                    if f.read().strip() == PORT_NAME and os.path.exists(f"/dev/{entry}"):
                        return f"/dev/{entry}"
        if time.monotonic() > deadline:
            raise SystemExit(f"lab agent: no virtio port named {PORT_NAME!r}")
        time.sleep(0.1)


class Port:
    """The serial port: frame reading and locked frame writing."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR)
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        body = json.dumps(message).encode()
        data = memoryview(HEADER.pack(len(body)) + body)
        with self.lock:
            while data:
                n = os.write(self.fd, data)
                data = data[n:]

    def frames(self) -> Any:
        buf = bytearray()
        while True:
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                # The host side is not connected: anything half-read belongs to a dead connection.
                buf.clear()
                time.sleep(0.1)
                continue
            buf += chunk
            for body in take_frames(buf):
                try:
                    yield json.loads(body)
                except ValueError:
                    print(f"lab agent: dropped a malformed frame of {len(body)} bytes", file=sys.stderr)


def take_frames(buf: bytearray) -> Iterator[bytes]:
    """Cut every complete frame (4-byte big-endian length, then the body) off the front of buf; a partial
    frame stays for the next read. Both ends of the serial link use this, so the framing is defined once."""
    while len(buf) >= HEADER.size:
        (size,) = HEADER.unpack_from(buf)
        if len(buf) < HEADER.size + size:
            return
        body = bytes(buf[HEADER.size : HEADER.size + size])
        del buf[: HEADER.size + size]
        yield body


def pump(proc: subprocess.Popen[bytes], data: bytes | None, timeout: float) -> tuple[bytes, bytes, bool]:
    """Feed stdin, collect stdout/stderr until the command exits (or its timeout), then drain briefly."""
    sel = selectors.DefaultSelector()
    out: dict[int, bytearray] = {}
    assert proc.stdout is not None and proc.stderr is not None
    for stream in (proc.stdout, proc.stderr):
        os.set_blocking(stream.fileno(), False)
        sel.register(stream.fileno(), selectors.EVENT_READ)
        out[stream.fileno()] = bytearray()
    pending = memoryview(data) if data else memoryview(b"")
    in_fd = proc.stdin.fileno() if proc.stdin is not None else -1
    if proc.stdin is not None:
        if pending:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
        else:
            proc.stdin.close()
    deadline = time.monotonic() + timeout
    timed_out = False
    exited_at: float | None = None
    last_data = time.monotonic()
    while sel.get_map():
        now = time.monotonic()
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and (
            now - max(exited_at, last_data) > DRAIN_IDLE or now > max(deadline, exited_at) + DRAIN_IDLE
        ):
            break
        if exited_at is None and now > deadline:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            exited_at = time.monotonic()
            continue
        for key, _ in sel.select(0.05):
            fd = key.fd
            if fd == in_fd and proc.stdin is not None:
                try:
                    n = os.write(fd, pending[: 1 << 16])
                    pending = pending[n:]
                except BrokenPipeError:
                    pending = memoryview(b"")
                if not pending:
                    sel.unregister(fd)
                    proc.stdin.close()
                continue
            chunk = os.read(fd, 1 << 16)
            if chunk:
                out[fd] += chunk
                last_data = time.monotonic()
            else:
                sel.unregister(fd)
    sel.close()
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    if exited_at is None:
        # Both pipes closed before the exit was seen: wait for it within the timeout.
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    proc.stdout.close()
    proc.stderr.close()
    return bytes(out[out_fd]), bytes(out[err_fd]), timed_out


class ZygoteProc:
    """A command the zygote (tests/vm/zygote.py) forked, looking to pump() like a Popen: pid (its process
    group), pipes, poll() and wait(); the exit status arrives on the zygote connection."""

    def __init__(self, conn: socket.socket, pid: int, stdin: Any, stdout: Any, stderr: Any) -> None:
        self.conn, self.pid, self.stdin, self.stdout, self.stderr = conn, pid, stdin, stdout, stderr
        self.returncode: int | None = None
        self._buf = b""

    def _read(self, timeout: float | None) -> None:
        self.conn.settimeout(timeout)
        with contextlib.suppress(TimeoutError, BlockingIOError):
            while b"\n" not in self._buf:
                chunk = self.conn.recv(4096)
                if not chunk:  # the zygote died: the child's status is lost
                    self.returncode = -1
                    return
                self._buf += chunk
            self.returncode = int(json.loads(self._buf.split(b"\n", 1)[0])["returncode"])

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read(0.0)
            if self.returncode is not None:
                self.conn.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired("zygote child", timeout or 0.0)
        self.conn.close()
        return self.returncode


class Zygote:
    """The warm Python of this boot (tests/vm/zygote.py), started on first use; None when unusable."""

    PRELOAD = ("tests.vm.sched_workloads", "tests.vm.safety_workloads")
    SOCKET = "/run/gthulhu-lab-zygote.sock"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._python = ""

    def for_command(self, argv: list[str], cwd: str) -> tuple[str, list[str]] | None:
        """(script, args) if argv runs a script with the repository's venv python, else None."""
        if len(argv) < 2 or not argv[0].endswith(".venv/bin/python") or not argv[1].endswith(".py"):
            return None
        python = os.path.normpath(os.path.join(cwd, argv[0]))
        if not os.path.isfile(python):
            return None
        with self._lock:
            if self._proc is not None and (self._proc.poll() is not None or python != self._python):
                self._proc = None
            if self._proc is None:
                repo = os.path.dirname(os.path.dirname(os.path.dirname(python)))
                zygote = os.path.join(repo, "tests", "vm", "zygote.py")
                if not os.path.isfile(zygote):
                    return None
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.SOCKET)
                self._proc = subprocess.Popen(
                    [python, zygote, self.SOCKET, *self.PRELOAD], cwd=repo, env=dict(BASE_ENV),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    start_new_session=True)
                self._python = python
            deadline = time.monotonic() + 300
            while not os.path.exists(self.SOCKET):
                if self._proc.poll() is not None or time.monotonic() > deadline:
                    self._proc = None
                    return None
                time.sleep(0.05)
        return os.path.normpath(os.path.join(cwd, argv[1])), argv[2:]

    def spawn(self, script: str, args: list[str], cwd: str, env: dict[str, str],
              with_stdin: bool) -> ZygoteProc:
        pipes = [os.pipe() for _ in range(3)]
        child_fds = [pipes[0][0], pipes[1][1], pipes[2][1]]
        if not with_stdin:
            os.close(pipes[0][0])
            os.close(pipes[0][1])
            child_fds[0] = os.open(os.devnull, os.O_RDONLY)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.SOCKET)
            request = {"script": script, "args": args, "cwd": cwd, "env": env}
            socket.send_fds(conn, [json.dumps(request).encode()], child_fds)
        finally:
            for fd in child_fds:
                os.close(fd)
        buf = b""
        while b"\n" not in buf:
            chunk = conn.recv(4096)
            if not chunk:
                raise OSError("the zygote closed the connection without forking")
            buf += chunk
        pid = int(json.loads(buf.split(b"\n", 1)[0])["pid"])
        stdin = os.fdopen(pipes[0][1], "wb", buffering=0) if with_stdin else None
        proc = ZygoteProc(conn, pid, stdin, os.fdopen(pipes[1][0], "rb", buffering=0),
                          os.fdopen(pipes[2][0], "rb", buffering=0))
        proc._buf = buf.split(b"\n", 1)[1]
        return proc


ZYGOTE = Zygote()


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one command as root in its own session; never raises for the command's own failures. A script
    run with the repository's venv python is forked from the zygote (same result, without the imports)."""
    argv = request.get("argv") or ["/bin/bash", "-c", request.get("shell", "")]
    env = dict(BASE_ENV)
    env.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
    text = request.get("input")
    timeout = float(request.get("timeout") or 60)
    cwd = request.get("cwd") or "/"
    started = time.monotonic()
    proc: Any = None
    warm = None if request.get("cold") else ZYGOTE.for_command([str(a) for a in argv], cwd)
    if warm is not None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            proc = ZYGOTE.spawn(warm[0], warm[1], cwd, env, text is not None)
    try:
        if proc is None:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if text is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=cwd,
                env=env,
                start_new_session=True,
            )
    except OSError as exc:
        return {
            "returncode": 127 if isinstance(exc, FileNotFoundError) else 126,
            "stdout": "",
            "stderr": f"lab agent: cannot run {argv[0]!r}: {exc}\n",
            "timed_out": False,
            "duration": time.monotonic() - started,
        }
    stdout, stderr, timed_out = pump(proc, text.encode() if text is not None else None, timeout)
    return {
        "returncode": proc.returncode,
        "stdout": stdout.decode(errors="replace"),
        "stderr": stderr.decode(errors="replace"),
        "timed_out": timed_out,
        "duration": time.monotonic() - started,
    }


def serve(port: Port, request: dict[str, Any], boot_id: str) -> None:
    reply: dict[str, Any] = {"id": request.get("id")}
    try:
        op = request.get("op", "run")
        if op == "ping":
            reply.update(pong=True, boot_id=boot_id)
        elif op == "run":
            reply.update(run(request))
        else:
            reply["error"] = f"unknown op {op!r}"
    except Exception as exc:  # the agent must outlive any single bad request
        reply["error"] = f"{type(exc).__name__}: {exc}"
    port.send(reply)


def main() -> int:
    port = Port(find_port(time.monotonic() + 60))
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    port.send({"event": "hello", "boot_id": boot_id, "release": os.uname().release, "uptime": uptime})
    for request in port.frames():
        threading.Thread(target=serve, args=(port, request, boot_id), daemon=True).start()
    return 0


if __name__ == "__main__":
    sys.exit(main())
