"""The intent store's journal: each change is one appended, checksummed, fsync'd record, folded into the
state file (the snapshot) now and then, so a change costs what it changed on disk, not every intent.

Why: rewriting the whole state file on every change made a one-intent apply after a 10,000-intent push
write (and fsync) 30 MB and take seconds. Here a change appends one record: the difference between a
source's old and new set (intents and sender entries put, dropped, and their order only when it moved).

Files, beside `intents.json` (the snapshot, written atomically as before):
- `intents.journal`: a header line naming the snapshot it continues (`journal` in the snapshot: a random
  id made at each compaction), then one line per change. Every line is `<crc32 hex> <json>\\n`.

Crash consistency (kill -9 at any moment leaves the old or the new set, never a mix):
- a change is one line, fsync'd before the request is answered; reading replays the valid prefix, so a
  torn last line (no newline, wrong checksum) is a change that was never acknowledged: the old set;
- the next append first cuts such a tail off, so later records never follow garbage;
- compaction writes a new snapshot with a new id (temp file + rename), then removes the journal; a
  journal left behind by a crash between the two names the old id and is ignored (the snapshot holds it).

Both files carry the format version; reading a newer one is refused (NewerStateError in store.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import zlib
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from gthulhu_node.intents.documents import STATE_LIMITS, DocumentError, load_json

JOURNAL_FILE = "intents.journal"
JOURNAL_FORMAT = "gthulhu-node-intents-journal"
# A journal smaller than this is never compacted, whatever the snapshot's size.
COMPACT_MIN_BYTES = 1 << 20

T = TypeVar("T")


def new_journal_id() -> str:
    return secrets.token_hex(8)


def encode_line(doc: Mapping[str, Any]) -> bytes:
    """One journal line: checksum, space, compact JSON, newline."""
    body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
    return b"%08x %s\n" % (zlib.crc32(body), body)


def decode_lines(blob: bytes) -> Iterator[tuple[int, dict[str, Any]]]:
    """(end offset, document) of each valid line, stopping at the first that is torn or damaged."""
    offset = 0
    while offset < len(blob):
        end = blob.find(b"\n", offset)
        if end < 0:
            return
        line = blob[offset:end]
        if len(line) < 10 or line[8:9] != b" ":
            return
        try:
            crc = int(line[:8], 16)
        except ValueError:
            return
        body = line[9:]
        if zlib.crc32(body) != crc:
            return
        try:
            doc = load_json(body, STATE_LIMITS)
        except DocumentError:
            return
        if not isinstance(doc, dict):
            return
        offset = end + 1
        yield offset, doc


def diff_items(
    old: Sequence[T], new: Sequence[T], key: Callable[[T], Hashable], doc_of: Callable[[int], Any]
) -> dict[str, Any] | None:
    """How `new` differs from `old`: {"put": [docs], "drop": [keys], "order": [keys] (only when it is not
    old's order with the put ones appended)} or {"all": [docs]} when keys repeat; None when equal.
    `doc_of(n)`: the document of new[n]."""
    old_keys = [key(x) for x in old]
    new_keys = [key(x) for x in new]
    if len(set(old_keys)) != len(old_keys) or len(set(new_keys)) != len(new_keys):
        return None if list(old) == list(new) else {"all": [doc_of(n) for n in range(len(new))]}
    before = dict(zip(old_keys, old, strict=True))
    wanted = set(new_keys)
    put = [n for n, (k, x) in enumerate(zip(new_keys, new, strict=True)) if k not in before or before[k] != x]
    drop = [k for k in old_keys if k not in wanted]
    natural = [k for k in old_keys if k in wanted] + [k for k in new_keys if k not in before]
    if not put and not drop and natural == new_keys:
        return None
    out: dict[str, Any] = {"put": [doc_of(n) for n in put], "drop": drop}
    if natural != new_keys:
        out["order"] = new_keys
    return out


def apply_diff(docs: list[Any], change: Mapping[str, Any], key: str) -> list[Any]:
    """`docs` (JSON documents keyed by their field `key`) after a diff made by diff_items."""
    if "all" in change:
        return list(change["all"])
    by_key = {d[key]: d for d in docs}
    for k in change.get("drop", ()):
        by_key.pop(k, None)
    for d in change.get("put", ()):
        by_key[d[key]] = d  # a new key goes last, an existing one keeps its place
    if "order" in change:
        return [by_key[k] for k in change["order"]]
    return list(by_key.values())


class Journal:
    """The append side of `intents.journal`; the store holds its lock around every call."""

    def __init__(self, path: Path, version: int) -> None:
        self.path = path
        self.version = version
        self.journal_id = ""  # the snapshot's id; "" until a snapshot of this format exists
        self.size = 0  # bytes of valid records (and header) on disk; the tail past it is cut off
        self._exists = False

    def reset(self, journal_id: str) -> None:
        """After a compaction: the snapshot `journal_id` holds everything; drop the old journal."""
        self.journal_id = journal_id
        self.size = 0
        self._exists = False
        # The snapshot is durable already: a journal that stays (an error here) names the old id and is
        # ignored by reading, and the next append truncates it.
        with contextlib.suppress(OSError):
            os.unlink(self.path)
            fsync_dir(self.path.parent)

    def adopt(self, journal_id: str, valid_bytes: int) -> None:
        """At load: the journal on disk continues snapshot `journal_id` up to `valid_bytes` (0: it does not
        belong to it, and the next append starts it afresh)."""
        self.journal_id = journal_id
        self.size = valid_bytes
        self._exists = valid_bytes > 0

    def append(self, line: bytes) -> None:
        """Write one record (an encode_line) durably. On an error nothing is acknowledged, and whatever
        part of it reached the disk is cut off by the next append."""
        fresh = not self._exists
        if fresh:
            line = encode_line({"format": JOURNAL_FORMAT, "version": self.version,
                                "journal": self.journal_id}) + line
        flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_TRUNC if fresh else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if not fresh and os.fstat(fd).st_size != self.size:
                os.ftruncate(fd, self.size)  # a torn record of a killed writer, never acknowledged
            view = memoryview(line)
            offset = 0 if fresh else self.size
            try:
                while view:
                    written = os.pwrite(fd, view, offset)
                    view = view[written:]
                    offset += written
                os.fdatasync(fd)
            except OSError:
                # Not acknowledged, so not to be found by a restart either: the store keeps the old set.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0 if fresh else self.size)
                raise
        finally:
            os.close(fd)
        if fresh:
            fsync_dir(self.path.parent)
            self._exists = True
            self.size = len(line)
        else:
            self.size += len(line)


def read_journal(path: Path, journal_id: str, limit: int) -> tuple[list[dict[str, Any]], int, int | None]:
    """The records of `path` that continue snapshot `journal_id`: (records, valid bytes, newer version or
    None). A journal of another snapshot, or none, gives ([], 0, None)."""
    try:
        with open(path, "rb") as f:
            blob = f.read(limit)
    except FileNotFoundError:
        return [], 0, None
    lines = decode_lines(blob)
    first = next(lines, None)
    if first is None:
        return [], 0, None
    end, header = first
    version = header.get("version")
    if header.get("format") != JOURNAL_FORMAT or not isinstance(version, int):
        return [], 0, None
    if header.get("journal") != journal_id:
        return [], 0, None
    records: list[dict[str, Any]] = []
    valid = end
    for valid, doc in lines:  # noqa: B007 (the last valid end is the answer)
        records.append(doc)
    return records, valid, version


def fsync_dir(directory: Path) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
