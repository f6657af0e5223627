"""The intent store's state file: what the store holds, on disk, so a restart finds it.

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

`StateFile` is the store's, called under the store's lock: it encodes a change before the store swaps
it in (`encode`, which refuses what cannot be written) and reads the state back at start (`read`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import structlog
from pydantic import ValidationError

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
from gthulhu_node.intents.model import PATTERN_MAX_BYTES, SENDER_SOURCES, SenderEntry, check_source
from gthulhu_node.intents.parse import check_set, intent_to_doc, parse_intent
from gthulhu_node.intents.source_set import GENERATION_MAX, Docs, SourceSet, digest, entry_doc
from gthulhu_node.intents.store_errors import NewerStateError, StateTooLargeError, UnencodableError
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
# The state file is read whole at start. A push that would make it larger is refused, and a file larger
# than this (never written by the agent) is treated as corrupt rather than read into memory.
STATE_MAX_BYTES = 64 << 20
# Version 1: release 0.1.0's snapshot, no journal. Version 2: with a journal.
READABLE_VERSIONS = (1, 2, STATE_VERSION)
JOURNALED_VERSIONS = (2, STATE_VERSION)
# Versions whose priorities run the old way (20 the strongest): migrated when read.
OLD_SCALE_VERSIONS = (1, 2)


class StateFile:
    """The snapshot and its journal under one state directory, and what the last snapshot holds of each
    source (so a compaction serializes only the sources that changed since)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / STATE_FILE
        self.journal = Journal(state_dir / JOURNAL_FILE, STATE_VERSION)
        self._snapshot_bytes = 0  # size of the snapshot on disk
        # source -> its part of the snapshot (JSON) as last written, until it changes: a compaction
        # serializes only the sources that changed since the last one
        self._source_json: dict[str, bytes] = {}

    def encode(
        self, sources: Mapping[str, SourceSet], source: str, old: SourceSet | None, new: SourceSet,
        docs: Docs | None,
    ) -> Callable[[], None] | None:
        """The bytes that record `new` (replacing `old` as `source`'s set among `sources`) on disk, made
        before anything changes: a journal record, or a snapshot when the journal has grown past it (or
        there is no snapshot of this version yet: the first change after a start on an older one). Returns
        what writes them (it raises OSError and then leaves this object as it was), or None for a source
        that is not persisted. Raises UnencodableError or StateTooLargeError (nothing written)."""
        if source in NOT_PERSISTED:
            return None
        write = self._encode(sources, source, old, new, docs)

        def commit() -> None:
            old_json = self._source_json.pop(source, None)
            try:
                write()
            except OSError:
                if old_json is not None:
                    self._source_json[source] = old_json
                raise

        return commit

    def _encode(
        self, sources: Mapping[str, SourceSet], source: str, old: SourceSet | None, new: SourceSet,
        docs: Docs | None,
    ) -> Callable[[], None]:
        journal = self.journal
        known = {source: docs} if docs is not None else {}
        if not journal.journal_id:  # no snapshot of this version yet (a first start, or an older file)
            return self._encode_snapshot(sources, source, new, known)
        record = _change_record(source, old, new, docs)
        try:
            line = encode_line(record)
        except UnicodeEncodeError:
            full = docs or Docs.of(new.intents, new.entries)  # named as the set has it, not the diff
            refuse_unencodable(source, {"intents": full.intents, "entries": full.entries})
        grown = journal.size + len(line)
        if (
            grown > max(COMPACT_MIN_BYTES, self._snapshot_bytes)
            or self._snapshot_bytes + grown > STATE_MAX_BYTES  # an upper bound of the state's size
        ):
            return self._encode_snapshot(sources, source, new, known)
        return lambda: journal.append(line)

    def _encode_snapshot(self, sources: Mapping[str, SourceSet], source: str, new: SourceSet,
                         known: Mapping[str, Docs]) -> Callable[[], None]:
        """The whole state with `new` as `source`'s set, as a new snapshot (which starts a new journal).
        `known`: documents of sources the caller has made already."""
        target = self.path
        journal = self.journal
        journal_id = new_journal_id()
        parts: dict[str, bytes] = {}
        for name, ss in sorted({**sources, source: new}.items()):
            if name in NOT_PERSISTED:
                continue
            part = self._source_json.get(name) if name != source else None
            if part is None:
                doc = _source_doc(ss, known.get(name) or Docs.of(ss.intents, ss.entries))
                try:
                    part = _dumps(doc)
                except UnicodeEncodeError:
                    refuse_unencodable(name, doc)
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

        return save

    def read(self) -> dict[str, SourceSet] | None:
        """The state as the last accepted change left it (call once, before any traffic); None when it
        could not be parsed or validated: then the files are moved aside (`intents.json.corrupt-<time>`)
        and the reason logged. Raises FileNotFoundError when there is no state file, NewerStateError for
        a newer agent's, and any other OSError (EMFILE, EIO, EACCES: the file may be fine, so it stays
        where it is and the start fails, systemd retries, rather than starting with no intents)."""
        target = self.path
        remove_stale_temps(target)
        try:
            blob = _read_state(target)
            sources, journal_id, valid = _parse_state(blob, self.journal.path)
        except NewerStateError as exc:
            log.error("intents_state_newer", path=str(target), error=str(exc))
            raise
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            for path in (target, self.journal.path):
                aside = path.with_name(f"{path.name}.corrupt-{stamp}")
                try:
                    os.replace(path, aside)
                except FileNotFoundError:
                    continue
                except OSError as mv_exc:
                    log.error("intents_state_move_failed", path=str(path), error=str(mv_exc))
                log.error("intents_state_corrupt", path=str(path), moved_to=str(aside), error=str(exc))
            return None
        self._snapshot_bytes = len(blob)
        self.journal.adopt(journal_id, valid)
        return sources


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


def refuse_unencodable(source: str, doc: Any) -> NoReturn:
    """Raise UnencodableError naming the first field of `doc` whose text is not valid Unicode (UTF-8
    cannot hold a lone surrogate such as "\\ud800", which JSON's escapes can carry and a str can hold)."""
    where = unencodable_path(doc) or "?"
    raise UnencodableError(f"sources.{source}.{where}".rstrip("."),
                           "not valid Unicode text (a lone surrogate such as \\ud800): not stored")


def _source_doc(ss: SourceSet, docs: Docs) -> dict[str, Any]:
    """A source's part of the snapshot."""
    return {
        "generation": ss.generation,
        "pushDigest": ss.push_digest,
        "updated": ss.updated,
        "intents": docs.intents,
        **({"entries": docs.entries} if docs.entries else {}),
    }


def _change_record(source: str, old: SourceSet | None, new: SourceSet, docs: Docs | None) -> dict[str, Any]:
    """A journal record: `source`'s new generation and digests, and how its intents and entries changed."""
    record: dict[str, Any] = {"source": source, "generation": new.generation, "pushDigest": new.push_digest,
                              "updated": new.updated}

    def intent_json(n: int) -> Any:
        return docs.intents[n] if docs is not None else intent_to_doc(new.intents[n])

    def entry_json(n: int) -> Any:
        return docs.entries[n] if docs is not None else entry_doc(new.entries[n])

    intents = diff_items(old.intents if old else (), new.intents, lambda i: i.id, intent_json)
    entries = diff_items(old.entries if old else (), new.entries, lambda e: e.key, entry_json)
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
