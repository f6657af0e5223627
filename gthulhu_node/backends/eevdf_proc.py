"""What the eevdf backend reads from /proc about a thread: its start time (a tid's identity across reuse),
its process, a process's threads. An unreadable answer is None (or no threads): the thread is gone."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from gthulhu_node.tasks.procfs import StatParseError, read_task

# the errnos of a syscall on a thread that has exited
GONE = frozenset({errno.ESRCH, errno.ENOENT})


def start_time(proc_root: Path, tgid: int, tid: int) -> int | None:
    try:
        task = read_task(tgid, tid, proc_root)
    except (OSError, StatParseError):
        return None
    return None if task is None else task.start_time


def thread_start(proc_root: Path, tid: int) -> int | None:
    """A thread's start time, whatever its process: /proc/<tid> resolves for any thread, and its
    task/<tid>/stat is the thread's own (O(1), unlike /proc/<tid>/stat)."""
    return start_time(proc_root, tid, tid)


def tgid_of(proc_root: Path, tid: int) -> int | None:
    """The process a thread belongs to (/proc/<tid> resolves for any thread, not only leaders)."""
    try:
        with open(proc_root / str(tid) / "status", "rb") as status:
            for line in status:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def thread_ids(proc_root: Path, tgid: int) -> list[int]:
    """The process's threads now; none when it has exited (or its task directory cannot be listed)."""
    try:
        return [int(name) for name in os.listdir(proc_root / str(tgid) / "task")]
    except OSError:
        return []
