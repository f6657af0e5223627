"""Scheduling overhead in the lab guest: scheduling-heavy work timed under EEVDF, ours and scx_simple.

Guest side of tests/bench/test_sched_overhead.py. Each workload is all context switches and wakeups, so its
time is mostly the scheduler's own path: `hackbench -p` (rt-tests: groups of 20 senders and 20 receivers
over pipes), `perf bench sched messaging` (the same design, Debian's linux-perf) and `perf bench sched
pipe` (two tasks ping-ponging one pipe). Cases: EEVDF (no sched_ext scheduler), ours (the gthulhu
scheduler loaded through the agent's backend, no policy: what every unboosted task pays) and the kernel's
scx_simple (weighted vtime, one global queue); on a guest with more than one NUMA node also ours with one
fair queue for the whole host (`scheduler.fair_queues: single`), and with --earlier DIR the scheduler of
an earlier revision (scripts/bench-earlier-scheduler), loaded by that revision's own code in a process of
its own: the before and after of a scheduler change in one boot. Rounds are interleaved case by case; each
workload runs `--reps` times per case and round; after the rounds each case runs each workload once more
with kernel.bpf_stats_enabled on, not timed: the scheduler's callbacks' own run time and calls in that run
(bpftool's run_time_ns and run_cnt of the struct_ops programs). Prints one JSON document: seconds per
timed run, and the callbacks.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gthulhu_node.config import SchedulerConfig
from tests.vm import engine_step_bench  # the scheduler and peer context managers
from tests.vm.guest_probe import bpftool_progs

CASES: dict[str, dict[str, str | bool]] = {
    "EEVDF": {},
    "ours (no policy)": {"sched": True},
    "scx_simple": {"peer": "scx_simple"},
}
ONE_QUEUE = "ours, one fair queue"
EARLIER = "ours, earlier revision"
NODES = Path("/sys/devices/system/node")

# Loads an earlier revision's scheduler with that revision's own code (its folder first on sys.path) and
# holds it until SIGINT: the layouts of its maps are its own, which this revision's loader would refuse.
# Each line on its stdin is an intent, applied by that revision's agent path (one full scan, as
# engine_step_bench.apply_intent does) and answered with the ids the scheduler's maps then hold. Every
# import comes before "loaded": the process is protected as the agent is (boosted), and the imports, done
# by a thread after it, ran boosted for seconds of the first run under TCG (the sleeper at 7.6x EEVDF's).
HOLD_EARLIER = """
import json, signal, sys, threading
sys.path.insert(0, sys.argv[1])
from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.scheduler.backend import SchedExtBackend
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
backend = SchedExtBackend(protect_agent=True)
backend.start()

def serve():
    for line in sys.stdin:
        try:
            model = Intent.model_validate(json.loads(line))
            Reconciler(backend, policy=PolicySet.build([("bench/earlier", model)])).rescan()
            print("ids", json.dumps(sorted(k.id for k in backend.read_back())), flush=True)
        except Exception as e:
            print("error", json.dumps(repr(e)), flush=True)

threading.Thread(target=serve, daemon=True).start()
print("loaded", flush=True)
signal.sigwait({signal.SIGINT, signal.SIGTERM})
backend.stop()
"""


def numa_nodes() -> int:
    return sum(1 for p in NODES.glob("node[0-9]*") if (p / "cpulist").read_text().strip())


@contextlib.contextmanager
def earlier(folder: Path) -> Iterator[Callable[[dict[str, Any]], set[int]]]:
    """The earlier revision's scheduler loaded for the block; yields a function that applies an intent
    through that revision's agent path and returns the ids then in its maps (HOLD_EARLIER)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_EARLIER, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=folder)
    assert proc.stdin is not None and proc.stdout is not None
    stdin, stdout = proc.stdin, proc.stdout

    def apply(intent: dict[str, Any]) -> set[int]:
        stdin.write(json.dumps(intent) + "\n")
        stdin.flush()
        # its log lines (structlog prints to stdout) come before the answer
        for line in stdout:
            if line.startswith("ids "):
                return set(json.loads(line[4:]))
            if line.startswith("error "):
                raise RuntimeError(f"the earlier scheduler ({folder}) could not apply {intent}: {line[6:]}")
        raise RuntimeError(f"the earlier scheduler ({folder}) exited applying {intent}: {proc.wait(60)}")

    try:
        # its log lines come first; EOF means it exited
        for line in stdout:
            if line.strip() == "loaded":
                break
        else:
            raise RuntimeError(f"the earlier scheduler ({folder}) did not load: exit {proc.wait(60)}")
        yield apply
        state = engine_step_bench._sched_ext()
        if state != ("enabled", "gthulhu"):
            raise RuntimeError(f"the earlier scheduler is no longer running: {state}")
    finally:
        stdin.close()
        engine_step_bench.interrupt(proc, 60)


# name -> (command, pattern of its time in seconds). Sized for a few seconds each under TCG.
WORKLOADS: dict[str, tuple[list[str], str]] = {
    "hackbench -p -g 2 -l 200": (["hackbench", "-p", "-g", "2", "-l", "200"], r"Time:\s*([\d.]+)"),
    "perf sched messaging -g 2 -l 100": (["perf", "bench", "sched", "messaging", "-g", "2", "-l", "100"],
                                         r"Total time:\s*([\d.]+)"),
    "perf sched pipe -l 20000": (["perf", "bench", "sched", "pipe", "-l", "20000"],
                                 r"Total time:\s*([\d.]+)"),
}


BPF_STATS = Path("/proc/sys/kernel/bpf_stats_enabled")


def struct_ops_stats() -> dict[str, tuple[int, int]]:
    """name -> (run_time_ns, run_cnt) of every struct_ops program loaded (the sched_ext scheduler's
    callbacks, ours or a peer's); needs kernel.bpf_stats_enabled."""
    stats: dict[str, tuple[int, int]] = {}
    for prog in bpftool_progs():
        if prog.get("type") == "struct_ops":
            name = str(prog.get("name"))
            ns, cnt = stats.get(name, (0, 0))
            stats[name] = (ns + int(prog.get("run_time_ns", 0)), cnt + int(prog.get("run_cnt", 0)))
    return stats


def timed(name: str) -> float:
    """One run of a workload: the time it reports itself (its own start to end, not process start-up)."""
    cmd, pattern = WORKLOADS[name]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd="/tmp", timeout=600, check=False)
    m = re.search(pattern, r.stdout)
    if r.returncode != 0 or not m:
        raise RuntimeError(f"{' '.join(cmd)}: exit {r.returncode}\n{r.stdout[-800:]}\n{r.stderr[-800:]}")
    return float(m.group(1))


@contextlib.contextmanager
def loaded(case: str) -> Iterator[None]:
    spec = CASES[case]
    if "earlier" in spec:
        with earlier(Path(str(spec["earlier"]))):
            yield
        return
    config = SchedulerConfig(fair_queues="single") if spec.get("one_queue") else None
    with (engine_step_bench.scheduler(bool(spec.get("sched")), None, config) as backend,
          engine_step_bench.peer(str(spec["peer"]) if "peer" in spec else None)):
        yield
        if backend is not None and backend.health().state.value != "running":
            raise RuntimeError(f"our scheduler is no longer running: {backend.health()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--peers-dir", type=Path, required=True, help="where scx_simple is")
    parser.add_argument("--progress", type=Path, default=None, help="append each result as a JSON line")
    parser.add_argument("--earlier", type=Path, default=None,
                        help="an earlier revision's folder (scripts/bench-earlier-scheduler): one more case")
    args = parser.parse_args()
    engine_step_bench.PEERS_DIR = args.peers_dir
    if numa_nodes() > 1:
        CASES[ONE_QUEUE] = {"sched": True, "one_queue": True}
    if args.earlier is not None:
        CASES[EARLIER] = {"earlier": str(args.earlier)}
    runs: dict[str, dict[str, list[float]]] = {w: {c: [] for c in CASES} for w in WORKLOADS}
    # per workload and case: callback -> [BPF run time ns, calls] in the profiled run
    callbacks: dict[str, dict[str, dict[str, list[int]]]] = {w: {c: {} for c in CASES} for w in WORKLOADS}
    for _ in range(args.rounds):
        for case in CASES:
            with loaded(case):
                time.sleep(0.5)
                for work in WORKLOADS:
                    for _ in range(args.reps):
                        runs[work][case].append(timed(work))
                        if args.progress is not None:
                            with args.progress.open("a") as f:
                                f.write(json.dumps({"workload": work, "case": case,
                                                    "seconds": runs[work][case][-1]}) + "\n")
            print(f"{case}: " + ", ".join(f"{w} {runs[w][case][-1]:.3f}" for w in WORKLOADS),
                  file=sys.stderr, flush=True)
    # Then one more run per case and workload, not timed (the statistics cost the callbacks two clock
    # reads each), with the statistics switched on once for all of them: each switch patches the kernel's
    # code live, and under multi-threaded TCG such patching is what kills guests (docs/lab.md, the int3
    # hazard; switched per workload, it killed the 8-vCPU guest twice in one run).
    BPF_STATS.write_text("1")
    try:
        for case in CASES:
            with loaded(case):
                for work in WORKLOADS:
                    before = struct_ops_stats()
                    timed(work)
                    for name, (ns, cnt) in struct_ops_stats().items():
                        b_ns, b_cnt = before.get(name, (0, 0))
                        callbacks[work][case][name] = [ns - b_ns, cnt - b_cnt]
    finally:
        BPF_STATS.write_text("0")
    print(json.dumps({"kernel": os.uname().release, "cpus": os.cpu_count(), "rounds": args.rounds,
                      "reps": args.reps, "runs": runs, "callbacks": callbacks,
                      "earlier": str(args.earlier or "")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
