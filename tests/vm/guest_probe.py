"""Guest side of tests/vm/test_probe.py (run with the repo's .venv python as root in the lab guest).

`run` starts CPU hogs (stress-ng) and engine-step workers (2 ms of CPU, 5 ms asleep, repeated): a boosted
twin and an unboosted twin, each its own process so the GIL plays no part; attaches the probe through its
Python API on the threads named `^probe_`; after the probe started, starts a spawner whose threads are
created, renamed and exit while the probe runs; reads every measured thread's schedstat run-queue wait
(field 2, ns) right after the first filter sync and right before reading the probe's histograms; prints one
JSON document. `worker` and `spawner` are the child processes' own modes.

Boost: `fifo` gives the boosted twin SCHED_FIFO 50 (what EEVDF offers); `agent` leaves it to the
gthulhu-node agent (its intents must already be in place for the name `probe_boost`).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_NAME = 15


def set_name(name: str) -> None:
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def engine_steps(seconds: float, work_s: float = 0.002, sleep_s: float = 0.005) -> int:
    """Repeat 2 ms of the thread's own CPU time then 5 ms asleep; returns steps done."""
    steps = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        start = time.thread_time()
        while time.thread_time() - start < work_s:
            pass
        time.sleep(sleep_s)
        steps += 1
    return steps


def worker(name: str, seconds: float, fifo: bool) -> None:
    set_name(name)
    if fifo:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))
    print(json.dumps({"name": name, "steps": engine_steps(seconds)}), flush=True)


def spawner(seconds: float) -> None:
    """Threads created after the probe started: this process renames itself (a COMM event), starts
    `probe_late` that lives 3 s and exits, and stays until `seconds` have passed."""
    set_name("probe_spawn")

    def late() -> None:
        set_name("probe_late")
        engine_steps(3.0, work_s=0.0005)

    time.sleep(1.0)
    t = threading.Thread(target=late)
    t.start()
    info = {"late_tid": None}
    # native_id is known once the thread runs
    while t.native_id is None:
        time.sleep(0.01)
    info["late_tid"] = t.native_id
    print(json.dumps({"spawn_tid": threading.get_native_id(), "late_tid": t.native_id}), flush=True)
    engine_steps(max(0.0, seconds - 1.0), work_s=0.0005)
    t.join()


def schedstat(tgid: int, tid: int) -> int | None:
    try:
        return int(Path(f"/proc/{tgid}/task/{tid}/schedstat").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None


def wait_for_comm(pids: list[int], names: list[str], timeout: float = 60.0) -> None:
    """Until each process has renamed itself (python starts slowly next to CPU hogs under TCG)."""
    end = time.monotonic() + timeout
    for pid, name in zip(pids, names, strict=True):
        while time.monotonic() < end:
            try:
                if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                    break
            except OSError:
                pass
            time.sleep(0.05)


def run(duration: float, boost: str, hogs: int) -> None:
    from gthulhu_node.probe import ProbeUnavailable
    from gthulhu_node.probe.loader import RunqueueProbe
    from gthulhu_node.probe.session import Session
    from gthulhu_node.probe.targets import RegexTargets

    me = [sys.executable, os.path.abspath(__file__)]
    out: dict[str, object] = {"boost": boost, "hogs": hogs}
    # Compile first, on an idle guest: with the hogs running, BCC's clang would take minutes under TCG.
    t0 = time.monotonic()
    try:
        probe = RunqueueProbe()
    except ProbeUnavailable as exc:
        print(json.dumps({"error": str(exc)}))
        return
    out["compile_s"] = round(time.monotonic() - t0, 1)
    procs: list[subprocess.Popen[str]] = []
    try:
        if hogs:
            hog_cmd = ["stress-ng", "--cpu", str(hogs), "--timeout", f"{int(duration + 120)}s"]
            # stress-ng refuses a read-only working directory (LAB.md): start it from the guest's /tmp
            procs.append(subprocess.Popen(hog_cmd, cwd="/tmp", stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, text=True))
        fifo = ["--fifo"] if boost == "fifo" else []
        names = ["probe_boost", "probe_plain"]
        twins = [
            subprocess.Popen([*me, "worker", name, str(duration + 90), *(fifo if name == names[0] else [])],
                             stdout=subprocess.PIPE, text=True)
            for name in names
        ]
        procs += twins
        wait_for_comm([p.pid for p in twins], names)
        source = RegexTargets("^probe_")
        session = Session(probe, source)
        session.sync()
        before = {tid: (r.target.tgid, schedstat(r.target.tgid, tid)) for tid, r in session.records.items()}
        spawn = subprocess.Popen([*me, "spawner", str(duration - 2.0)], stdout=subprocess.PIPE, text=True)
        procs.append(spawn)
        deadline = session.started + duration
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.5, left))
            session.sync()
        after = {tid: schedstat(tgid, tid) for tid, (tgid, _) in before.items()}
        result = session.result()
        out["probe"] = result.to_json()
        out["schedstat_wait_ns"] = {
            str(tid): (after[tid] - b) if (b is not None and after[tid] is not None) else None
            for tid, (_, b) in before.items()
        }
        spawn.wait(timeout=60)
        assert spawn.stdout is not None
        out["spawner"] = json.loads(spawn.stdout.readline() or "{}")
        source.close()
    finally:
        probe.close()
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--duration", type=float, default=10.0)
    r.add_argument("--boost", choices=("fifo", "agent"), default="fifo")
    r.add_argument("--hogs", type=int, default=8)
    w = sub.add_parser("worker")
    w.add_argument("name")
    w.add_argument("seconds", type=float)
    w.add_argument("--fifo", action="store_true")
    s = sub.add_parser("spawner")
    s.add_argument("seconds", type=float)
    args = ap.parse_args()
    if args.mode == "run":
        run(args.duration, args.boost, args.hogs)
    elif args.mode == "worker":
        worker(args.name, args.seconds, args.fifo)
    else:
        spawner(args.seconds)


if __name__ == "__main__":
    main()
