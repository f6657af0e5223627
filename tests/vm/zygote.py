"""A warm Python in the lab guest: imports the heavy modules once, then forks a child per script to run.

Under TCG a fresh `.venv/bin/python tests/vm/<script>.py` spends most of a scenario's set-up importing
(pydantic, structlog, the agent's modules: about 1.3 s natively, many times that emulated), and `make test`
starts such scripts some hundred times per run. The guest agent (tests/vm/guest_agent.py) starts this
process once per boot and hands it the venv-python commands it is asked to run; each one runs in a forked
child, which starts with everything already imported and exits when its script ends. A child is a fresh
copy of this process every time, so one script's state never reaches the next.

Protocol, on a unix socket, one connection per command: the agent sends a JSON request (script, args, cwd,
env) with three file descriptors (the child's stdin, stdout and stderr) in the same message; this process
answers {"pid": N} once forked and, when the child has exited, {"returncode": N}.

Single-threaded on purpose: forking a process that runs other threads can copy a held lock into the child.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import random
import runpy
import selectors
import signal
import socket
import sys
import traceback
from pathlib import Path

MAX_REQUEST = 1 << 20


def child(request: dict[str, object], fds: list[int]) -> None:
    """In the forked child: become the script's process and run it; never returns."""
    code = 1
    try:
        os.setsid()  # its own process group, as the agent gives every command (timeouts kill the group)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # what the interpreter sets at start
        os.chdir(str(request["cwd"]))
        env = request["env"]
        assert isinstance(env, dict)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in env.items()})
        random.seed()  # not the state every child inherited
        script = str(request["script"])
        args = request["args"]
        assert isinstance(args, list)
        sys.argv = [script, *(str(a) for a in args)]
        sys.path.insert(0, str(Path(script).resolve().parent))  # as the interpreter does for a script
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        # what interpreter exit does: atexit handlers (BCC detaches its probes there), then the buffers
        with contextlib.suppress(Exception):
            atexit._run_exitfuncs()
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def serve(path: str) -> None:
    # Bound and listening under another name, then renamed into place: the agent waits for `path` to
    # exist, and a connect between bind() and listen() is refused (it then ran the script cold; seen in
    # make test under load).
    staging = f"{path}.{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(staging)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(staging)
    listener.listen(16)
    os.replace(staging, path)
    # SIGCHLD wakes the loop through this pipe; children are reaped there
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    waiting: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select(1.0):
            if key.fileobj is listener:
                conn, _ = listener.accept()
                with contextlib.suppress(OSError, ValueError):
                    pid = start(conn)
                    if pid:
                        waiting[pid] = conn
                        continue
                conn.close()
            else:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
        reap(waiting)


def start(conn: socket.socket) -> int:
    """Read one request with its descriptors, fork the child; 0 if the request was unusable."""
    data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
    try:
        if len(fds) != 3:
            return 0
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            conn.close()
            child(request, fds)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        return pid
    finally:
        for fd in fds:
            os.close(fd)


def reap(waiting: dict[int, socket.socket]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = waiting.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            conn.close()


def main() -> int:
    path, *preload = sys.argv[1:]
    repo = str(Path(__file__).resolve().parents[2])
    sys.path.insert(0, repo)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # a module that cannot be preloaded is imported by its script, more slowly
            traceback.print_exc()
    sys.stdout.flush()
    serve(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
