"""Where a pipe round trip's time goes (issue 40, item 3): `perf bench sched pipe` under EEVDF, ours and the
kernel's scx_simple in both its modes, timed and traced in one boot. Guest side of
tests/bench/test_pipe_trace.py.

Each round runs every case once (interleaved): `perf bench sched pipe -l 20000` and `hackbench -p -g 2 -l
200`, timed by what they report. After the rounds, each case once more, not timed, twice: traced with
tracefs (sched_waking, sched_wakeup, sched_switch, ipi_send_cpu; the monotonic clock) for a shorter pipe
run, and with kernel.bpf_stats_enabled for the struct_ops callbacks' own run time (the statistics patch
the kernel's code live: switched once for every case, as tests/vm/sched_overhead_bench.py does). A round
trip of the two pipe tasks A and B is A runs until it wakes B, B's wake-up until B runs, B runs until it
wakes A, A's wake-up until A runs; so each wake-up is split into

- `run_to_wake`: from the waker's switch-in to its `sched_waking` of the other (its syscalls: the write,
  and the read that blocks comes after);
- `queue`: `sched_waking` to `sched_wakeup` (select_cpu and enqueue for a sched_ext scheduler);
- `to_run`: `sched_wakeup` to the switch onto the wakee: on the waker's CPU, the waker's way into its
  blocking read and the switch; on the other CPU, the IPI, the way out of idle and the dispatch;

and, per round trip, the time neither task was on a CPU (only getting a woken one there), one was, or both
were (the waker on its way into its blocking read while the wakee already runs on the other CPU): these
three add up to the traced round trip. Prints one JSON object.
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

PIPE, HACKBENCH = "perf sched pipe -l 20000", "hackbench -p -g 2 -l 200"
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
    return split(list(wake_trace.parse(text)), loops)


def split(events: list[tuple[float, int, int, str, dict[str, str]]], loops: int) -> dict[str, Any]:
    """The two tasks switched in most are the pipe's pair (whatever perf names them). Each wake-up of one
    by the other, in stages (a wake-up of a task still on its CPU, which never switched out, is counted
    apart); and the run's time by how many of the two were on a CPU: `neither` is the round trip's time
    spent only in getting a woken task onto a CPU, which the stages of a single wake-up cannot sum up when
    the two overlap (the waker runs on into its blocking read while the wakee is placed)."""
    switched_in = collections.Counter(int(f["next_pid"]) for _, _, _, e, f in events
                                      if e == "sched_switch" and f.get("next_pid", "0") != "0")
    pair = {pid for pid, _ in switched_in.most_common(2)}
    if len(pair) < 2:
        raise RuntimeError(f"no pipe pair in the trace: {switched_in}")
    on_cpu: dict[int, float] = {}  # task on a CPU now -> its switch-in
    waking: dict[int, tuple[float, int, float]] = {}  # wakee -> (waking ts, waker's cpu, waker's run so far)
    woken: dict[int, float] = {}  # wakee -> its sched_wakeup's time
    stages: dict[str, list[float]] = collections.defaultdict(list)
    where: collections.Counter[str] = collections.Counter()
    occupancy: collections.Counter[str] = collections.Counter()
    ipis, still, last, since = 0, 0, 0.0, 0.0
    first: float | None = None
    for ts, cpu, pid, event, f in events:
        if first is not None:
            occupancy[("neither", "one", "both")[len(on_cpu)]] += ts - since
        since = ts
        if event == "ipi_send_cpu":
            ipis += 1
        elif event == "sched_waking" and int(f.get("pid", -1)) in pair and pid in on_cpu:
            wakee = int(f["pid"])
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
            first, last = ts if first is None else first, ts
            if wakee in waking and wakee in woken:
                (t_waking, waker_cpu, run_to_wake), t_wakeup = waking.pop(wakee), woken.pop(wakee)
                stages["run_to_wake"].append(run_to_wake / 1e3)
                stages["queue"].append((t_wakeup - t_waking) / 1e3)
                stages["to_run"].append((ts - t_wakeup) / 1e3)
                stages["to_run_same" if cpu == waker_cpu else "to_run_other"].append((ts - t_wakeup) / 1e3)
                where["same_cpu" if cpu == waker_cpu else "other_cpu"] += 1
                where["target_was_idle" if f.get("prev_pid") == "0" else "target_was_busy"] += 1
    wakeups = len(stages["queue"])
    out: dict[str, Any] = {k: {"mean": statistics.fmean(v), "p50": statistics.median(v)}
                           for k, v in stages.items() if v}
    out["wakeups"] = wakeups
    out["where"] = {k: v / wakeups for k, v in where.items()} if wakeups else {}
    out["still_on_cpu"] = still / (wakeups + still) if wakeups + still else float("nan")
    out["ipis_per_wakeup"] = ipis / wakeups if wakeups else float("nan")
    out["traced_round_trip_us"] = (last - (first or 0.0)) / 1e3 / loops
    out["per_round_trip_us"] = {k: v / 1e3 / loops for k, v in occupancy.items()}
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
                      "runs": {}, "traces": traces, "callbacks": callbacks, "loops": 20000,
                      "traced_loops": TRACED_LOOPS}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
