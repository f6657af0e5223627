"""Guest side of the int3 reproducer (tests/vm/int3_rate.py): enable and disable the scheduler in a loop
under CPU load, the moment the emulator's `Oops: int3` was seen.

Enabling and disabling a sched_ext scheduler flips dozens of static keys, each a live patch of kernel text
(int3 first, then IPIs to every CPU). Each finished cycle is appended to a file in the scratch share, which
survives the guest dying mid-cycle: the host counts cycles from it.

Run in the lab guest as root: `.venv/bin/python tests/vm/guest_int3.py --cycles N --out FILE`.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gthulhu_node.scheduler import loader


def _spinners(n: int) -> list[int]:
    pids = []
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            while True:
                pass
        pids.append(pid)
    return pids


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cycles", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--hold", type=float, default=0.2, help="seconds enabled per cycle")
    args = parser.parse_args()
    pids = _spinners(args.hogs)
    os.nice(-10)  # the loop itself must keep pace with the hogs, or each cycle takes seconds
    try:
        with args.out.open("a") as out:
            for _ in range(args.cycles):
                started = time.monotonic()
                sched = loader.load(loader.LoadSettings())
                time.sleep(args.hold)
                sched.detach()
                out.write(f"{time.monotonic() - started:.3f}\n")
                out.flush()
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
