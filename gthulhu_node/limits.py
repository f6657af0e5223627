"""The numeric limits of the intent contract, in one leaf module.

Both sides need them: intents/model.py refuses an intent outside them where it enters, and
backends/base.py refuses an entry outside them before any write. Kept here, below both, so neither
imports the other (docs/design.md, "Layers").
"""

from __future__ import annotations

PRIORITY_MAX = 20
SLICE_MIN_NS = 50_000
SLICE_MAX_NS = 1_000_000_000
