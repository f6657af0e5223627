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

Persistence, under the state directory: a snapshot, `intents.json` (written as temp file + fsync +
rename + fsync of the directory), and a journal, `intents.journal`, to which each change appends one
checksummed, fsync'd record of what it changed (intents/journal.py). When the journal outgrows the
snapshot (or 1 MiB, whichever is larger), the next change writes a new snapshot instead: a change costs
its own size on disk, amortized. After a crash (SIGKILL, power loss) reading finds either the old or the
new set, never a mix. The `local` source is not persisted: the policy files are its persistence.
A change is encoded for the disk before it replaces the set in memory: one that cannot be encoded (text
that is not valid Unicode, a state past STATE_MAX_BYTES) is refused and nothing changes; a write that
fails puts the old set back. Memory and disk hold the same set whatever fails, so what the APIs serve is
what a restart finds. A snapshot (or a journal record) that cannot be read is logged, renamed aside with a
timestamp, and the store starts empty. A snapshot of version 1 (release 0.1.0, no journal) is read as it
is, and the first change writes it in the current version. A state of version 1 or 2 holds priorities on
the scale before issue 39 (20 the strongest): reading it moves the intents of every source but the
Manager's to today's scale (`limits.migrate_pre_issue39`: old 20 -> 1, old 1 -> 9, order kept, every old
boost still preempting); the Manager's keep the numbers it pushed, which its merkle root hashes.

Thread-safe: gRPC handlers, the REST server and the local-file watcher call it concurrently. Listeners
are told "source X changed" after the change is stored and persisted; they read `snapshot()` for the rest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import structlog
from pydantic import ValidationError

from gthulhu_node.errors import Conflict, GthulhuError, LimitExceeded, NotFound
from gthulhu_node.intents.documents import STATE_LIMITS, load_json, unencodable_path
from gthulhu_node.intents.journal import (
    COMPACT_MIN_BYTES,
    JOURNAL_FILE,
    Journal,
    apply_diff,
    diff_items,
    encode_line,
    new_journal_id,
    read_journal,
)
from gthulhu_node.intents.model import (
    PATTERN_MAX_BYTES,
    RESERVED_SOURCES,
    SENDER_SOURCES,
    Intent,
    SenderEntry,
    check_source,
)
from gthulhu_node.intents.parse import IntentValidationError, check_set, intent_to_doc, parse_intent
from gthulhu_node.limits import migrate_pre_issue39

log = structlog.get_logger(__name__)

STATE_FILE = "intents.json"
STATE_FORMAT = "gthulhu-node-intents"
# The state file's format. Why versioned: an upgraded agent must read what the release before it wrote (the
# saved intents are what make a restart after `apt-get upgrade` keep scheduling); tests/fixtures/state/
# keeps a file of each release as it wrote it. Raise it only for a change an older agent would misread,
# and keep reading every older version here.
# Version 2: the journal beside the snapshot (an agent of version 1 would read the snapshot alone and
# lose the journal's changes: it refuses the file instead). Compact JSON, `journal` names its journal.
# Version 3 (issue 39): priorities on upstream's scale, 1 the strongest (an agent of version 2 would read
# them reversed: it refuses the file instead). Versions 1 and 2 are migrated when read.
STATE_VERSION = 3
# Sources whose intents live elsewhere on disk and are therefore not written to the state file.
NOT_PERSISTED = frozenset({"local"})
# Generations travel as uint64 in the gRPC API.
GENERATION_MAX = 2**64 - 1
# The state file is read whole at start. A push that would make it larger is refused, and a file larger
# than this (never written by the agent) is treated as corrupt rather than read into memory.
STATE_MAX_BYTES = 64 << 20


class StoreError(GthulhuError):
    """A request the store refuses; the message is for people."""


class StaleGenerationError(StoreError, Conflict):
    """A push whose generation is older than (or conflicts with) the stored one: nothing changed."""


class IntentNotFoundError(StoreError, NotFound):
    """A delete of an intent (or source) the store does not hold."""


class LimitError(StoreError, LimitExceeded):
    """Too many sources (the per-source intent count is an IntentValidationError on `intents`)."""


class StateTooLargeError(LimitError, ValueError):
    """The state would be (or is) larger than STATE_MAX_BYTES."""


class UnencodableError(IntentValidationError):
    """A set holding text that cannot be written as UTF-8 (a lone surrogate): refused before it replaces
    the stored set, since it could be neither saved nor served."""


@dataclass(frozen=True, slots=True)
class SourceSet:
    """What one source holds now."""

    source: str
    generation: int
    intents: tuple[Intent, ...]
    # digest of the content of the last accepted push (a retry of it is a no-op)
    push_digest: str
    # unix time of the last change
    updated: float
    # the push as its sender wrote it, entry by entry (only senders that need it: the Manager)
    entries: tuple[SenderEntry, ...] = ()


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


def digest(intents: Sequence[Intent], entries: Sequence[SenderEntry] = ()) -> str:
    """Content digest of a set, independent of order (precedence never depends on it, and a sender's
    re-push in another order is the same set). Without sender entries the digest is the one earlier
    versions computed, so their state files stay valid."""
    return _digest_docs(_Docs.of(intents, entries))


def _digest_docs(docs: _Docs) -> str:
    ordered: list[Any] = sorted(docs.intents, key=lambda d: str(d["id"]))
    if docs.entries:
        ordered = [ordered, sorted(json.dumps(e, sort_keys=True) for e in docs.entries)]
    blob = json.dumps(ordered, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class _Docs:
    """The JSON documents of a set's intents and entries, made once per change: the digest, the journal
    record and the snapshot all need them, and making them is most of a large push's cost."""

    intents: list[dict[str, Any]]
    entries: list[dict[str, Any]]

    @classmethod
    def of(cls, intents: Sequence[Intent], entries: Sequence[SenderEntry]) -> _Docs:
        return cls([intent_to_doc(i) for i in intents], [_entry_doc(e) for e in entries])


def _entry_doc(entry: SenderEntry) -> dict[str, Any]:
    return entry.model_dump(by_alias=True, mode="json")


EMPTY_DIGEST = digest(())


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
        self._journal = Journal(state_dir / JOURNAL_FILE, STATE_VERSION) if state_dir is not None else None
        self._snapshot_bytes = 0  # size of the snapshot on disk
        self._digests: dict[str, str] = {}  # source -> digest() of its content, once computed
        # source -> its part of the snapshot (JSON) as last written, until it changes: a compaction
        # serializes only the sources that changed since the last one
        self._source_json: dict[str, bytes] = {}

    @property
    def max_intents_per_source(self) -> int:
        return self._max_intents

    @property
    def state_dir(self) -> Path | None:
        return self._state_dir

    @property
    def state_file(self) -> Path | None:
        return self._state_dir / STATE_FILE if self._state_dir is not None else None

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
        docs = _Docs.of(intents, entries)
        try:
            new_digest = _digest_docs(docs)
        except UnicodeEncodeError:
            self._count("refused_invalid")
            try:
                _refuse_unencodable(source, {"intents": docs.intents, "entries": docs.entries})
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

    def _commit(self, source: str, new: SourceSet, docs: _Docs | None = None, content: str = "") -> None:
        """Encode `new` for the disk, swap it in and persist (lock held by the caller). Encoding comes
        first: a set that cannot be encoded (a lone surrogate, too large) is refused before it touches
        memory; a write error puts the old set back, so memory and disk always hold the same set.
        `docs`, `content`: new's documents and digest when the caller has them."""
        old = self._sources.get(source)
        try:
            write = self._encode(source, old, new, docs)
        except UnencodableError as exc:
            self._stats.refused_invalid += 1
            log.warning("intents_refused_unencodable", source=source, error=str(exc))
            raise
        except StateTooLargeError as exc:
            self._stats.persist_errors += 1
            log.error("intents_persist_failed", source=source, error=str(exc))
            raise
        old_json = self._source_json.pop(source, None)
        self._sources[source] = new
        self._digests.pop(source, None)
        if content:
            self._digests[source] = content
        try:
            write()
        except OSError as exc:
            self._digests.pop(source, None)
            if old_json is not None:
                self._source_json[source] = old_json
            if old is None:
                del self._sources[source]
            else:
                self._sources[source] = old
            self._stats.persist_errors += 1
            log.error("intents_persist_failed", source=source, error=str(exc))
            raise

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

    # -- persistence ---------------------------------------------------------------------------------

    def _encode(
        self, source: str, old: SourceSet | None, new: SourceSet, docs: _Docs | None
    ) -> Callable[[], None]:
        """The bytes that record `new` on disk, made before anything changes: a journal record, or a
        snapshot when the journal has grown past it (or there is no snapshot of this version yet: the first
        change after a start on an older one). Returns what writes them. Raises UnencodableError or
        StateTooLargeError (nothing written, nothing changed)."""
        journal = self._journal
        if journal is None or source in NOT_PERSISTED:
            return _nothing
        known = {source: docs} if docs is not None else {}
        if not journal.journal_id:  # no snapshot of this version yet (a first start, or an older file)
            return self._encode_snapshot(source, new, known)
        record = _change_record(source, old, new, docs)
        try:
            line = encode_line(record)
        except UnicodeEncodeError:
            full = docs or _Docs.of(new.intents, new.entries)  # named as the set has it, not the diff
            _refuse_unencodable(source, {"intents": full.intents, "entries": full.entries})
        grown = journal.size + len(line)
        if (
            grown > max(COMPACT_MIN_BYTES, self._snapshot_bytes)
            or self._snapshot_bytes + grown > STATE_MAX_BYTES  # an upper bound of the state's size
        ):
            return self._encode_snapshot(source, new, known)

        def append() -> None:
            journal.append(line)
            self._stats.persist_writes += 1

        return append

    def _encode_snapshot(self, source: str, new: SourceSet, known: Mapping[str, _Docs]) -> Callable[[], None]:
        """The whole state with `new` as `source`'s set, as a new snapshot (which starts a new journal).
        `known`: documents of sources the caller has made already."""
        target = self.state_file
        journal = self._journal
        assert target is not None and journal is not None
        journal_id = new_journal_id()
        parts: dict[str, bytes] = {}
        for name, ss in sorted({**self._sources, source: new}.items()):
            if name in NOT_PERSISTED:
                continue
            part = self._source_json.get(name) if name != source else None
            if part is None:
                doc = _source_doc(ss, known.get(name) or _Docs.of(ss.intents, ss.entries))
                try:
                    part = _dumps(doc)
                except UnicodeEncodeError:
                    _refuse_unencodable(name, doc)
            parts[name] = part
        head = _dumps({"format": STATE_FORMAT, "version": STATE_VERSION, "journal": journal_id})
        body = b",".join(_dumps(name) + b":" + part for name, part in parts.items())
        data = head[:-1] + b',"sources":{' + body + b"}}\n"
        if len(data) > STATE_MAX_BYTES:
            raise StateTooLargeError(
                f"the intents of all sources would take {len(data)} bytes of state, at most {STATE_MAX_BYTES}"
            )

        def save() -> None:
            atomic_write(target, data)
            self._source_json = parts
            self._snapshot_bytes = len(data)
            journal.reset(journal_id)
            self._stats.persist_writes += 1

        return save

    def load(self) -> int:
        """Load the last accepted intents (call once, before any traffic). Returns how many were loaded.

        A state file that cannot be parsed or validated is moved aside (`intents.json.corrupt-<time>`) and
        the store starts empty; the reason is logged. Missing file: empty store.
        """
        target = self.state_file
        if target is None:
            return 0
        remove_stale_temps(target)
        # An OSError other than ENOENT (EMFILE, EIO, EACCES) propagates: the file may be fine, so it stays
        # where it is and the start fails (systemd retries) rather than starting with no intents.
        assert self._journal is not None
        try:
            blob = _read_state(target)
            sources, journal_id, valid = _parse_state(blob, self._journal.path)
        except FileNotFoundError:
            return 0
        except NewerStateError as exc:
            log.error("intents_state_newer", path=str(target), error=str(exc))
            raise
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            for path in (target, self._journal.path):
                aside = path.with_name(f"{path.name}.corrupt-{stamp}")
                try:
                    os.replace(path, aside)
                except FileNotFoundError:
                    continue
                except OSError as mv_exc:
                    log.error("intents_state_move_failed", path=str(path), error=str(mv_exc))
                log.error("intents_state_corrupt", path=str(path), moved_to=str(aside), error=str(exc))
            with self._lock:
                self._stats.corrupt_state_files += 1
            return 0
        self._snapshot_bytes = len(blob)
        self._journal.adopt(journal_id, valid)
        count = sum(len(ss.intents) for ss in sources.values())
        with self._lock:
            self._sources.update(sources)
            self._stats.loaded_intents = count
        log.info("intents_loaded", path=str(target), sources=len(sources), intents=count)
        for source in sources:
            self._notify(source)
        return count


class NewerStateError(Conflict):
    """The state file was written by a newer agent (a downgrade). Not corrupt: it stays where it is and
    the start fails with this message, so going back to the newer release finds the intents again."""


def _read_state(target: Path) -> bytes:
    """The state file's bytes. Raises StateTooLargeError (a ValueError: the file is treated as corrupt)
    past STATE_MAX_BYTES, which the store never writes."""
    with open(target, "rb") as f:
        blob = f.read(STATE_MAX_BYTES + 1)
    if len(blob) > STATE_MAX_BYTES:
        raise StateTooLargeError(f"larger than {STATE_MAX_BYTES} bytes, which this agent never writes")
    return blob


def _check_version(version: object, what: str) -> None:
    if isinstance(version, int) and not isinstance(version, bool) and version > STATE_VERSION:
        raise NewerStateError(f"{what} version {version} was written by a newer gthulhu-node (this one reads "
                              f"up to {STATE_VERSION}); start the newer release, or move the file aside")
    if version not in READABLE_VERSIONS:
        raise ValueError(f"unsupported {what} version {version!r}")


# Version 1: release 0.1.0's snapshot, no journal. Version 2: with a journal.
READABLE_VERSIONS = (1, 2, STATE_VERSION)
JOURNALED_VERSIONS = (2, STATE_VERSION)
# Versions whose priorities run the old way (20 the strongest): migrated when read.
OLD_SCALE_VERSIONS = (1, 2)


def migrate_old_scale(sources: Mapping[str, Any]) -> dict[str, Any]:
    """The source documents of a state written before issue 39, with the priorities of every source but
    the Manager's (SENDER_SOURCES: its numbers are the ones it pushed, hashed into its merkle root) moved
    to today's scale by `limits.migrate_pre_issue39`. A migrated source's push digest is recomputed from
    the migrated intents (it names what is stored). Unknown shapes are left for validation to refuse."""
    out: dict[str, Any] = {}
    for name, entry in sources.items():
        if (name in SENDER_SOURCES or not isinstance(entry, Mapping)
                or not isinstance(entry.get("intents"), list)):
            out[name] = entry
            continue
        intents = [
            {**doc, "priority": migrate_pre_issue39(doc["priority"])}
            if isinstance(doc, Mapping) and type(doc.get("priority")) is int else doc
            for doc in entry["intents"]
        ]
        out[name] = {k: v for k, v in entry.items() if k != "pushDigest"} | {"intents": intents}
    return out


def _parse_state(blob: bytes, journal_path: Path) -> tuple[dict[str, SourceSet], str, int]:
    """Parse and validate a snapshot and the valid prefix of its journal: (sources, the snapshot's
    journal id, valid journal bytes). ValueError says what is wrong."""
    doc = load_json(blob, STATE_LIMITS)
    if not isinstance(doc, Mapping) or doc.get("format") != STATE_FORMAT:
        raise ValueError("not a gthulhu-node intents state file")
    version = doc.get("version")
    _check_version(version, "state")
    raw_sources = doc.get("sources")
    if not isinstance(raw_sources, Mapping):
        raise ValueError("sources: expected an object")
    journal_id = doc.get("journal", "") if version in JOURNALED_VERSIONS else ""
    if not isinstance(journal_id, str):
        raise ValueError("journal: expected a string")
    valid = 0
    sources: dict[str, Any] = dict(raw_sources)
    if journal_id:
        # the snapshot's version decides the scale: a v2 snapshot usually has no journal (every snapshot
        # write removes it), and then read_journal has no version to give
        records, valid, journal_version = read_journal(journal_path, journal_id,
                                                       STATE_MAX_BYTES + COMPACT_MIN_BYTES)
        if journal_version is not None:
            _check_version(journal_version, "journal")
        for n, record in enumerate(records):
            try:
                _replay(sources, record)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise ValueError(f"{JOURNAL_FILE} record {n + 1}: {exc!r}") from None
    if version in OLD_SCALE_VERSIONS:
        parsed = _parse_sources(migrate_old_scale(sources))
        log.warning("intents_priorities_migrated", from_version=version,
                    sources=sorted(n for n in parsed if n not in SENDER_SOURCES),
                    rule="new = 9 - ((old - 1) * 9) // 20 (old 20 -> 1, old 1 -> 9, 0 stays 0)")
        # no snapshot of this version yet: the first change writes one (and drops the old journal)
        return parsed, "", 0
    return _parse_sources(sources), journal_id, valid


def _dumps(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()


def _nothing() -> None:
    pass


def _refuse_unencodable(source: str, doc: Any) -> NoReturn:
    """Raise UnencodableError naming the first field of `doc` whose text is not valid Unicode (UTF-8
    cannot hold a lone surrogate such as "\\ud800", which JSON's escapes can carry and a str can hold)."""
    where = unencodable_path(doc) or "?"
    raise UnencodableError(f"sources.{source}.{where}".rstrip("."),
                           "not valid Unicode text (a lone surrogate such as \\ud800): not stored")


def _source_doc(ss: SourceSet, docs: _Docs) -> dict[str, Any]:
    """A source's part of the snapshot."""
    return {
        "generation": ss.generation,
        "pushDigest": ss.push_digest,
        "updated": ss.updated,
        "intents": docs.intents,
        **({"entries": docs.entries} if docs.entries else {}),
    }


def _change_record(source: str, old: SourceSet | None, new: SourceSet, docs: _Docs | None) -> dict[str, Any]:
    """A journal record: `source`'s new generation and digests, and how its intents and entries changed."""
    record: dict[str, Any] = {"source": source, "generation": new.generation, "pushDigest": new.push_digest,
                              "updated": new.updated}

    def intent_doc(n: int) -> Any:
        return docs.intents[n] if docs is not None else intent_to_doc(new.intents[n])

    def entry_doc(n: int) -> Any:
        return docs.entries[n] if docs is not None else _entry_doc(new.entries[n])

    intents = diff_items(old.intents if old else (), new.intents, lambda i: i.id, intent_doc)
    entries = diff_items(old.entries if old else (), new.entries, lambda e: e.key, entry_doc)
    if intents is not None:
        record["intents"] = intents
    if entries is not None:
        record["entries"] = entries
    return record


def _replay(sources: dict[str, Any], record: Mapping[str, Any]) -> None:
    """Apply one journal record to the snapshot's source documents."""
    name = record["source"]
    if not isinstance(name, str):
        raise ValueError("source: expected a string")
    current = dict(sources.get(name) or {"intents": []})
    for field_name in ("generation", "pushDigest", "updated"):
        current[field_name] = record[field_name]
    if "intents" in record:
        current["intents"] = apply_diff(list(current.get("intents", [])), record["intents"], "id")
    if "entries" in record:
        entries = apply_diff(list(current.get("entries", [])), record["entries"], "key")
        if entries:
            current["entries"] = entries
        else:
            current.pop("entries", None)
    sources[name] = current


def _parse_sources(raw_sources: Mapping[str, Any]) -> dict[str, SourceSet]:
    out: dict[str, SourceSet] = {}
    for name, entry in raw_sources.items():
        check_source(name, allow_reserved=True)
        if not isinstance(entry, Mapping):
            raise ValueError(f"sources.{name}: expected an object")
        gen = entry.get("generation")
        if isinstance(gen, bool) or not isinstance(gen, int) or not 0 <= gen <= GENERATION_MAX:
            raise ValueError(f"sources.{name}.generation: expected an integer 0-{GENERATION_MAX}")
        raw_intents = entry.get("intents")
        if not isinstance(raw_intents, list):
            raise ValueError(f"sources.{name}.intents: expected a list")
        limit = None if name in SENDER_SOURCES else PATTERN_MAX_BYTES  # as when they were pushed
        intents = [parse_intent(d, f"sources.{name}.intents[{i}]", pattern_max_bytes=limit)
                   for i, d in enumerate(raw_intents)]
        check_set(intents, max_count=len(intents) or 1, where=f"sources.{name}.intents")
        raw_entries = entry.get("entries", [])
        if not isinstance(raw_entries, list):
            raise ValueError(f"sources.{name}.entries: expected a list")
        try:
            entries = tuple(SenderEntry.model_validate(e) for e in raw_entries)
        except ValidationError as exc:
            raise ValueError(f"sources.{name}.entries: {exc.errors(include_url=False)[0]['msg']}") from None
        push = entry.get("pushDigest")
        updated = entry.get("updated", 0.0)
        out[name] = SourceSet(
            name,
            gen,
            tuple(intents),
            push if isinstance(push, str) else digest(intents, entries),
            float(updated) if isinstance(updated, int | float) else 0.0,
            entries,
        )
    return out


def _temp_prefix(target: Path, pid: int | None = None) -> str:
    """Name of atomic_write's temp files for target: `.<name>.tmp-<pid>-<thread>`."""
    return f".{target.name}.tmp-" + ("" if pid is None else f"{pid}-")


def remove_stale_temps(target: Path) -> None:
    """Delete temp files of `target` that an earlier process left behind (killed between writing and
    renaming): each holds a state that was never acknowledged."""
    own = _temp_prefix(target, os.getpid())
    with contextlib.suppress(FileNotFoundError):
        for stray in target.parent.glob(_temp_prefix(target) + "*"):
            if stray.name.startswith(own):
                continue  # this process's own write in progress
            with contextlib.suppress(FileNotFoundError):
                stray.unlink()
                log.warning("intents_state_stale_temp_removed", path=str(stray))


def atomic_write(target: Path, data: bytes, mode: int = 0o600) -> None:
    """Write `data` to `target` so that a crash leaves the old or the new content, never a mix."""
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = target.with_name(f"{_temp_prefix(target, os.getpid())}{threading.get_ident()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
