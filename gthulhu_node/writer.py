"""The writer: the desired entries against what the backend holds, and the writes that close the gap.

It owns four things and nothing else: the desired table (key -> entry and the intent that produced it),
its view of what the backend holds (`applied`: read back at `read_back`, then changed only by writes the
backend reported done), the per-key retry queue (`gthulhu_node/outbox.py`: dirty keys with their event
time, refused keys with a typed `FailureReason` and a retry time), and the time budget of a flush with its
cost model (the measured cost of one key's write). The task table tells it what it wants (`want`); it
never reads /proc nor knows a task. It holds the supervised backend for life
(`gthulhu_node/backends/supervisor.py`): while that is down, writes are held.

What changed for status is left in two sets the status projection drains: `changed_keys` (a row says
which key carries its strategy and whether the backend holds it) and `touched` (intents whose failures
changed). Latency listeners are called for every write caused by an event, with the time from the
kernel's event timestamp to the end of the backend write: the only record of reaction latency.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import structlog

from gthulhu_node.backends.base import ApplyResult, BackendError, Entry, EntryKey, MapFullError, TaskGoneError
from gthulhu_node.backends.supervisor import SupervisedBackend
from gthulhu_node.outbox import FailureReason, Outbox

log = structlog.get_logger(__name__)

# First guess of one key's write cost, before a budgeted flush has measured the backend.
_WRITE_COST_GUESS_S = 0.0002
# A budgeted flush's batches start this small and at most double: a backend slower than the guess (or
# than it was) costs one small batch too many, not one budget-sized batch at the wrong price.
_FIRST_BATCH = 2


@dataclass(frozen=True, slots=True)
class Want:
    """One desired entry and the intent that produced it."""

    entry: Entry
    owner: str


@dataclass(slots=True)
class IntentFailures:
    """One intent's write failures (history, not state): how many, the last reason and message."""

    count: int = 0
    last_reason: FailureReason = FailureReason.BACKEND
    last_message: str = ""


@dataclass(slots=True)
class WriterStats:
    batches: int = 0
    upserts: int = 0
    deletes: int = 0
    write_failures: int = 0
    write_retries: int = 0  # writes of a refused key again after its backoff (not at a full diff)
    map_full: int = 0
    tasks_gone: int = 0


# explain's view of one key: (desired entry, the intent that wants it, applied entry, why refused or "")
EntryView = tuple[Entry | None, str, Entry | None, str]


def entry_of(want: Want | None) -> Entry | None:
    return want.entry if want is not None else None


# owner -> ([refused, unwritten], refused by reason): an intent's entries not in the backend right now
Pending = dict[str, tuple[list[int], dict[FailureReason, int]]]


class Writer:
    """Desired against applied, written in batches within a time budget. Not thread-safe: the engine
    thread owns it."""

    def __init__(self, backend: SupervisedBackend, *, clock: Callable[[], float] = time.monotonic,
                 on_latency: Callable[[float], None] | None = None) -> None:
        self.backend = backend
        self._clock = clock
        # replaced whole, never mutated: another thread may add a listener while the engine thread reads it
        self._latency_listeners: tuple[Callable[[float], None], ...] = (on_latency,) if on_latency else ()
        self._desired: dict[EntryKey, Want] = {}
        self._applied: dict[EntryKey, Entry] = {}
        self._outbox = Outbox()
        self.failures_by_intent: dict[str, IntentFailures] = {}
        self.stats = WriterStats()
        self.changed_keys: set[EntryKey] = set()
        self.touched: set[str] = set()
        # None: a flush finishes in the call (tests, preview). The engine sets a few milliseconds: a long
        # write is done in batches of about this much, one slice per loop turn.
        self.budget_s: float | None = None
        self._write_cost_s = _WRITE_COST_GUESS_S

    # ---- what is wanted -----------------------------------------------------------------------------

    def want(self, key: EntryKey, entry: Entry | None, owner: str, ts: int) -> None:
        """The task table's wish for `key` (None: no entry), caused by an event at `ts` (0: none)."""
        cur = self._desired.get(key)
        if entry is None:
            if cur is None:
                return
            del self._desired[key]
        else:
            if cur is not None and cur.entry == entry:
                if cur.owner != owner:
                    self._desired[key] = Want(entry, owner)
                return
            self._desired[key] = Want(entry, owner)
        self._outbox.mark(key, ts)
        self.changed_keys.add(key)

    def view(self, key: EntryKey) -> EntryView:
        """For `explain`: the key's desired entry, the intent that wants it, the applied entry, and why
        the backend refused it ("" when it did not)."""
        want = self._desired.get(key)
        failed = self._outbox.failed.get(key)
        return (entry_of(want), want.owner if want else "", self._applied.get(key),
                failed.reason.value if failed else "")

    def wanted(self, key: EntryKey) -> bool:
        return key in self._desired

    def holds(self, key: EntryKey) -> bool:
        """The backend holds what is wanted for `key`."""
        return self._applied.get(key) == entry_of(self._desired.get(key))

    def mark_all_dirty(self) -> None:
        self._outbox.mark_all(self._desired.keys() | self._applied.keys())

    def retry_refused_now(self) -> None:
        """Refused keys are tried again at once (a new policy), not after their backoff."""
        self._outbox.mark_all(self._outbox.failed.keys())
        self._outbox.failed.clear()

    def forget_intents_but(self, keep: Mapping[str, object]) -> None:
        for key in [k for k in self.failures_by_intent if k not in keep]:
            del self.failures_by_intent[key]

    def read_back(self) -> None:
        """Re-read what the backend holds (after a restart or reload); every key is written again."""
        try:
            self._applied = dict(self.backend.read_back())
        except BackendError as exc:
            log.error("backend_read_back_failed", backend=self.backend.name, error=str(exc))
            self._applied = {}
        self._outbox.failed.clear()
        self.mark_all_dirty()

    # ---- outputs ------------------------------------------------------------------------------------

    def desired(self) -> dict[EntryKey, Entry]:
        return {k: w.entry for k, w in self._desired.items()}

    def applied(self) -> dict[EntryKey, Entry]:
        return dict(self._applied)

    def failures(self) -> dict[EntryKey, FailureReason]:
        return {k: f.reason for k, f in self._outbox.failed.items()}

    @property
    def dirty(self) -> bool:
        return bool(self._outbox.dirty)

    @property
    def sizes(self) -> tuple[int, int]:
        """(entries desired, entries applied)."""
        return len(self._desired), len(self._applied)

    def next_retry_at(self) -> float:
        """When the earliest refused key is due to be written again (monotonic seconds; inf if none, or
        while writes are held)."""
        return math.inf if self.backend.held else self._outbox.next_retry_at()

    def pending(self) -> Pending:
        """Per intent: its refused entries (by reason) and its entries waiting for their write (a pass
        over the outbox, which is short outside a long write)."""
        desired, applied, outbox = self._desired, self._applied, self._outbox
        live: Pending = {}
        for failed_key, failure in outbox.failed.items():
            want = desired.get(failed_key)
            if want is not None:
                counts, reasons = live.setdefault(want.owner, ([0, 0], {}))
                counts[0] += 1
                reasons[failure.reason] = reasons.get(failure.reason, 0) + 1
        for dirty_key in outbox.dirty:
            want = desired.get(dirty_key)
            if want is not None and applied.get(dirty_key) != want.entry:
                live.setdefault(want.owner, ([0, 0], {}))[0][1] += 1
        return live

    def check_invariants(self) -> None:
        """A key whose desired and applied values differ is dirty or refused; after a flush that left
        nothing dirty (and writes not held), exactly the refused ones differ."""
        desired, applied, outbox = self._desired, self._applied, self._outbox
        differ = {k for k in desired.keys() | applied.keys() if applied.get(k) != entry_of(desired.get(k))}
        assert differ <= outbox.dirty.keys() | outbox.failed.keys(), differ
        if not outbox.dirty and not self.backend.held:
            assert differ == outbox.failed.keys(), (differ, set(outbox.failed))

    # ---- writing ------------------------------------------------------------------------------------

    def flush(self) -> ApplyResult:
        """Write every dirty key, and every refused key whose retry is due, whose desired value differs
        from what the backend holds: as one batch, or with a `budget_s` in batches until about that long
        has passed (event-caused keys first; the rest stay dirty for the next flush)."""
        outbox = self._outbox
        if self.backend.held or (not outbox.dirty and not outbox.failed):
            return ApplyResult()
        now = self._clock()
        dirty, retried = outbox.take(now)
        if not dirty:
            return ApplyResult()
        todo: list[tuple[EntryKey, Entry | None]] = []
        desired, applied, failed_keys = self._desired, self._applied, outbox.failed
        for key in dirty:
            entry = entry_of(desired.get(key))
            if entry == applied.get(key):
                failed_keys.pop(key, None)
                continue
            todo.append((key, entry))
        if not todo:
            return ApplyResult()
        self.stats.write_retries += retried
        budget = self.budget_s
        if budget is None:
            return self._write(todo, dirty, now)
        todo.sort(key=lambda item: dirty[item[0]] == 0)  # event-caused writes first: their latency counts
        deadline = time.monotonic() + budget
        total = ApplyResult()
        i, n = 0, _FIRST_BATCH
        while i < len(todo):
            start = time.monotonic()
            if i and start >= deadline:
                break
            n = max(1, min(2 * n if i else n, int((deadline - start) / self._write_cost_s)))
            chunk = todo[i:i + n]
            result = self._write(chunk, dirty, now)
            self._write_cost_s = max(1e-6, 0.5 * self._write_cost_s
                                     + 0.5 * (time.monotonic() - start) / len(chunk))
            total.upserted += result.upserted
            total.deleted += result.deleted
            total.failed.update(result.failed)
            i += len(chunk)
        for key, _unwritten in todo[i:]:
            outbox.mark(key, dirty[key])
        return total

    def _write(self, todo: list[tuple[EntryKey, Entry | None]], dirty: dict[EntryKey, int],
               now: float) -> ApplyResult:
        """One batch to the backend; the tables follow what it reports."""
        upserts: dict[EntryKey, Entry] = {}
        deletes: list[EntryKey] = []
        for key, entry in todo:
            if entry is None:
                deletes.append(key)
            else:
                upserts[key] = entry
        applied, outbox = self._applied, self._outbox
        failed_keys = outbox.failed
        st = self.stats
        st.batches += 1
        try:
            result = self.backend.apply(upserts, deletes)
        except Exception as raised:
            # The whole batch was refused (nothing written): every key keeps its old applied value and is
            # retried on its own. An exception no backend should raise (a bug, an OSError let through) is
            # a refusal too, logged with its traceback: raised through the engine, it dropped the keys
            # taken for this write until the next rescan.
            exc = (raised if isinstance(raised, BackendError)
                   else BackendError(f"{type(raised).__name__}: {raised}"))
            log.error("backend_write_failed", backend=self.backend.name, keys=len(upserts) + len(deletes),
                      error=str(exc), exc_info=not isinstance(raised, BackendError))
            st.write_failures += len(upserts) + len(deletes)
            for key in [*upserts, *deletes]:
                self._record_failure(key, exc, now)
            return ApplyResult(failed={k: exc for k in [*upserts, *deletes]})
        done = time.monotonic_ns()
        failed = result.failed
        changed = self.changed_keys
        for key, entry in upserts.items():
            err = failed.get(key)
            if err is None:
                applied[key] = entry
                failed_keys.pop(key, None)
                changed.add(key)
            elif isinstance(err, TaskGoneError):
                st.tasks_gone += 1
                self._desired.pop(key, None)
                changed.add(key)
                failed_keys.pop(key, None)
                if key in applied:  # an older entry under that key: delete it at the next flush
                    outbox.mark(key, 0)
            else:
                st.write_failures += 1
                if isinstance(err, MapFullError):
                    st.map_full += 1
                self._record_failure(key, err, now)
        for key in deletes:
            err = failed.get(key)
            if err is None or isinstance(err, TaskGoneError):
                applied.pop(key, None)
                failed_keys.pop(key, None)
                changed.add(key)
            else:
                st.write_failures += 1
                self._record_failure(key, err, now)
        st.upserts += result.upserted
        st.deletes += result.deleted
        self._observe_latencies(dirty, upserts, deletes, failed, done)
        return result

    def _observe_latencies(
        self,
        dirty: dict[EntryKey, int],
        upserts: dict[EntryKey, Entry],
        deletes: list[EntryKey],
        failed: dict[EntryKey, BackendError],
        done_ns: int,
    ) -> None:
        listeners = self._latency_listeners
        if not listeners:
            return
        for key in [*upserts, *deletes]:
            ts = dirty.get(key, 0)
            if ts <= 0 or key in failed:
                continue
            seconds = max(0, done_ns - ts) / 1e9
            for listener in listeners:
                listener(seconds)

    def add_latency_listener(self, listener: Callable[[float], None]) -> None:
        """Also call `listener(seconds)` for every event-caused write (metrics' histogram). Thread-safe."""
        self._latency_listeners = (*self._latency_listeners, listener)

    def _record_failure(self, key: EntryKey, err: BackendError, now: float) -> None:
        failure = self._outbox.fail(key, err, now)
        reason, message = failure.reason, failure.message
        want = self._desired.get(key)
        if want is None:
            return
        self.touched.add(want.owner)
        f = self.failures_by_intent.get(want.owner)
        first = f is None or f.last_message != message
        if f is None:
            f = self.failures_by_intent[want.owner] = IntentFailures()
        f.count += 1
        f.last_reason, f.last_message = reason, message
        if first:
            log.warning("entry_write_failed", intent_id=want.owner, key=str(key), reason=reason.value,
                        error=message)

    def refused(self) -> Iterable[tuple[EntryKey, FailureReason, str]]:
        """Refused keys waiting for their retry: (key, reason, owning intent or "")."""
        desired = self._desired
        for key, failure in self._outbox.failed.items():
            want = desired.get(key)
            yield key, failure.reason, want.owner if want is not None else ""

    def unwritten(self) -> Iterable[str]:
        """The owning intent of each dirty key whose desired entry the backend does not hold yet."""
        desired, applied = self._desired, self._applied
        for key in self._outbox.dirty:
            want = desired.get(key)
            if want is not None and applied.get(key) != want.entry:
                yield want.owner
