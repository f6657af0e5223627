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


def run(request: dict[str, Any]) -> dict[str, Any]:
    """Run one command as root in its own session; never raises for the command's own failures."""
    argv = request.get("argv") or ["/bin/bash", "-c", request.get("shell", "")]
    env = dict(BASE_ENV)
    env.update({str(k): str(v) for k, v in (request.get("env") or {}).items()})
    text = request.get("input")
    timeout = float(request.get("timeout") or 60)
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE if text is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=request.get("cwd") or "/",
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
