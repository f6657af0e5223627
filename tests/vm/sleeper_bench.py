"""What unboosted work pays (issue 40): a periodic SCHED_OTHER sleeper's wake-up latency under ours and EEVDF.

Guest side of tests/bench/test_unboosted.py. The sleeper
is `cyclictest -t1 -i 5000 --policy=other` (5 ms period, SCHED_OTHER) started with `setsid -w`: a session,
hence an autogroup, of its own, like a daemon on a node (kubelet, sshd, an API server). Beside it
`stress-ng --cpu 8` (4 hogs per vCPU) in a session of its own; in the `engine` cases also the engine-step
engine (tests/vm/engine_step_bench.py: 2 ms of its own CPU, 5 ms sleep) in this script's session, boosted
through the agent's path under ours. Cases run interleaved, round by round; each run reports the
sleeper's average, p99 (from cyclictest's histogram, 1 us buckets) and maximum latency in microseconds,
the hogs' bogo-ops/s and, with an engine, its steps/s. `--trace` adds, per run, where each of the
sleeper's wake-ups went (tests/vm/wake_trace.py's stages, traced for the middle of the run). cyclictest
pins its measuring thread to one CPU (CPU 0) by itself; `--unpinned` widens it to every CPU (Sleeper).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.vm import engine_step_bench as esb
from tests.vm import sched_overhead_bench, wake_trace

# hogs: stress-ng beside the sleeper; sched: ours loaded; engine: the engine step runs, boosted when
# `intent` is set (the agent's path)
CASES: dict[str, dict[str, Any]] = {
    "idle": {"hogs": False},
    "EEVDF": {"hogs": True},
    "ours no policy": {"hogs": True, "sched": True},
    "engine alone": {"hogs": False, "engine": True},
    "EEVDF engine": {"hogs": True, "engine": True},
    "ours engine no policy": {"hogs": True, "sched": True, "engine": True},
    # the seed's policy shape: only the engine boosted, at the seed's priority 1
    "ours engine boosted": {"hogs": True, "sched": True, "engine": True, "intent": {"priority": 1}},
    # the hogs in the sleeper's session (autogroup): the sleeper competes with them inside one group
    "EEVDF hogs in session": {"hogs": True, "own_session": False, "hogs_session": False},
    "ours hogs in session": {"hogs": True, "sched": True, "own_session": False, "hogs_session": False},
    # the sleeper in the engine's session (autogroup) instead of one of its own: a helper thread of the app
    "EEVDF engine session": {"hogs": True, "engine": True, "own_session": False},
    "ours engine boosted session": {"hogs": True, "sched": True, "engine": True, "intent": {"priority": 1},
                                    "own_session": False},
    # one busy process alone in a session of its own beside the hogs' crowded one (a build, a data loader)
    "EEVDF lone busy": {"hogs": True, "lone_busy": True},
    "ours lone busy": {"hogs": True, "sched": True, "lone_busy": True},
    # each hog bound to one CPU (four per CPU), as a host's pinned workers are: the sleeper's CPU then runs a
    # pool of its own, whose tasks no other CPU takes
    "EEVDF hogs pinned": {"hogs": True, "hogs_pinned": True},
    "ours hogs pinned": {"hogs": True, "sched": True, "hogs_pinned": True},
    # the kernel's reference scheduler (tests/vm/peers.py) in its default mode, weighted vtime: what a
    # minimal vtime scheduler makes of the same wake-ups, hackbench and pipe (issue 40, item 3)
    "scx_simple": {"hogs": True, "peer": "scx_simple"},
}
# with --earlier DIR (scripts/bench-earlier-scheduler): an earlier revision's scheduler, no policy with the
# hogs in their own session or in the sleeper's, and beside the engine it boosts as "ours engine boosted"
EARLIER = "ours earlier no policy"
EARLIER_IN_SESSION = "ours earlier hogs in session"
EARLIER_ENGINE = "ours earlier engine boosted"
HISTOGRAM_US = 100_000


def parse_histogram(text: str) -> dict[str, float]:
    """avg, p50, p99 and max in us from `cyclictest -q -h N` output: one `bucket count` line per microsecond,
    then `# Avg Latencies`, `# Max Latencies` and `# Histogram Overflows` (runs past the last bucket,
    counted at the maximum for the p99)."""
    # one pass in C over the 100,000 lines, keeping the buckets that counted something (Python's per-line
    # loop took seconds in the guest)
    counts = [(int(m[1]), int(m[2])) for m in re.finditer(r"^(\d+)\s+0*([1-9]\d*)$", text, re.M)]
    avg = re.search(r"# Avg Latencies:\s*(\d+)", text)
    top = re.search(r"# Max Latencies:\s*(\d+)", text)
    over = re.search(r"# Histogram Overflows:\s*(\d+)", text)
    if avg is None or top is None or over is None:
        raise ValueError(f"no cyclictest summary in its output: {text[-300:]!r}")
    overflows = int(over[1])
    total = sum(c for _, c in counts) + overflows
    if not total:
        raise ValueError("cyclictest measured nothing")
    return {"avg_us": float(avg[1]), "p50_us": quantile(counts, 0.5 * total, float(top[1])),
            "p99_us": quantile(counts, 0.99 * total, float(top[1])), "max_us": float(top[1]),
            "samples": float(total)}


def parse_summary(text: str) -> dict[str, float]:
    """avg and max in us from cyclictest's summary line (no histogram: printing and reading its 100,000
    lines cost seconds per run in a guest on a loaded host)."""
    m = re.search(r"Avg:\s*(\d+)\s+Max:\s*(\d+)", text)
    if m is None:
        raise ValueError(f"no cyclictest summary in its output: {text[-300:]!r}")
    return {"avg_us": float(m[1]), "max_us": float(m[2])}


def quantile(counts: list[tuple[int, int]], rank: float, beyond: float) -> float:
    """The bucket where the histogram's running count reaches `rank`; `beyond` if only the overflows do."""
    seen = 0
    for bucket, count in counts:
        seen += count
        if seen >= rank:
            return float(bucket)
    return beyond


class Sleeper:
    """cyclictest in a session of its own, SCHED_OTHER, a 5 ms period; its histogram at the end, and its
    measuring thread's run-queue wait per wake-up (schedstat, sampled while it runs): the part of the
    latency the scheduler decides, without the timer interrupt's lateness that TCG adds on a busy host.

    cyclictest pins its measuring thread to one CPU (the first it may use: CPU 0) even without `-a`; with
    `pinned=False` that thread's affinity is widened again to every CPU the process may use once it has
    pinned itself, so it wakes as a daemon's thread does (unpinned), free to go to another CPU."""

    def __init__(self, seconds: float, own_session: bool = True, histogram: bool = True,
                 pinned: bool = True) -> None:
        self.seconds = seconds
        self.histogram = histogram
        self.proc = subprocess.Popen(
            [*(["setsid", "-w"] if own_session else []), "cyclictest", "-q", "-m", "-t1", "-i", "5000",
             "-D", f"{int(seconds)}", "--policy=other", *(["-h", str(HISTOGRAM_US)] if histogram else [])],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd="/tmp",
        )
        self.pinned = pinned
        allowed = os.sched_getaffinity(self.proc.pid)
        self.allowed = len(allowed)
        self.cpus = 0  # CPUs the measuring thread may use, as last read while it ran
        try:
            self.tid = sleeper_tid(self.proc)
            if not pinned:
                unpin(self.tid, allowed)
            self.first = self.last = schedstat(self.tid)
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()

    def _poll(self) -> None:
        while self.proc.poll() is None:
            time.sleep(0.25)
            with contextlib.suppress(OSError, ValueError, IndexError):
                self.last = schedstat(self.tid)
                self.cpus = len(os.sched_getaffinity(self.tid))

    def result(self) -> dict[str, float]:
        text = self.proc.communicate(timeout=self.seconds + 60)[0]
        out = parse_histogram(text) if self.histogram else parse_summary(text)
        self.poller.join()
        waits = self.last[2] - self.first[2]
        out["runq_wait_us"] = (self.last[1] - self.first[1]) / max(waits, 1) / 1e3
        if not self.pinned and self.cpus != self.allowed:
            raise RuntimeError(f"the measuring thread ended on {self.cpus} CPUs, not the {self.allowed} it "
                               "was widened to: a pin after the widening")
        out["sleeper_cpus"] = float(self.cpus)
        return out


TICK_EVENTS = ("sched/sched_switch", "sched/sched_wakeup", "irq_vectors/local_timer_entry")
# "<comm>-<pid> [(<tgid>)] [<cpu>] <flags> <secs>: <event>: <fields>" (switch_trace.py's layout)
TRACE_LINE = re.compile(r"^\s*.+?-\d+\s+(?:\(\s*[\d-]+\)\s+)?\[(\d+)\]\s+\S+\s+[\d.]+:\s+(\w+):\s+(.*)$",
                        re.M)


@contextlib.contextmanager
def tick_trace() -> Iterator[list[str]]:
    """The timer ticks, and cyclictest's wake-ups and switches in, for the block; the trace text lands in
    the list. Filtered by its name, so a few thousand lines to read, not every switch of the hogs."""
    missing = [e for e in TICK_EVENTS if not (wake_trace.TRACING / "events" / e).exists()]
    if missing:  # tracing() skips them, and waited_ticks would read no wait at all
        raise RuntimeError(f"this kernel has no {missing} trace events")
    text: list[str] = []
    try:
        with wake_trace.tracing(4096, TICK_EVENTS, {"sched/sched_wakeup": 'comm == "cyclictest"',
                                                    "sched/sched_switch": 'next_comm == "cyclictest"'}):
            yield text
    finally:
        text.append((wake_trace.TRACING / "trace").read_text())
        (wake_trace.TRACING / "trace").write_text("")


def waited_ticks(text: str, tid: int) -> dict[str, float]:
    """Of the sleeper's wake-ups, the fraction that waited through a timer tick of the CPU it woke on
    before it ran. A wake-up that preempts runs before that CPU's next tick; one that waits for the running
    task's slice to end runs at a tick at the earliest. Counted in ticks, not in time, so the emulator's
    stalls on a loaded host (which stretch every time in the guest) do not blur it."""
    woken_on, ticks, waited, wakeups = -1, 0, 0, 0
    for m in TRACE_LINE.finditer(text):
        cpu, event, rest = int(m[1]), m[2], m[3]
        if event == "sched_wakeup" and f" pid={tid} " in f" {rest} ":
            woken_on, ticks = int(rest.rsplit("target_cpu=", 1)[1].split()[0]), 0
        elif woken_on < 0:
            continue
        elif event == "local_timer_entry" and cpu == woken_on:
            ticks += 1
        elif event == "sched_switch" and f"next_pid={tid} " in f"{rest} ":
            wakeups += 1
            waited += ticks > 0
            woken_on = -1
    return {"wakeups_traced": float(wakeups), "waited_a_tick": waited / wakeups if wakeups else float("nan")}


def schedstat(tid: int) -> tuple[int, int, int]:
    """A thread's run time, run-queue wait (ns) and runs so far (/proc/<tid>/schedstat)."""
    run, wait, runs = Path(f"/proc/{tid}/schedstat").read_text().split()[:3]
    return int(run), int(wait), int(runs)


def sleeper_tid(proc: subprocess.Popen[str]) -> int:
    """cyclictest's measuring thread (not its main thread). `setsid` execs cyclictest in place (its caller
    leads no process group), so the process is `proc` itself: only its own task list is read, every 10 ms,
    since a slow guest once took longer to walk /proc than a 2 s run lasts."""
    tasks = Path(f"/proc/{proc.pid}/task")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError):
            tids = [int(t.name) for t in tasks.iterdir() if t.name != str(proc.pid)]
            if tids:
                return tids[0]
        time.sleep(0.01)
    raise RuntimeError(f"cyclictest's measuring thread did not appear (exit {proc.poll()})")


def unpin(tid: int, cpus: set[int]) -> None:
    """Widen the measuring thread's affinity to `cpus` once it has pinned itself to a single CPU. It does
    that once, as it starts and before its first wake-up, after narrowing itself to its NUMA node's CPUs
    (a mask that already differs from `cpus` on a guest of two nodes): widened before the pin, the pin
    would undo it. Nothing to do where the process may use one CPU only."""
    if len(cpus) == 1:
        return
    deadline = time.monotonic() + 10
    while len(os.sched_getaffinity(tid)) != 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"cyclictest's thread {tid} never pinned itself: {os.sched_getaffinity(tid)}")
        time.sleep(0.005)
    os.sched_setaffinity(tid, cpus)


@contextlib.contextmanager
def engine(active: bool, seconds: float) -> Iterator[tuple[int, subprocess.Popen[str]] | None]:
    """The engine-step engine in this script's session: its tid and process, waiting for go."""
    if not active:
        yield None
        return
    proc = subprocess.Popen([sys.executable, esb.__file__, "--engine", str(seconds)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd="/tmp")
    try:
        yield int(esb._out(proc).readline()), proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def lone_busy(active: bool) -> Iterator[None]:
    """One busy process alone in a session of its own for the block (a build, a data loader): beside the
    hogs' crowded session it is the shape where a sleeper was floored too far ahead (docs/scheduler.md)."""
    if not active:
        yield
        return
    proc = subprocess.Popen(["sh", "-c", "while :; do :; done"], start_new_session=True)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def earlier(folder: str | None) -> Iterator[Callable[[dict[str, Any]], set[int]] | None]:
    """An earlier revision's scheduler loaded for the block (sched_overhead_bench.earlier), if asked; yields
    what applies an intent through that revision's agent path, or None."""
    if folder is None:
        yield None
        return
    with sched_overhead_bench.earlier(Path(folder)) as apply:
        yield apply


# What unboosted work pays beside the sleeper (--overhead): these two of sched_overhead_bench's workloads,
# run once each after the sleeper's run, the hogs and the engine gone, the case's scheduler still loaded
OVERHEAD = {"hackbench_s": "hackbench -p -g 2 -l 200", "pipe_s": "perf sched pipe -l 20000"}


def run_case(name: str, seconds: float, trace: bool, overhead: bool = False,
             pinned: bool = True) -> dict[str, Any]:
    case = CASES[name]
    out: dict[str, Any] = {}
    with earlier(case.get("earlier")) as apply_earlier, esb.peer(case.get("peer")), \
            esb.scheduler(case.get("sched", False), None) as sched:
        out.update(sleeper_run(case, seconds, trace, sched, pinned, apply_earlier))
        if overhead:
            for key, workload in OVERHEAD.items():
                out[key] = sched_overhead_bench.timed(workload)
            if sched is not None:
                out["health_ok"] = float(sched.health().state.value == "running")
    return out


def sleeper_run(case: dict[str, Any], seconds: float, trace: bool, sched: Any, pinned: bool = True,
                apply_earlier: Callable[[dict[str, Any]], set[int]] | None = None) -> dict[str, Any]:
    """The sleeper beside the case's hogs (and engine), under the scheduler `sched` (None: EEVDF, or an
    earlier revision's, whose intents `apply_earlier` applies); its measuring thread pinned where cyclictest
    puts it, or free on every CPU (Sleeper)."""
    out: dict[str, Any] = {}
    with (
        esb.hogs(case["hogs"], seconds, own_session=case.get("hogs_session", True),
                 pinned=case.get("hogs_pinned", False)) as hog,
        engine(case.get("engine", False), seconds + 1) as eng,
        lone_busy(case.get("lone_busy", False)),
    ):
        if eng is not None and sched is not None and case.get("intent"):
            esb.apply_intent(sched, case["intent"])
            assert eng[0] in {k.id for k in sched.read_back()}, "the intent did not reach the engine"
        elif eng is not None and apply_earlier is not None and case.get("intent"):
            ids = apply_earlier(esb.engine_intent(case["intent"]))
            assert eng[0] in ids, "the intent did not reach the engine under the earlier scheduler"
        counters = sched.counters() if sched is not None else {}
        cyc = Sleeper(seconds, case.get("own_session", True), pinned=pinned)
        if eng is not None:
            esb._in(eng[1]).write("go\n")
            esb._in(eng[1]).flush()
        if trace:
            tid = cyc.tid
            time.sleep(seconds / 3)
            with wake_trace.tracing():
                time.sleep(min(3.0, seconds / 3))
            text = (wake_trace.TRACING / "trace").read_text()
            out["trace"] = wake_trace.stages(list(wake_trace.parse(text)), tid)
            out["trace"]["preempted_on_wake"] = preempted_on_wake(text, tid)
        out.update(cyc.result())
        if eng is not None:
            out.update({f"engine_{k}": v for k, v in json.loads(esb._out(eng[1]).readline()).items()})
            eng[1].wait(timeout=30)
        if sched is not None:
            after = sched.counters()
            for key in ("fair_preemptions", "fair_dispatches", "direct_dispatches", "preemptions",
                        "demotions", "fair_wakeups_queued", "fair_wakeups_held", "fair_preemptions_credit",
                        "bound_steers"):
                out[key] = after.get(key, 0) - counters.get(key, 0)
            out["health_ok"] = float(sched.health().state.value == "running")
    out.update(hog)
    return out


def paired(rounds: int, seconds: float) -> dict[str, Any]:
    """The lab test's measurement (tests/vm/test_scheduler.py): the same hogs throughout; the sleeper run
    `rounds` times under EEVDF and `rounds` times under ours (no policy), ours loaded once with EEVDF's
    runs before and after it, so a drift of the host's pace weighs on both. One load: five cost 43 s of a
    92 s run in a guest on a host at load 6 (the test has a minute). One stress-ng, no engine."""
    runs: dict[str, list[dict[str, float]]] = {"EEVDF": [], "ours no policy": []}
    took: dict[str, float] = {"load": 0.0, "unload": 0.0, "measure": 0.0}
    started = time.monotonic()
    with esb.hogs(True, rounds * 2 * (seconds + 5)) as hog:
        for _ in range(rounds // 2):
            runs["EEVDF"].append(measure(seconds, took))
        t0 = time.monotonic()
        with esb.scheduler(True, None) as sched:
            assert sched is not None
            took["load"] += time.monotonic() - t0
            for _ in range(rounds):
                runs["ours no policy"].append(measure(seconds, took))
            healthy = float(sched.health().state.value == "running")
            t0 = time.monotonic()
        took["unload"] += time.monotonic() - t0
        for run in runs["ours no policy"]:
            run["health_ok"] = healthy
        for _ in range(rounds - rounds // 2):
            runs["EEVDF"].append(measure(seconds, took))
        took["total"] = time.monotonic() - started
    return {"runs": runs, "hogs": hog, "seconds": seconds, "kernel": os.uname().release,
            "cpus": os.cpu_count(), "took_s": took}


def measure(seconds: float, took: dict[str, float]) -> dict[str, float]:
    t0 = time.monotonic()
    with tick_trace() as trace:
        sleeper = started(seconds)
        out = sleeper.result()
    out.update(waited_ticks(trace[0], sleeper.tid))
    took["measure"] += time.monotonic() - t0
    return out


def started(seconds: float, attempts: int = 3) -> Sleeper:
    """A sleeper whose measuring thread was found. Beside eight hogs this harness can be off the CPU for
    a whole short run, and cyclictest then ends before its thread is seen (a 1 s run in make test's
    guest, 2026-12-06): such a run measured nothing, so it is started again, a few times at most."""
    for _ in range(attempts - 1):
        with contextlib.suppress(RuntimeError):
            return Sleeper(seconds, histogram=False)
    return Sleeper(seconds, histogram=False)


def preempted_on_wake(text: str, tid: int) -> dict[str, int]:
    """How each of the sleeper's wake-ups ended up running: on the CPU it woke on (`same`), another, and
    whether that CPU was switched straight from a hog (`from_hog`: a wake-up preemption or a slice end)."""
    counts: collections.Counter[str] = collections.Counter()
    woke_on = -1
    for _, cpu, _, event, f in wake_trace.parse(text):
        if event == "sched_wakeup" and int(f.get("pid", -1)) == tid:
            woke_on = int(f.get("target_cpu", -1))
        elif event == "sched_switch" and int(f.get("next_pid", -1)) == tid and woke_on >= 0:
            counts["same" if cpu == woke_on else "other"] += 1
            counts["from_hog" if f.get("prev_comm", "").startswith("stress-ng") else "from_other"] += 1
            woke_on = -1
    return dict(counts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cases", default="EEVDF,ours no policy,EEVDF engine,ours engine boosted")
    parser.add_argument("--trace", action="store_true", help="trace the sleeper's wake-ups in every run")
    parser.add_argument("--overhead", action="store_true",
                        help=f"also time {', '.join(OVERHEAD.values())} after each run (OVERHEAD)")
    parser.add_argument("--progress", type=Path, default=None,
                        help="append each case's result there as a JSON line as soon as it ends")
    parser.add_argument("--earlier", type=Path, default=None,
                        help=f"an earlier revision's folder (scripts/bench-earlier-scheduler): {EARLIER!r}")
    parser.add_argument("--unpinned", action="store_true",
                        help="widen cyclictest's measuring thread to every CPU (Sleeper): a daemon's thread")
    parser.add_argument("--paired", action="store_true", help="the lab test's run: see paired()")
    parser.add_argument("--peers-dir", type=Path, default=None, help="where scx_simple is (a peer case)")
    esb.add_skip(parser)
    args = parser.parse_args()
    if args.peers_dir is not None:
        esb.PEERS_DIR = args.peers_dir
    if args.paired:
        print(json.dumps(paired(args.rounds, args.seconds)))
        return 0
    if args.earlier is not None:
        CASES[EARLIER] = {"hogs": True, "earlier": str(args.earlier)}
        CASES[EARLIER_IN_SESSION] = {"hogs": True, "earlier": str(args.earlier), "own_session": False,
                                     "hogs_session": False}
        CASES[EARLIER_ENGINE] = {**CASES["ours engine boosted"], "sched": False, "earlier": str(args.earlier)}
    names = [n for n in args.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    esb.interleave(names, args.rounds,
                   lambda name: run_case(name, args.seconds, args.trace, args.overhead, not args.unpinned),
                   args.progress, args.seconds, args.skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
