"""Threads and processes the EEVDF host tests create for themselves (the only ones they may touch).

`Worker`: a thread of the test process that runs callables on request, so a test can make it create a
child thread (which then inherits from it, as clone does). `ChildProcess`: a separate process, driven over
its stdin by `eevdf_child.py`, whose every thread the test owns, for TGID entries.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gthulhu_node.backends.base import Entry, EntryKey, KeyKind
from gthulhu_node.backends.sched_attr import SchedAttrSyscalls, probe
from gthulhu_node.tasks.procfs import read_task

CHILD_SCRIPT = Path(__file__).with_name("eevdf_child.py")


def start_time(tgid: int, tid: int) -> int:
    task = read_task(tgid, tid)
    assert task is not None, f"thread {tid} of {tgid} is gone"
    return task.start_time


def nice_of(tid: int) -> int:
    """The thread's nice through getpriority(2): a path independent of the backend's sched_getattr."""
    return os.getpriority(os.PRIO_PROCESS, tid)


SYS = SchedAttrSyscalls()
BASE_SLICE = probe().base_slice_ns  # what a thread without a slice request of its own gets


def sched_of(tid: int) -> tuple[int, int]:
    """(nice via getpriority, slice via sched_getattr)."""
    return nice_of(tid), SYS.get(tid).runtime_ns


class Worker:
    """A thread that waits for work and exits on `stop()`."""

    def __init__(self, name: str = "eevdf-test") -> None:
        self._jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]] | None] = queue.Queue()
        ready: queue.Queue[int] = queue.Queue()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        self.tid = ready.get(timeout=10)
        self.start_time = start_time(os.getpid(), self.tid)

    def _run(self, ready: queue.Queue[int]) -> None:
        ready.put(threading.get_native_id())
        while (job := self._jobs.get()) is not None:
            fn, reply = job
            try:
                reply.put((True, fn()))
            except Exception as exc:  # handed back to the test thread
                reply.put((False, exc))

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn inside this thread and return its result."""
        reply: queue.Queue[Any] = queue.Queue()
        self._jobs.put((fn, reply))
        ok, value = reply.get(timeout=10)
        if not ok:
            raise value
        return value

    def key(self) -> EntryKey:
        return EntryKey(KeyKind.TID, self.tid)

    def entry(self, priority: int, slice_ns: int) -> Entry:
        return Entry(priority=priority, slice_ns=slice_ns, start_time=self.start_time)

    def stop(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join(timeout=10)


class ChildProcess:
    """A process of the test's own with a main thread plus threads spawned on request."""

    def __init__(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(CHILD_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = int(self._ask("pid"))
        self.start_time = start_time(self.pid, self.pid)

    def _ask(self, command: str) -> str:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return self._proc.stdout.readline().strip()

    def spawn(self) -> int:
        """Start one more thread; return its tid."""
        return int(self._ask("spawn"))

    def rename(self, comm: str) -> None:
        """Rename the main thread (what a matching intent sees)."""
        assert self._ask(f"comm {comm}") == "ok"

    def end(self, tid: int) -> None:
        """Let one spawned thread exit (returns once it has been joined)."""
        assert self._ask(f"end {tid}") == "ok"

    def tids(self) -> list[int]:
        return sorted(int(name) for name in os.listdir(f"/proc/{self.pid}/task"))

    def key(self) -> EntryKey:
        return EntryKey(KeyKind.TGID, self.pid)

    def entry(self, priority: int, slice_ns: int) -> Entry:
        return Entry(priority=priority, slice_ns=slice_ns, start_time=self.start_time)

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(timeout=10)
        if self._proc.stdout is not None:
            self._proc.stdout.close()
