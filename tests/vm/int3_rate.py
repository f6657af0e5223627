"""Measure how often the emulator's `Oops: int3` kills a lab guest, per scheduler enable.

    python -m tests.vm.int3_rate --cycles 300 --tcg-thread multi     # the hazard as it was
    python -m tests.vm.int3_rate --cycles 300 --tcg-thread single    # with the fix

Boots a guest of the given shape, runs tests/vm/guest_int3.py (enable/disable cycles under CPU load), and
boots again whenever the guest dies, until the cycles are done. Prints the count of oopses, the rate per
enable and its exact (Clopper-Pearson) 95 % confidence interval, so "none after" says how rare it is.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

from tests.vm.kernel import KERNELS, lab_kernel
from tests.vm.lab import Lab, LabDied


def _binom_cdf(k: int, n: int, p: float) -> float:
    if p <= 0:
        return 1.0
    if p >= 1:
        return 1.0 if k >= n else 0.0
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Exact two-sided confidence interval of a binomial rate (k events in n trials), by bisection."""
    alpha = 1 - level

    def solve(f: float, target: float, increasing: bool) -> float:
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if (f(mid) < target) == increasing:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else solve(lambda p: 1 - _binom_cdf(k - 1, n, p), alpha / 2, True)
    upper = 1.0 if k == n else solve(lambda p: _binom_cdf(k, n, p), alpha / 2, False)
    return lower, upper


def measure(cycles: int, tcg_thread: str, kernel: str, cpus: int, hogs: int) -> dict[str, object]:
    lab = Lab("plain", kernel=lab_kernel(kernel), cpus=cpus, tcg_thread=tcg_thread)
    done = oopses = other_deaths = boots = 0
    started = time.monotonic()
    try:
        while done < cycles:
            boots += 1
            out = lab.scratch_host / "cycles"
            out.unlink(missing_ok=True)
            try:
                r = lab.run([".venv/bin/python", "tests/vm/guest_int3.py", "--cycles", str(cycles - done),
                             "--out", str(out), "--hogs", str(hogs)], timeout=cycles * 30)
                r.check("int3 reproducer")
            except LabDied as exc:
                if "Oops: int3" in exc.console:
                    oopses += 1
                else:
                    other_deaths += 1
                    sys.stderr.write(f"guest died of something else:\n{exc}\n")
            finally:
                n = len(out.read_text().split()) if out.exists() else 0
                done += n
                # the cycle in progress when the guest died was an enable too
                sys.stderr.write(f"boot {boots}: {n} cycles, total {done}, oopses {oopses}\n")
    finally:
        lab.close()
    enables = done + oopses
    low, high = clopper_pearson(oopses, enables)
    return {
        "kernel": kernel, "cpus": cpus, "tcg_thread": tcg_thread, "enables": enables, "oopses": oopses,
        "other_deaths": other_deaths, "rate": oopses / enables, "ci95": [round(low, 5), round(high, 5)],
        "boots": boots, "seconds": round(time.monotonic() - started),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=300)
    parser.add_argument("--tcg-thread", choices=["single", "multi"], default="multi")
    parser.add_argument("--kernel", choices=KERNELS, default="7.3")
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--hogs", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(measure(args.cycles, args.tcg_thread, args.kernel, args.cpus, args.hogs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
