"""The engine-step workload: one thread does 2 ms of its OWN CPU time (thread CPU clock, so contention
shows as a longer wall time, never as less work), then sleeps 5 ms, again and again.

Run as a separate process by tests/bench/test_eevdf_engine_step.py:
`python eevdf_engine_step.py SECONDS [COMM]`. It names its main thread COMM, prints its tid, waits for a
line on stdin (the bench applies the policy meanwhile), runs, and prints one JSON line:
steps/s and the work's wall time per step (p50/p99, ms).
"""

from __future__ import annotations

import ctypes
import json
import statistics
import sys
import threading
import time

PR_SET_NAME = 15
WORK_NS = 2_000_000
SLEEP_S = 0.005


def main() -> None:
    seconds = float(sys.argv[1])
    comm = sys.argv[2] if len(sys.argv) > 2 else "EevdfBenchEng"
    ctypes.CDLL(None).prctl(PR_SET_NAME, comm.encode()[:15], 0, 0, 0)
    print(threading.get_native_id(), flush=True)
    sys.stdin.readline()
    walls: list[float] = []
    started = time.monotonic()
    deadline = started + seconds
    while time.monotonic() < deadline:
        t0 = time.perf_counter_ns()
        end = time.thread_time_ns() + WORK_NS
        while time.thread_time_ns() < end:
            pass
        walls.append((time.perf_counter_ns() - t0) / 1e6)
        time.sleep(SLEEP_S)
    elapsed = time.monotonic() - started
    cuts = statistics.quantiles(walls, n=100)
    print(
        json.dumps(
            {
                "steps": len(walls),
                "steps_per_s": len(walls) / elapsed,
                "p50_ms": statistics.median(walls),
                "p99_ms": cuts[98],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
