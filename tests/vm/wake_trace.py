"""Where an engine's wake-up goes: one engine-step case traced with the kernel's tracepoints (guest side).

The engine-step bench (tests/vm/engine_step_bench.py) showed the boosted engine's steps taking 1.3 ms
longer than uncontended while schedstat's run-queue wait stayed at 0.03 ms per step: the time is lost
outside what schedstat counts. This traces one case for a few seconds (tracefs, the monotonic clock) and
splits each of the engine's 5 ms sleeps into stages, from the timer's programmed expiry to the engine
running again:

- `late`: the timer interrupt's `now` past the sleep's hard expiry (interrupt delivery, slack aside);
- `wake`: expiry to `sched_waking` (the timer callback);
- `queue`: `sched_waking` to `sched_wakeup` (select_cpu and enqueue; a remote wake-up's IPI lands here);
- `run`: `sched_wakeup` to the `sched_switch` onto the engine (the run-queue wait schedstat counts);
- `total`: hard expiry to running.

It also counts what the engine's CPU ran right before it, and the burst's interruptions (switches away
from the engine while runnable). Prints one JSON object.

    .venv/bin/python -m tests.vm.lab run -- .venv/bin/python tests/vm/wake_trace.py --case ours
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.vm import engine_step_bench as bench

TRACING = Path("/sys/kernel/tracing")
EVENTS = ("sched/sched_switch", "sched/sched_waking", "sched/sched_wakeup", "timer/hrtimer_start",
          "timer/hrtimer_expire_entry", "ipi/ipi_send_cpu", "irq_vectors/local_timer_entry")
LINE = re.compile(r"^\s*(?P<comm>.+?)-(?P<pid>\d+)\s+\[(?P<cpu>\d+)\]\s+\S+\s+(?P<ts>\d+\.\d+):\s+"
                  r"(?P<event>\w+):\s+(?P<rest>.*)$")
FIELD = re.compile(r"(\w+)=(\S+)")

CASES = {
    "none": "no contention",
    "eevdf": "EEVDF",
    "ours": "ours boosted (agent)",
    "ours-nopolicy": "ours no policy",
    "fifo": "chrt -f 50",
    "simple": "scx_simple nice -20",
    "flatcg": "scx_flatcg weight 10000",
}


@contextlib.contextmanager
def tracing(buffer_kb: int = 16384, events: tuple[str, ...] = EVENTS,
            filters: Mapping[str, str] | None = None) -> Iterator[None]:
    """`events` (those this kernel has) traced for the block, on the monotonic clock, with `filters`
    (event: filter, cleared after); the text stays in the trace buffer for the caller to read."""
    (TRACING / "tracing_on").write_text("0")
    (TRACING / "trace_clock").write_text("mono")
    (TRACING / "buffer_size_kb").write_text(str(buffer_kb))
    (TRACING / "trace").write_text("")
    for event, expr in (filters or {}).items():
        (TRACING / "events" / event / "filter").write_text(expr)
    for event in events:
        enable = TRACING / "events" / event / "enable"
        if enable.exists():
            enable.write_text("1")
    (TRACING / "tracing_on").write_text("1")
    try:
        yield
    finally:
        (TRACING / "tracing_on").write_text("0")
        for event in events:
            enable = TRACING / "events" / event / "enable"
            if enable.exists():
                enable.write_text("0")
        for event in filters or {}:
            (TRACING / "events" / event / "filter").write_text("0")


def parse(text: str) -> Iterator[tuple[float, int, int, str, dict[str, str]]]:
    """(time ns, cpu, current pid, event, fields) per trace line."""
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            yield (float(m["ts"]) * 1e9, int(m["cpu"]), int(m["pid"]), m["event"],
                   dict(FIELD.findall(m["rest"])))


def stages(events: list[tuple[float, int, int, str, dict[str, str]]], tid: int) -> dict[str, Any]:
    """Each sleep of `tid`, split as the module docstring says; medians, p90 and means in microseconds."""
    out: dict[str, list[float]] = collections.defaultdict(list)
    before: collections.Counter[str] = collections.Counter()
    preempted_by: collections.Counter[str] = collections.Counter()
    timer: str | None = None
    expires = expired = waking = woken = 0.0
    woken_cpu = -1
    ipis: collections.Counter[str] = collections.Counter()
    timer_irq: dict[int, float] = {}
    running: dict[int, str] = {}
    late_on: collections.Counter[str] = collections.Counter()
    for ts, cpu, pid, event, f in events:
        if event == "local_timer_entry":
            timer_irq[cpu] = ts
        elif event == "sched_switch":
            running[cpu] = f.get("next_comm", "?")
        if event == "hrtimer_start" and pid == tid and f.get("function") == "hrtimer_wakeup":
            timer, expires = f["hrtimer"], float(f["expires"])
            expired = waking = woken = 0.0
        elif event == "hrtimer_expire_entry" and timer is not None and f.get("hrtimer") == timer:
            expired = float(f["now"])
            out["late"].append((expired - expires) / 1e3)
            if cpu in timer_irq:
                out["irq_late"].append((timer_irq[cpu] - expires) / 1e3)
                out["in_irq"].append((ts - timer_irq[cpu]) / 1e3)
            if expired - expires > 1e6:
                late_on[running.get(cpu, "?")] += 1
        elif event == "sched_waking" and int(f.get("pid", -1)) == tid and expired:
            waking = ts
            out["wake"].append((ts - expired) / 1e3)
        elif event == "sched_wakeup" and int(f.get("pid", -1)) == tid and waking:
            woken, woken_cpu = ts, int(f.get("target_cpu", -1))
            out["queue"].append((ts - waking) / 1e3)
            out["remote"].append(float(woken_cpu != cpu))
        elif event == "sched_switch" and int(f.get("next_pid", -1)) == tid:
            if woken:
                out["run"].append((ts - woken) / 1e3)
                out["total"].append((ts - expires) / 1e3)
                before[f.get("prev_comm", "?")] += 1
                woken = 0.0
                timer = None
        elif (event == "sched_switch" and int(f.get("prev_pid", -1)) == tid
              and f.get("prev_state") in ("R", "R+")):
            preempted_by[f.get("next_comm", "?")] += 1
        elif event == "ipi_send_cpu":
            ipis[f.get("callsite", "?")] += 1
    summary: dict[str, Any] = {}
    for name, values in out.items():
        if not values:
            continue
        cuts = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        summary[name] = {"n": len(values), "p50": round(statistics.median(values), 1),
                         "p90": round(cuts[8], 1), "mean": round(statistics.mean(values), 1)}
    summary["ran_before"] = dict(before.most_common(6))
    summary["late_over_1ms_while"] = dict(late_on.most_common(6))
    summary["burst_preempted_by"] = dict(preempted_by.most_common(6))
    summary["ipis"] = dict(ipis.most_common(8))
    return summary


def trace_case(name: str, seconds: float, trace_seconds: float, with_cyclictest: bool) -> dict[str, Any]:
    case = bench.CASES[name]
    with (
        bench.autogroup(case.get("autogroup", True)),
        bench.hogs(case["hogs"], seconds),
        bench.scheduler(case.get("sched", False), case.get("intent")) as sched,
        bench.peer(case.get("peer")),
        bench.engine_cgroup(case.get("cgroup_weight"), case.get("cgroup_max")) as cgroup,
    ):
        argv = [*case.get("prefix", []), sys.executable, bench.__file__, "--engine", str(seconds)]
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/tmp")
        try:
            assert proc.stdin is not None and proc.stdout is not None
            tid = int(proc.stdout.readline())
            if cgroup is not None:
                (cgroup / "cgroup.procs").write_text(str(proc.pid))
            if sched is not None and case.get("intent"):
                bench.apply_intent(sched, case["intent"])
            counters = sched.counters() if sched is not None else {}
            cyc = bench.cyclictest(seconds) if with_cyclictest else None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(1.0)
            with tracing():
                time.sleep(trace_seconds)
            if sched is not None:
                after = sched.counters()
                keys = ("preemptions", "boosted_dispatches", "direct_dispatches", "fair_preemptions")
                counters = {k: after[k] - counters.get(k, 0) for k in keys}
            result = json.loads(proc.stdout.readline())
            if cyc is not None:
                result.update(bench.parse_cyclictest(cyc.communicate(timeout=seconds + 30)[0]))
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = (TRACING / "trace").read_text()
    comms = {int(m[2]): m[1].strip() for m in re.finditer(r"^\s*(.+?)-(\d+)\s+\[", text, re.M)}
    events = list(parse(text))
    summary = stages(events, tid)
    if with_cyclictest:
        # cyclictest's measuring thread: the one of that name arming the most sleep timers
        sleepers = collections.Counter(pid for _, _, pid, event, f in events
                                       if event == "hrtimer_start" and f.get("function") == "hrtimer_wakeup"
                                       and pid in comms and comms[pid] == "cyclictest")
        if sleepers:
            summary["cyclictest"] = stages(events, sleepers.most_common(1)[0][0])
    summary["engine"] = result
    summary["counters"] = counters
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), required=True)
    parser.add_argument("--seconds", type=float, default=6.0, help="the engine's run")
    parser.add_argument("--trace-seconds", type=float, default=3.0, help="traced, from 1 s into the run")
    parser.add_argument("--peers-dir", type=Path, default=None)
    parser.add_argument("--cyclictest", action="store_true", help="cyclictest beside, as in the bench")
    args = parser.parse_args()
    if args.peers_dir is not None:
        bench.PEERS_DIR = args.peers_dir
    for case in args.case:
        print(json.dumps({"case": case, **trace_case(CASES[case], args.seconds, args.trace_seconds,
                                                                args.cyclictest)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
