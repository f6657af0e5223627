"""The intent store: the validated intents of every source, versioned per source, persisted atomically.

Why one store: every source (the gRPC API, local policy files, the upstream Manager's REST push) ends in
the same place, with the same validation and the same replace-one-source semantics, and the reconciler
reads one consistent snapshot of all of them. A source's push replaces that source's intents only.

Generations make retries and reordering safe. Per source the store keeps the generation of the last
accepted push and the digest of its content:
- generation 0: "no ordering" (people, the CLI, the REST push): a set equal to the stored one is a no-op,
  any other set is stored with the next generation; the next after the largest (2^64-1) is 1, so a
  source a client pushed at 2^64-1 (a -1 sent as uint64) can still be changed: by a push at 0, after
  which ordered pushes go on from 1 (issue 38, item 8; before, no push could ever change it again);
- lower than the stored generation: refused (StaleGenerationError), nothing changes;
- equal to it: the same content again is a no-op success (a retry), other content is refused;
- higher: the set replaces the stored one.
A delete removes one intent and keeps the generation, so a retried push of the same generation stays a
no-op rather than bringing the deleted intent back.

Persistence (the snapshot `intents.json` and its journal, atomic commits, reading back, the migration of
older versions) is the state file's: gthulhu_node/intents/state_file.py. A change is encoded for the disk
before it replaces the set in memory (one that cannot be encoded is refused and nothing changes), and a
write that fails puts the old set back: memory and disk hold the same set whatever fails, so what the APIs
serve is what a restart finds. The `local` source is not persisted: the policy files are its persistence.

Thread-safe: gRPC handlers, the REST server and the local-file watcher call it concurrently. Listeners
are told "source X changed" after the change is stored and persisted; they read `snapshot()` for the rest.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from gthulhu_node.intents.model import RESERVED_SOURCES, Intent, SenderEntry, check_source
from gthulhu_node.intents.parse import IntentValidationError, check_set
from gthulhu_node.intents.source_set import EMPTY_DIGEST, GENERATION_MAX, Docs, SourceSet, digest, digest_docs
from gthulhu_node.intents.state_file import StateFile, refuse_unencodable
from gthulhu_node.intents.store_errors import (
    IntentNotFoundError,
    LimitError,
    StaleGenerationError,
    StateTooLargeError,
    UnencodableError,
)

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class ApplyOutcome:
    source: str
    generation: int
    # False when the push was a no-op (same content as stored)
    changed: bool


@dataclass(slots=True)
class StoreStats:
    """Counters for metrics (read at scrape time)."""

    applies: int = 0
    applies_unchanged: int = 0
    refused_stale: int = 0
    refused_invalid: int = 0
    deletes: int = 0
    persist_writes: int = 0
    persist_errors: int = 0
    corrupt_state_files: int = 0
    loaded_intents: int = 0
    intents: dict[str, int] = field(default_factory=dict)  # per source


class IntentStore:
    """Validated intents per source; see the module docstring for the semantics."""

    def __init__(
        self,
        state_dir: Path | None,
        *,
        max_intents_per_source: int = 10_000,
        max_sources: int = 64,
        max_client_intents: int = 50_000,
    ) -> None:
        """`state_dir` None keeps everything in memory (tests, dry runs)."""
        self._state_dir = state_dir
        self._max_intents = max_intents_per_source
        self._max_sources = max_sources
        self._max_client_intents = max_client_intents
        self._lock = threading.RLock()
        self._sources: dict[str, SourceSet] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._stats = StoreStats()
        self._file = StateFile(state_dir) if state_dir is not None else None
        self._digests: dict[str, str] = {}  # source -> digest() of its content, once computed

    @property
    def max_intents_per_source(self) -> int:
        return self._max_intents

    @property
    def state_dir(self) -> Path | None:
        return self._state_dir

    @property
    def state_file(self) -> Path | None:
        return self._file.path if self._file is not None else None

    # -- reading -------------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, SourceSet]:
        """Every source's current set (an immutable copy)."""
        with self._lock:
            return dict(self._sources)

    def get(self, source: str) -> SourceSet | None:
        with self._lock:
            return self._sources.get(source)

    def stats(self) -> StoreStats:
        with self._lock:
            counts = {name: len(ss.intents) for name, ss in self._sources.items()}
            return dataclasses.replace(self._stats, intents=counts)

    def subscribe(self, listener: Callable[[str], None]) -> None:
        """Call `listener(source)` after every stored change (from the thread that made it)."""
        with self._lock:
            self._listeners.append(listener)

    # -- writing -------------------------------------------------------------------------------------

    def apply(
        self,
        source: str,
        generation: int,
        intents: Sequence[Intent],
        *,
        allow_reserved: bool = False,
        entries: Sequence[SenderEntry] = (),
    ) -> ApplyOutcome:
        """Replace `source`'s set (module docstring: generation rules). `entries`: the push as its
        sender wrote it (SenderEntry), stored and persisted with the intents.

        Raises IntentValidationError (bad source, too many intents, duplicate id), StaleGenerationError,
        LimitError, or OSError when the state could not be persisted (then nothing changed).
        """
        try:
            check_source(source, allow_reserved=allow_reserved)
        except ValueError as exc:
            self._count("refused_invalid")
            raise IntentValidationError("source", str(exc)) from None
        if not 0 <= generation <= GENERATION_MAX:
            self._count("refused_invalid")
            raise IntentValidationError("generation", f"must be 0-{GENERATION_MAX}")
        try:
            check_set(intents, max_count=self._max_intents)
        except IntentValidationError:
            self._count("refused_invalid")
            raise
        docs = Docs.of(intents, entries)
        try:
            new_digest = digest_docs(docs)
        except UnicodeEncodeError:
            self._count("refused_invalid")
            try:
                refuse_unencodable(source, {"intents": docs.intents, "entries": docs.entries})
            except UnencodableError as exc:
                log.warning("intents_refused_unencodable", source=source, error=str(exc))
                raise
        with self._lock:
            current = self._sources.get(source)
            cur_gen = current.generation if current else 0
            cur_push = current.push_digest if current else EMPTY_DIGEST
            cur_content = self._content_digest(source)
            if generation == 0:
                if new_digest == cur_content:
                    self._stats.applies_unchanged += 1
                    return ApplyOutcome(source, cur_gen, changed=False)
                # At the largest generation the numbering starts again (module docstring).
                new_gen = cur_gen + 1 if cur_gen < GENERATION_MAX else 1
                if new_gen == 1 and cur_gen:
                    log.warning("source_generation_restarted", source=source, previous=cur_gen)
            elif generation < cur_gen:
                self._stats.refused_stale += 1
                raise StaleGenerationError(
                    f"generation {generation} of source {source!r} is stale: {cur_gen} is stored"
                )
            elif generation == cur_gen:
                if new_digest == cur_push:
                    self._stats.applies_unchanged += 1
                    return ApplyOutcome(source, cur_gen, changed=False)
                self._stats.refused_stale += 1
                raise StaleGenerationError(
                    f"generation {generation} of source {source!r} is already stored with other "
                    "content: use a higher generation"
                )
            else:
                new_gen = generation
            # The limit is for gRPC clients: the agent's own sources (local files, the Manager) never
            # lose their place to them.
            if current is None and source not in RESERVED_SOURCES:
                clients = sum(1 for name in self._sources if name not in RESERVED_SOURCES)
                if clients >= self._max_sources:
                    raise LimitError(f"at most {self._max_sources} sources; {source!r} would be one more")
            if source not in RESERVED_SOURCES:
                others = sum(len(ss.intents) for name, ss in self._sources.items()
                             if name not in RESERVED_SOURCES and name != source)
                if others + len(intents) > self._max_client_intents:
                    raise LimitError(
                        f"{others + len(intents)} intents in all client sources, at most "
                        f"{self._max_client_intents} (api.max_client_intents)"
                    )
            changed = new_digest != cur_content
            new = SourceSet(source, new_gen, tuple(intents), new_digest, time.time(), tuple(entries))
            self._commit(source, new, docs, new_digest)
            self._stats.applies += 1
        log.info(
            "intents_accepted",
            source=source,
            generation=new_gen,
            intents=len(intents),
            changed=changed,
        )
        self._notify(source)
        return ApplyOutcome(source, new_gen, changed)

    def delete(self, source: str, intent_id: str, *, allow_reserved: bool = False) -> SourceSet:
        """Remove one intent of a source, keeping its generation. Raises IntentNotFoundError."""
        try:
            check_source(source, allow_reserved=allow_reserved)
        except ValueError as exc:
            raise IntentValidationError("source", str(exc)) from None
        with self._lock:
            current = self._sources.get(source)
            if current is None or all(i.id != intent_id for i in current.intents):
                raise IntentNotFoundError(f"no intent {intent_id!r} in source {source!r}")
            kept = tuple(i for i in current.intents if i.id != intent_id)
            entries = tuple(e for e in current.entries if e.intent_id != intent_id)
            new = SourceSet(source, current.generation, kept, current.push_digest, time.time(), entries)
            self._commit(source, new)
            self._stats.deletes += 1
        log.info("intent_deleted", source=source, intent_id=intent_id)
        self._notify(source)
        return new

    def _content_digest(self, source: str) -> str:
        """digest() of what `source` holds now, remembered from its last change (lock held)."""
        known = self._digests.get(source)
        if known is None:
            current = self._sources.get(source)
            known = digest(current.intents, current.entries) if current else EMPTY_DIGEST
            self._digests[source] = known
        return known

    def _commit(self, source: str, new: SourceSet, docs: Docs | None = None, content: str = "") -> None:
        """Encode `new` for the disk, swap it in and persist (lock held by the caller). Encoding comes
        first: a set that cannot be encoded (a lone surrogate, too large) is refused before it touches
        memory; a write error puts the old set back, so memory and disk always hold the same set.
        `docs`, `content`: new's documents and digest when the caller has them."""
        old = self._sources.get(source)
        try:
            write = None if self._file is None else self._file.encode(self._sources, source, old, new, docs)
        except UnencodableError as exc:
            self._stats.refused_invalid += 1
            log.warning("intents_refused_unencodable", source=source, error=str(exc))
            raise
        except StateTooLargeError as exc:
            self._stats.persist_errors += 1
            log.error("intents_persist_failed", source=source, error=str(exc))
            raise
        self._sources[source] = new
        self._digests.pop(source, None)
        if content:
            self._digests[source] = content
        if write is None:
            return
        try:
            write()
        except OSError as exc:
            self._digests.pop(source, None)
            if old is None:
                del self._sources[source]
            else:
                self._sources[source] = old
            self._stats.persist_errors += 1
            log.error("intents_persist_failed", source=source, error=str(exc))
            raise
        self._stats.persist_writes += 1

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self._stats, name, getattr(self._stats, name) + 1)

    def _notify(self, source: str) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(source)
            except Exception:
                log.exception("intents_listener_failed", source=source)

    # -- start ---------------------------------------------------------------------------------------

    def load(self) -> int:
        """Load the last accepted intents (call once, before any traffic). Returns how many were loaded.

        A state file that cannot be parsed or validated is moved aside (`intents.json.corrupt-<time>`) and
        the store starts empty; the reason is logged. Missing file: empty store. Other errors propagate
        (`StateFile.read`).
        """
        if self._file is None:
            return 0
        try:
            sources = self._file.read()
        except FileNotFoundError:
            return 0
        if sources is None:
            with self._lock:
                self._stats.corrupt_state_files += 1
            return 0
        count = sum(len(ss.intents) for ss in sources.values())
        with self._lock:
            self._sources.update(sources)
            self._stats.loaded_intents = count
        log.info("intents_loaded", path=str(self._file.path), sources=len(sources), intents=count)
        for source in sources:
            self._notify(source)
        return count
