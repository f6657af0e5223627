"""The numeric limits of the intent contract, in one leaf module.

Both sides need them: intents/model.py refuses an intent outside them where it enters, and
backends/base.py refuses an entry outside them before any write. Kept here, below both, so neither
imports the other (docs/design.md, "Layers").
"""

from __future__ import annotations

PRIORITY_MAX = 20
SLICE_MIN_NS = 50_000
SLICE_MAX_NS = 1_000_000_000


def boost_levels_strongest_first() -> list[int]:
    """Every boost level (0 is no boost), strongest first: the one place that says which way the scale
    runs, so code and tests that compare levels by strength never compare their numbers."""
    return list(range(PRIORITY_MAX, 0, -1))
