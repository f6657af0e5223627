"""The numeric limits of the intent contract, in one leaf module.

Both sides need them: intents/model.py refuses an intent outside them where it enters, and
backends/base.py refuses an entry outside them before any write. Kept here, below both, so neither
imports the other (docs/design.md, "Layers").
"""

from __future__ import annotations

PRIORITY_MAX = 20
# Upstream Gthulhu's kernel-mode scale (issue 39): the lower the number, the stronger; 0 is no boost.
# 1-PREEMPT_TIER_LAST preempt unboosted and weaker work; the rest, up to PRIORITY_MAX, get a head start.
PREEMPT_TIER_LAST = 9
SLICE_MIN_NS = 50_000
SLICE_MAX_NS = 1_000_000_000


def boost_levels_strongest_first() -> list[int]:
    """Every boost level (0 is no boost), strongest first: the one place that says which way the scale
    runs, so code and tests that compare levels by strength never compare their numbers."""
    return list(range(1, PRIORITY_MAX + 1))


def strength(priority: int) -> int:
    """How strong a priority is, as a number that grows with strength: 0 for no boost (0, or anything
    outside 1-PRIORITY_MAX), PRIORITY_MAX for level 1, 1 for level PRIORITY_MAX. Compare these, never the
    priorities themselves (the scale runs the other way)."""
    return PRIORITY_MAX + 1 - priority if 1 <= priority <= PRIORITY_MAX else 0


def stronger(a: int, b: int) -> bool:
    """Whether priority `a` is strictly stronger than priority `b`."""
    return strength(a) > strength(b)


def preempts(priority: int) -> bool:
    """Whether a level is in the preempt tier (1-PREEMPT_TIER_LAST): served ahead of unboosted work."""
    return 1 <= priority <= PREEMPT_TIER_LAST


def migrate_pre_issue39(priority: int) -> int:
    """A priority saved on the scale before issue 39 (20 the strongest) on today's: order kept (ties where
    20 levels meet 9) and every old boost still in the preempt tier, as every old level preempted:
    old 20 -> 1, old 1 -> 9, 0 stays 0. docs/intents.md ("Upgrading from the old scale")."""
    if not 1 <= priority <= PRIORITY_MAX:
        return priority
    return PREEMPT_TIER_LAST - ((priority - 1) * PREEMPT_TIER_LAST) // PRIORITY_MAX
