"""Where tasks ran and who took the CPU from them, from the kernel's sched_switch tracepoint (tracefs, guest
side): run time per task and CPU to the switch, and every switch away from a task that was still runnable.

Sampling /proc instead (the CPU a task was last seen on, every 20 ms) puts a whole interval on one CPU, and
a boosted sampler's own wake-ups move the task it samples: in the arm64 capacity scenario the engines'
share on the big CPUs read 0.71-0.87 sampled against 0.87-0.95 traced in the same windows (2026-12-05).
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

TRACING = Path("/sys/kernel/tracing")
EVENT = TRACING / "events/sched/sched_switch"
# "<comm>-<pid> [(<tgid>)] [<cpu>] <flags> <secs>: sched_switch: ...": the CPU is the one after the pid; the
# tgid (options/record-tgid) is the switched-out task's, dashes when the kernel has not recorded it
SWITCH = re.compile(r"^\s*.*?-\d+\s+(?:\(\s*([\d-]+)\)\s+)?\[(\d+)\]\s+\S+\s+(\d+\.\d+): sched_switch: "
                    r"prev_comm=.*? prev_pid=(\d+) prev_prio=-?\d+ prev_state=(\S+) "
                    r"==> next_comm=.*? next_pid=(\d+)")


@dataclass
class Switches:
    """What the trace of a window showed for the traced tasks (filled when the window ends)."""

    ran: dict[int, collections.Counter[int]] = field(default_factory=dict)  # pid -> cpu -> seconds
    runs: collections.Counter[int] = field(default_factory=collections.Counter)  # pid -> times switched in
    # pid -> the task switched in while it was still runnable (preempted, or its slice ended) -> times
    preempted_by: dict[int, collections.Counter[int]] = field(default_factory=dict)
    # pid -> a traced task that ran on its CPU after it was switched out still runnable and before it ran
    # again -> times (once per such wait): what went ahead of it, the first (preempted_by) or not
    went_ahead: dict[int, collections.Counter[int]] = field(default_factory=dict)
    lost: int = 0  # events the ring buffer dropped: the figures are then incomplete
    # Traced with every_task: for each switch counted in preempted_by, what the other CPUs ran at that
    # moment (pid -> the task switched in -> one tuple of pids per switch, 0 for an idle CPU; a CPU not
    # yet seen switching in the window is left out), and the tgid of every task seen switched out.
    beside: dict[int, collections.defaultdict[int, list[tuple[int, ...]]]] = field(default_factory=dict)
    tgid: dict[int, int] = field(default_factory=dict)

    def seconds(self, pid: int) -> float:
        return sum(self.ran.get(pid, {}).values())

    def share_on(self, pid: int, cpus: set[int]) -> float:
        """Fraction of the task's run time spent on `cpus`."""
        total = self.seconds(pid)
        on = sum(s for cpu, s in self.ran.get(pid, {}).items() if cpu in cpus)
        return round(on / total, 3) if total else 0.0

    def parse(self, text: str, pids: set[int]) -> None:
        since: dict[int, tuple[float, int]] = {}
        current: dict[int, int] = {}  # cpu -> the task it runs, from the window's switches
        waiting: dict[int, tuple[int, set[int]]] = {}  # pid -> (its cpu, what went ahead) while it waits
        for pid in pids:
            self.ran[pid] = collections.Counter()
            self.preempted_by[pid] = collections.Counter()
            self.went_ahead[pid] = collections.Counter()
            self.beside[pid] = collections.defaultdict(list)
        for line in text.splitlines():
            m = SWITCH.search(line)
            if not m:
                continue
            cpu, stamp, prev, state, nxt = int(m[2]), float(m[3]), int(m[4]), m[5], int(m[6])
            if m[1] and m[1].isdigit():
                self.tgid[prev] = int(m[1])
            current[cpu] = nxt
            if prev in pids:
                if prev in since:
                    start, on = since.pop(prev)
                    if on == cpu:
                        self.ran[prev][cpu] += stamp - start
                if state.startswith("R"):
                    waiting[prev] = (cpu, set())
                    self.preempted_by[prev][nxt] += 1
                    others = tuple(pid for c, pid in sorted(current.items()) if c != cpu)
                    self.beside[prev][nxt].append(others)
            if nxt in pids:
                for pid, (on, ahead) in waiting.items():
                    if on == cpu and pid != nxt and nxt not in ahead:
                        ahead.add(nxt)
                        self.went_ahead[pid][nxt] += 1
                waiting.pop(nxt, None)
                since[nxt] = (stamp, cpu)
                self.runs[nxt] += 1


def _lost() -> int:
    """Events overwritten (the default) or dropped (options/overwrite 0) since the buffer was cleared."""
    total = 0
    for stats in TRACING.glob("per_cpu/cpu*/stats"):
        for line in stats.read_text().splitlines():
            if line.startswith(("overrun:", "dropped events:")):
                total += int(line.rsplit(maxsplit=1)[1])
    return total


def _setting(name: str) -> str:
    """What to write back to a tracefs file to restore it: trace_clock lists every clock with the current
    one in brackets; buffer_size_kb reads "7 (expanded: 1408)" before the buffer was first used."""
    text = (TRACING / name).read_text()
    match = re.search(r"\[(\S+)\]", text) or re.search(r"expanded: (\d+)", text)
    return match[1] if match else text.split()[0]


@contextlib.contextmanager
def switches(pids: Iterable[int], buffer_kb: int = 4096, every_task: bool = False) -> Iterator[Switches]:
    """Trace the switches in and out of `pids` for the body of the with block; with `every_task`, every
    switch on every CPU, so what ran beside each of their preemptions is known (Switches.beside)."""
    traced = set(pids)
    if not (TRACING / "trace").exists():
        os.system("mount -t tracefs nodev /sys/kernel/tracing")
    out = Switches()
    with contextlib.ExitStack() as restore:
        # each setting restored even if a later step fails (the guest runs more scenarios after this one)
        for name in ("trace_clock", "buffer_size_kb", "tracing_on", "options/record-tgid"):
            value = _setting(name)
            restore.callback((TRACING / name).write_text, value)
        restore.callback((EVENT / "filter").write_text, "0")
        restore.callback((EVENT / "enable").write_text, "0")
        (TRACING / "trace_clock").write_text("mono")
        (TRACING / "buffer_size_kb").write_text(str(buffer_kb))
        if every_task:
            (TRACING / "options/record-tgid").write_text("1")
        (EVENT / "filter").write_text(
            "0" if every_task else " || ".join(f"prev_pid == {p} || next_pid == {p}" for p in sorted(traced)))
        (TRACING / "trace").write_text("")
        (TRACING / "tracing_on").write_text("1")
        (EVENT / "enable").write_text("1")
        try:
            yield out
        finally:
            (EVENT / "enable").write_text("0")
            out.lost = _lost()
            out.parse((TRACING / "trace").read_text(), traced)
            (TRACING / "trace").write_text("")
