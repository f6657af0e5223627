"""Where a pipe round trip's time goes (issue 40, item 3): `perf bench sched pipe` under EEVDF, ours and the
kernel's scx_simple in both its modes, timed and traced in one boot. Guest side of
tests/bench/test_pipe_trace.py.

Each round runs every case once (interleaved): `perf bench sched pipe -l 20000` and `hackbench -p -g 2 -l
200`, timed by what they report. After the rounds, each case once more, not timed, twice: traced with
tracefs (sched_waking, sched_wakeup, sched_switch, ipi_send_cpu; the monotonic clock) for a shorter pipe
run, and with kernel.bpf_stats_enabled for the struct_ops callbacks' own run time (the statistics patch
the kernel's code live: switched once for every case, as tests/vm/sched_overhead_bench.py does). A round
trip of the two pipe ends A and B is: A runs until it wakes B, B's wake-up until B runs, B runs until it
wakes A, A's wake-up until A runs; so each wake-up is split into

- `run_to_wake`: from the waker's switch-in to its `sched_waking` of the other (the read it returned from,
  the write);
- `queue`: `sched_waking` to `sched_wakeup`; `to_run`: `sched_wakeup` to the switch onto the wakee. Where
  the boundary falls differs by scheduler: under sched_ext the wake-up is never queued to the target CPU
  (the kernel's ttwu_queue_cond refuses it for a sched_ext task), so `sched_wakeup` comes on the waker's
  CPU after select_cpu and enqueue, and the IPI and the way out of idle are in `to_run`; EEVDF queues a
  wake-up for an idle CPU, whose `sched_wakeup` comes on that CPU after them. So the cases are compared on
  `wake_to_run_same` / `wake_to_run_other`: `sched_waking` to the switch onto the wakee, on the waker's
  CPU or the other;

and, per round trip, the time neither end was on a CPU (only getting a woken one there), one was, or both
were (the waker on its way into its blocking read while the wakee already runs on the other CPU): the
three add up to the traced round trip, measured from the first wake-up between the ends to the last.
Tracing slows each case by its own amount (every event is a write to the ring buffer, and sched_ext
wake-ups have more of them), so the traced times say where each case's time goes, not which is faster.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.vm import engine_step_bench as esb
from tests.vm import sched_overhead_bench as overhead
from tests.vm import wake_trace

PIPE, HACKBENCH = "perf sched pipe -l 20000", "hackbench -p -g 2 -l 200"  # sched_overhead_bench's names
LOOPS = int(PIPE.rsplit(" ", 1)[1])
TRACED_LOOPS = 4000
EVENTS = ("sched/sched_waking", "sched/sched_wakeup", "sched/sched_switch", "ipi/ipi_send_cpu")
CASES: dict[str, dict[str, Any]] = {
    "EEVDF": {},
    "ours no policy": {"sched": True},
    # the kernel's reference scheduler: its default mode is the minimal weighted-vtime scheduler (one
    # global vtime-ordered queue), -f its FIFO mode (one global FIFO queue)
    "scx_simple": {"peer": "scx_simple"},
    "scx_simple fifo": {"peer": "scx_simple", "peer_args": ["-f"]},
}


def traced_pipe(loops: int) -> dict[str, Any]:
    """One pipe run of `loops` round trips under tracefs, split as the module docstring says (us)."""
    with wake_trace.tracing(32768, EVENTS):
        subprocess.run(["perf", "bench", "sched", "pipe", "-l", str(loops)], capture_output=True, check=True,
                       cwd="/tmp", timeout=600)
    tracing = wake_trace.TRACING
    text = (tracing / "trace").read_text()
    (tracing / "trace").write_text("")
    return split(list(wake_trace.parse(text)))


Event = tuple[float, int, int, str, dict[str, str]]


def pipe_pair(events: list[Event]) -> set[int]:
    """The two tasks that woke each other most: the pipe's two ends, whatever perf names them (a kworker
    may be switched in as often, but it is not woken by one of them and waking it back)."""
    wakes = collections.Counter(frozenset((pid, int(f["pid"]))) for _, _, pid, e, f in events
                                if e == "sched_waking" and pid and int(f.get("pid", pid)) != pid)
    if not wakes:
        raise RuntimeError("no wake-up between two tasks in the trace")
    return set(wakes.most_common(1)[0][0])


def occupancy(events: list[Event], pair: set[int], start: float, end: float) -> dict[str, float]:
    """Time (ns) in [start, end] with neither, one or both of `pair` on a CPU, from sched_switch alone."""
    on_cpu: set[int] = set()
    spent: dict[str, float] = collections.defaultdict(float)
    since = start
    for ts, _, _, event, f in events:
        if ts > start:
            spent[("neither", "one", "both")[len(on_cpu)]] += min(ts, end) - since
            since = min(ts, end)
        if ts >= end:
            break
        if event == "sched_switch":
            on_cpu.discard(int(f.get("prev_pid", -1)))
            if int(f.get("next_pid", -1)) in pair:
                on_cpu.add(int(f["next_pid"]))
    return dict(spent)


def split(events: list[Event]) -> dict[str, Any]:
    """Each wake-up of one pipe end by the other, in stages, with where the wakee ran; a wake-up of a task
    still on its CPU (it never switched out) is counted apart. Then, between the first such wake-up and the
    last switch onto a woken end (perf's start-up and exit left out), the time with neither, one or both
    ends on a CPU, per round trip (two wake-ups): `neither` is time spent only in getting a woken end onto
    a CPU, which a single wake-up's stages cannot sum up when the two ends overlap."""
    pair = pipe_pair(events)
    on_cpu: dict[int, float] = {}  # end on a CPU now -> its switch-in
    waking: dict[int, tuple[float, int, float]] = {}  # wakee -> (waking ts, waker's cpu, waker's run so far)
    woken: dict[int, float] = {}  # wakee -> its sched_wakeup's time
    stages: dict[str, list[float]] = collections.defaultdict(list)
    where: collections.Counter[str] = collections.Counter()
    ipis, still = 0, 0
    first: float | None = None
    last = 0.0
    for ts, cpu, pid, event, f in events:
        if event == "ipi_send_cpu" and first is not None:
            ipis += 1
        elif event == "sched_waking" and int(f.get("pid", -1)) in pair and pid in on_cpu:
            wakee = int(f["pid"])
            first = ts if first is None else first
            if wakee in on_cpu:
                still += 1
            else:
                waking[wakee] = (ts, cpu, ts - on_cpu[pid])
        elif event == "sched_wakeup" and int(f.get("pid", -1)) in waking:
            woken[int(f["pid"])] = ts
        elif event == "sched_switch":
            on_cpu.pop(int(f.get("prev_pid", -1)), None)
            wakee = int(f.get("next_pid", -1))
            if wakee not in pair:
                continue
            on_cpu[wakee] = ts
            if wakee in waking and wakee in woken:
                (t_waking, waker_cpu, run_to_wake), t_wakeup = waking.pop(wakee), woken.pop(wakee)
                side = "same" if cpu == waker_cpu else "other"
                stages["run_to_wake"].append(run_to_wake / 1e3)
                stages["queue"].append((t_wakeup - t_waking) / 1e3)
                stages["to_run"].append((ts - t_wakeup) / 1e3)
                stages[f"wake_to_run_{side}"].append((ts - t_waking) / 1e3)
                where[f"{side}_cpu"] += 1
                where["target_was_idle" if f.get("prev_pid") == "0" else "target_was_busy"] += 1
                last = ts
    wakeups = len(stages["queue"])
    trips = wakeups / 2
    out: dict[str, Any] = {k: {"mean": statistics.fmean(v), "p50": statistics.median(v)}
                           for k, v in stages.items() if v}
    out["wakeups"] = wakeups
    out["where"] = {k: v / wakeups for k, v in where.items()} if wakeups else {}
    out["still_on_cpu"] = still / (wakeups + still) if wakeups + still else float("nan")
    out["ipis_per_wakeup"] = ipis / wakeups if wakeups else float("nan")
    if first is None or not trips:
        raise RuntimeError(f"no wake-up between the pipe's ends {sorted(pair)} in the trace")
    out["traced_round_trip_us"] = (last - first) / 1e3 / trips
    out["per_round_trip_us"] = {k: v / 1e3 / trips for k, v in occupancy(events, pair, first, last).items()}
    return out


@contextlib.contextmanager
def loaded(name: str) -> Iterator[None]:
    """The case's scheduler for the block: ours through the agent's backend, a peer with its arguments,
    or none (EEVDF)."""
    case = CASES[name]
    with esb.scheduler(bool(case.get("sched")), None), esb.peer(case.get("peer"), case.get("peer_args", ())):
        time.sleep(0.3)
        yield


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0, help="unused (the harness passes it)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--peers-dir", type=Path, required=True, help="where scx_simple is")
    parser.add_argument("--progress", type=Path, default=None, help="append each result as a JSON line")
    esb.add_skip(parser)
    args = parser.parse_args()
    esb.PEERS_DIR = args.peers_dir

    def run(name: str) -> dict[str, Any]:
        with loaded(name):
            return {"pipe_s": overhead.timed(PIPE), "hackbench_s": overhead.timed(HACKBENCH)}

    esb.interleave(list(CASES), args.rounds, run, args.progress, 0.0, args.skip)  # the host reads them
    traces = {}
    for name in CASES:
        with loaded(name):
            traces[name] = traced_pipe(TRACED_LOOPS)
    callbacks: dict[str, dict[str, list[int]]] = {}
    overhead.BPF_STATS.write_text("1")
    try:
        for name in CASES:
            with loaded(name):
                before = overhead.struct_ops_stats()
                overhead.timed(PIPE)
                callbacks[name] = {k: [ns - before.get(k, (0, 0))[0], cnt - before.get(k, (0, 0))[1]]
                                   for k, (ns, cnt) in overhead.struct_ops_stats().items()}
    finally:
        overhead.BPF_STATS.write_text("0")
    print(json.dumps({"kernel": os.uname().release, "cpus": os.cpu_count(), "rounds": args.rounds,
                      "runs": {}, "traces": traces, "callbacks": callbacks, "loops": LOOPS,
                      "traced_loops": TRACED_LOOPS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
