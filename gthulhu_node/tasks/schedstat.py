"""What the kernel did with a thread lately, from its own accounting: `/proc/<tgid>/task/<tid>/schedstat`.

Why the kernel's figures and not ours: they exist for every backend (sched_ext, eevdf, dry-run alike),
since the core scheduler keeps them for every scheduling class: the CPU time the thread ran, the time it
waited on a run queue while runnable, and how many times it was put on a CPU (timeslices). They are
totals since the thread started; `explain` reads them twice, `SAMPLE_S` apart, and reports both the
window (its share of a CPU and its waits now) and the totals since the thread started.

A kernel without CONFIG_SCHED_INFO shows "0 0 0" for every thread: that is "not available", never zeros.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from gthulhu_node.errors import Unavailable
from gthulhu_node.tasks.procfs import Task, read_task

# How far apart the two reads are: long enough for a thread woken every few ms to show its waits, short
# enough for an answer a person waits for (one sleep for all the threads of a request).
SAMPLE_S = 0.5
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class SchedStat:
    """The kernel's accounting of one thread over `seconds` (a sampled window, or its life so far)."""

    seconds: float
    run_ns: int  # time on a CPU
    wait_ns: int  # time runnable on a run queue, not running
    timeslices: int  # times it was put on a CPU

    @property
    def cpu_share(self) -> float:
        """Its share of one CPU over the window (1.0: it ran all the time)."""
        return self.run_ns / (self.seconds * 1e9) if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class Lately:
    """A thread's window and its totals, or why they cannot be read (`note`, "not available: ...")."""

    recent: SchedStat | None = None
    since_start: SchedStat | None = None
    note: str = ""


class Unreadable(Unavailable):
    """Why a thread's schedstat cannot be read, in words that follow "not available: " (caught inside
    this module: an answer says it, never raises it)."""


def read_schedstat(task: Task, proc_root: Path = Path("/proc")) -> tuple[int, int, int]:
    """(run_ns, wait_ns, timeslices) of the thread now. Unreadable when it exited, when its TID names
    another thread now (its start time differs), or when the kernel keeps no such accounting."""
    path = b"%s/%d/task/%d/schedstat" % (os.fsencode(proc_root), task.tgid, task.tid)
    try:
        with open(path, "rb") as f:
            fields = f.read(256).split()
    except FileNotFoundError:
        if os.path.exists(path.rsplit(b"/", 1)[0]):
            raise Unreadable("this kernel has no /proc/<pid>/task/<tid>/schedstat (CONFIG_SCHED_INFO "
                             "off)") from None
        raise Unreadable("the thread exited") from None
    except ProcessLookupError:
        raise Unreadable("the thread exited") from None
    except OSError as exc:
        raise Unreadable(f"{path.decode(errors='replace')}: {exc.strerror}") from None
    try:
        run, wait, slices = (int(x) for x in fields[:3])
    except ValueError:
        raise Unreadable(f"schedstat is not three numbers: {b' '.join(fields)[:64]!r}") from None
    if (run, wait, slices) == (0, 0, 0):
        raise Unreadable("schedstat shows 0 0 0: the thread has not run yet, or the kernel keeps no such "
                         "accounting (CONFIG_SCHED_INFO off)")
    return run, wait, slices


def _same_thread(task: Task, proc_root: Path) -> bool:
    """Whether the TID still names the thread read at first (its start time): a reused TID is another."""
    try:
        now = read_task(task.tgid, task.tid, proc_root)
    except OSError:
        return False
    return now is not None and now.start_time == task.start_time


def uptime_s(proc_root: Path = Path("/proc")) -> float:
    with open(os.path.join(proc_root, "uptime"), "rb") as f:
        return float(f.read(64).split()[0])


def first_reads(tasks: Iterable[Task], proc_root: Path = Path("/proc")
                ) -> dict[int, tuple[float, tuple[int, int, int]] | str]:
    """The first read of each thread, by TID: (when, figures), or why not ("not available: ...")."""
    out: dict[int, tuple[float, tuple[int, int, int]] | str] = {}
    for t in tasks:
        try:
            out[t.tid] = (time.monotonic(), read_schedstat(t, proc_root))
        except Unreadable as exc:
            out[t.tid] = f"not available: {exc}"
    return out


def lately(tasks: Iterable[Task], first: Mapping[int, tuple[float, tuple[int, int, int]] | str],
           proc_root: Path = Path("/proc"), sample_s: float = SAMPLE_S) -> dict[int, Lately]:
    """Each thread's window (from `first_reads` to now, at least `sample_s`: it waits until that has
    passed since the last first read) and its totals since it started (now, over its age)."""
    tasks = list(tasks)
    started = [v[0] for v in first.values() if not isinstance(v, str)]
    if started:
        time.sleep(max(0.0, max(started) + sample_s - time.monotonic()))
    try:
        up = uptime_s(proc_root)
    except (OSError, ValueError, IndexError) as exc:
        up, up_error = 0.0, f"{proc_root}/uptime: {exc}"
    else:
        up_error = ""
    out: dict[int, Lately] = {}
    for t in tasks:
        before = first.get(t.tid, "not available: not read")
        if isinstance(before, str):
            out[t.tid] = Lately(note=before)
            continue
        try:
            figures = read_schedstat(t, proc_root)
            if not _same_thread(t, proc_root):
                raise Unreadable("the thread exited")
        except Unreadable as exc:
            out[t.tid] = Lately(note=f"not available: {exc}")
            continue
        at, (run0, wait0, slices0) = before
        run, wait, slices = figures
        recent = SchedStat(time.monotonic() - at, run - run0, wait - wait0, slices - slices0)
        if up_error:
            out[t.tid] = Lately(recent, None, f"totals since start not available: {up_error}")
            continue
        age = max(up - t.start_time / CLOCK_TICKS, 1 / CLOCK_TICKS)  # started within this tick: one tick
        out[t.tid] = Lately(recent, SchedStat(age, run, wait, slices))
    return out
