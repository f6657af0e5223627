"""A vLLM-like engine process for the lab: a leader named `python3.12` whose worker threads name themselves
`EngineCore_DP0`, `EngineCore_DP1`, ... with prctl(PR_SET_NAME), like vLLM's engine-core threads, and run
engine steps: 2 ms of their own CPU time, then a 5 ms sleep, repeated.

The CPU work is hashing (hashlib releases the GIL for large buffers), so the threads run in parallel on
different CPUs as native engine threads would, and a step's wall time measures the scheduler, not the GIL.

    vllm_engine.py --seconds 20 --tids FILE --out FILE

--tids: written (JSON {comm: tid}) as soon as every thread has named itself.
--out: written at the end: per thread its steps, steps per second, run-queue wait (schedstat delta over
the run) and the p50/p99 of the step's wall time. Without --seconds it runs until killed. --idle: the
threads only sleep (for tests that need the threads, not the load).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import threading
import time
from pathlib import Path

PR_SET_NAME = 15
STEP_CPU_S = 0.002
SLEEP_S = 0.005
CHUNK = b"\0" * 8192
_libc = ctypes.CDLL(None, use_errno=True)


def set_name(name: str) -> None:
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def runqueue_wait_ns(tid: int) -> int:
    return int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1])


class EngineThread(threading.Thread):
    def __init__(self, name: str, deadline: float | None, named: threading.Barrier, idle: bool) -> None:
        super().__init__(daemon=True)
        self.idle = idle
        self.comm = name
        self.deadline = deadline
        self.named = named
        self.tid = 0
        self.steps = 0
        self.step_wall: list[float] = []
        self.wait_ns = 0
        self.seconds = 0.0

    def run(self) -> None:
        set_name(self.comm)
        self.tid = threading.get_native_id()
        self.named.wait()
        wait0 = runqueue_wait_ns(self.tid)
        start = time.monotonic()
        while self.deadline is None or time.monotonic() < self.deadline:
            if self.idle:
                time.sleep(0.5)
                continue
            t0 = time.monotonic()
            cpu0 = time.thread_time()
            while time.thread_time() - cpu0 < STEP_CPU_S:
                hashlib.sha256(CHUNK)
            self.step_wall.append(time.monotonic() - t0)
            self.steps += 1
            time.sleep(SLEEP_S)
        self.seconds = time.monotonic() - start
        self.wait_ns = runqueue_wait_ns(self.tid) - wait0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=None)
    parser.add_argument("--tids", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--idle", action="store_true", help="name the threads, then only sleep")
    args = parser.parse_args()
    set_name("python3.12")
    named = threading.Barrier(args.threads + 1)
    deadline = time.monotonic() + args.seconds + 0.5 if args.seconds else None
    threads = [EngineThread(f"EngineCore_DP{i}", deadline, named, args.idle) for i in range(args.threads)]
    for t in threads:
        t.start()
    named.wait()
    if args.tids:
        tmp = args.tids.with_suffix(".tmp")
        tmp.write_text(json.dumps({t.comm: t.tid for t in threads} | {"leader": os.getpid()}))
        tmp.rename(args.tids)
    for t in threads:
        t.join()
    if args.out:
        report = {
            t.comm: {
                "tid": t.tid,
                "steps": t.steps,
                "steps_per_s": t.steps / t.seconds if t.seconds else 0.0,
                "runqueue_wait_ms": t.wait_ns / 1e6,
                "runqueue_wait_per_step_ms": t.wait_ns / 1e6 / t.steps if t.steps else 0.0,
                "step_p50_ms": percentile(t.step_wall, 0.50) * 1e3,
                "step_p99_ms": percentile(t.step_wall, 0.99) * 1e3,
            }
            for t in threads
        }
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
