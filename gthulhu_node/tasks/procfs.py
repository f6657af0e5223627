"""Full snapshots of every task (thread) from /proc: the ground truth the reconciler diffs against.

A task is identified by (tid, start_time): a TID the kernel reuses names a new task. The start time is
field 22 of `/proc/<tgid>/task/<tid>/stat` (clock ticks since boot), and the thread's own comm is field 2
of the same file, so one read per thread gives everything. The scan uses plain `os` calls on byte paths:
pathlib and text decoding per file would cost more than the kernel's work.

A task that vanishes mid-scan is normal (ENOENT, ESRCH). Anything else (EACCES, EIO, ...) is counted,
logged, and marks the snapshot incomplete: an incomplete snapshot only adds or updates tasks, it never
causes a strategy to be removed.
"""

from __future__ import annotations

import errno
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gthulhu_node.errors import InvalidInput

log = structlog.get_logger(__name__)

# Errors that mean "the task is gone", not "we could not look".
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ESRCH})
# Field 22 (starttime) is the 20th field after the ") " that closes comm (fields 3.. follow it).
_START_TIME_INDEX = 22 - 3


@dataclass(frozen=True, slots=True)
class Task:
    """One Linux thread as the scheduler sees it."""

    tgid: int
    tid: int
    comm: str
    start_time: int  # clock ticks since boot (stat field 22)


@dataclass(slots=True)
class Snapshot:
    """Every task found by one scan. `complete` is False when some directory could not be read."""

    tasks: dict[int, Task] = field(default_factory=dict)
    complete: bool = True
    errors: int = 0
    duration_s: float = 0.0


class StatParseError(InvalidInput):
    """A stat file that does not have the kernel's format (never expected; counted as an error)."""


def decode_comm(raw: bytes) -> str:
    """Kernel comm bytes to str. Invalid UTF-8 becomes U+FFFD, so a pattern still sees the valid part."""
    return raw.decode("utf-8", "replace")


def parse_stat(data: bytes) -> tuple[str, int]:
    """Return (comm, start_time) from the contents of a `stat` file.

    comm may hold spaces and parentheses, so it is everything between the first "(" and the LAST ")".
    """
    open_paren = data.find(b"(")
    close_paren = data.rfind(b")")
    if open_paren < 0 or close_paren < open_paren:
        raise StatParseError(f"no comm in stat: {data[:64]!r}")
    comm = decode_comm(data[open_paren + 1 : close_paren])
    rest = data[close_paren + 2 :].split(b" ", _START_TIME_INDEX + 1)
    try:
        return comm, int(rest[_START_TIME_INDEX])
    except (IndexError, ValueError):
        raise StatParseError(f"no start time in stat: {data[:64]!r}") from None


def read_task(tgid: int, tid: int, proc_root: Path = Path("/proc")) -> Task | None:
    """Read one thread's stat. None when the task is gone; OSError for any other failure."""
    data = read_stat(tgid, tid, proc_root)
    if data is None:
        return None
    comm, start_time = parse_stat(data)
    return Task(tgid, tid, comm, start_time)


def read_stat(tgid: int, tid: int, proc_root: Path = Path("/proc")) -> bytes | None:
    """The raw contents of one thread's own stat (`<tgid>/task/<tid>/stat`: O(1), unlike `<pid>/stat`,
    which sums every thread of the process). None when the task is gone; OSError for any other failure."""
    path = b"%s/%d/task/%d/stat" % (os.fsencode(proc_root), tgid, tid)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            return None
        raise
    try:
        data = os.read(fd, 1024)
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            return None
        raise
    finally:
        os.close(fd)
    return data or None


def snapshot(proc_root: Path = Path("/proc")) -> Snapshot:
    """Scan every thread of every process once. Never raises for a single task; see the module doc."""
    started = time.monotonic()
    snap = Snapshot()
    tasks = snap.tasks
    root = os.fsencode(proc_root)
    o_flags = os.O_RDONLY | os.O_CLOEXEC
    _open, _read, _close = os.open, os.read, os.close

    def failed(what: bytes, exc: OSError) -> None:
        snap.errors += 1
        snap.complete = False
        log.warning("proc_scan_error", path=os.fsdecode(what), error=exc.strerror, errno=exc.errno)

    try:
        pids = os.listdir(root)
    except OSError as exc:
        failed(root, exc)
        return snap
    for pid_name in pids:
        if not pid_name.isdigit():
            continue
        tgid = int(pid_name)
        task_dir = b"%s/%s/task" % (root, pid_name)
        try:
            tids = os.listdir(task_dir)
        except OSError as exc:
            if exc.errno not in _GONE_ERRNOS:
                failed(task_dir, exc)
            continue
        prefix = task_dir + b"/"
        for tid_name in tids:
            path = prefix + tid_name + b"/stat"
            try:
                fd = _open(path, o_flags)
                try:
                    data = _read(fd, 1024)
                finally:
                    _close(fd)
            except OSError as exc:
                if exc.errno not in _GONE_ERRNOS:
                    failed(path, exc)
                continue
            if not data:
                continue
            try:
                comm, start_time = parse_stat(data)
            except StatParseError as exc:
                snap.errors += 1
                snap.complete = False
                log.warning("proc_scan_error", path=os.fsdecode(path), error=str(exc))
                continue
            tid = int(tid_name)
            tasks[tid] = Task(tgid, tid, comm, start_time)
    snap.duration_s = time.monotonic() - started
    return snap
