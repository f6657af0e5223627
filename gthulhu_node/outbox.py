"""The reconciler's outbox: which keys may differ from the backend, and when a refused one is tried again.

A key is dirty when something changed its desired value (with the kernel timestamp of the earliest event
that did, so the reaction latency can be measured) and failed when the backend refused it. A refused key
is not left for the next full rescan: it is written again on its own after `RETRY_INITIAL_S`, then after
twice as long each time it is refused again, up to `RETRY_MAX_S` (the rescan's default interval, which
tries every key anyway). Why it was refused is a `FailureReason`, so status and metrics never read the
backend's words to decide what happened.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass

from gthulhu_node.backends.base import BackendError, EntryKey, InvalidEntryError, MapFullError

RETRY_INITIAL_S = 0.1
RETRY_MAX_S = 30.0


class FailureReason(enum.Enum):
    """Why the backend refused a key."""

    MAP_FULL = "map_full"  # no room for another entry: raise the map's capacity
    INVALID_ENTRY = "invalid_entry"  # outside the contract's ranges
    BACKEND = "backend"  # anything else the backend reported (or the whole batch was refused)

    @classmethod
    def of(cls, err: BackendError) -> FailureReason:
        if isinstance(err, MapFullError):
            return cls.MAP_FULL
        if isinstance(err, InvalidEntryError):
            return cls.INVALID_ENTRY
        return cls.BACKEND


@dataclass(frozen=True, slots=True)
class Failure:
    reason: FailureReason
    message: str  # the backend's words, for people
    attempts: int  # consecutive refusals of this key
    retry_at: float  # monotonic seconds


class Outbox:
    """`dirty` (key -> earliest event timestamp in ns that touched it, 0 if none) and `failed` (key ->
    its last refusal). The reconciler keeps this invariant: outside a flush, every key whose desired value
    differs from the applied one is dirty or failed; right after a flush (writes not held) the keys that
    differ are exactly the failed ones."""

    __slots__ = ("dirty", "failed")

    def __init__(self) -> None:
        self.dirty: dict[EntryKey, int] = {}
        self.failed: dict[EntryKey, Failure] = {}

    def mark(self, key: EntryKey, ts: int) -> None:
        dirty = self.dirty
        if key not in dirty or (ts and not dirty[key]):
            dirty[key] = ts

    def mark_all(self, keys: Iterable[EntryKey]) -> None:
        dirty = self.dirty
        for key in keys:
            dirty.setdefault(key, 0)

    def take(self, now: float) -> tuple[dict[EntryKey, int], int]:
        """Everything dirty plus the failed keys whose retry is due; the second value counts the latter."""
        dirty, self.dirty = self.dirty, {}
        retried = 0
        for key, f in self.failed.items():
            if f.retry_at <= now and key not in dirty:
                dirty[key] = 0
                retried += 1
        return dirty, retried

    def fail(self, key: EntryKey, err: BackendError, now: float) -> Failure:
        """Record a refusal; the key's next try is due after its backoff."""
        prev = self.failed.get(key)
        attempts = prev.attempts + 1 if prev is not None else 1
        delay = min(RETRY_INITIAL_S * 2 ** min(attempts - 1, 32), RETRY_MAX_S)
        f = self.failed[key] = Failure(FailureReason.of(err), str(err), attempts, now + delay)
        return f

    def next_retry_at(self) -> float:
        return min((f.retry_at for f in self.failed.values()), default=math.inf)
