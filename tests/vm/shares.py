"""How the lab's scheduler tests compare CPU shares with EEVDF's in the same boot (issue 15's tolerance)."""

from __future__ import annotations


def close(ours: float, eevdf: float, relative: float = 0.2) -> bool:
    """The issue's tolerance: 20 % of EEVDF's share, or one point of a CPU, whichever is larger."""
    return abs(ours - eevdf) <= max(relative * eevdf, 0.01)


Shares = dict[str, float]


def leaves_off_eevdf(ours: Shares, eevdf: Shares, by_weights: Shares) -> list[str]:
    """The leaves where ours strays from EEVDF by more than the issue's tolerance, among those where EEVDF
    itself is within half that tolerance of the weights. EEVDF on 2 CPUs is a noisy reference (it splits a
    group's weight per CPU by where its tasks sit): with the full tolerance here, a leaf EEVDF gave 18 % under
    the weights failed ours for sitting exactly on them (CI of 504e2c2: b.service ours 0.183, EEVDF 0.149,
    0.182 by the weights). Not the BestEffort leaf: it is at the floor, where ours gives deliberately more
    than EEVDF (0.0117 against EEVDF's 0.0014 in a two-lane run, 0.0105 by the weights), and the absolute
    tolerance let EEVDF's near-zero share count as "matching the weights" there."""
    return [leaf for leaf in by_weights
            if "besteffort" not in leaf and close(eevdf[leaf], by_weights[leaf], relative=0.1)
            and not close(ours[leaf], eevdf[leaf])]


#: the share of a measuring window the host may stall (a vCPU stopped by the emulator counts as run time of
#: the task it ran) before the window is measured again: sched_workloads' 50 cpu.max cgroups, whose test
#: (test_scheduler.py) fails on a window stalled that long three times
STALLED_WINDOW = 0.1
