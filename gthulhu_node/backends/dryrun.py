"""The dry-run backend: records what would be written and changes no scheduling.

It runs on kernels without sched_ext (until another backend exists there) and in every test on this
machine's own kernel. Optionally it mirrors its table to a file so another process can follow it (tools,
and the latency benchmark's independent reader).

Record file format (text, one line per change, appended with one write(2) per batch, O_APPEND):
    R <t>                                           the table is empty from here (start, stop)
    U <t> <tid|tgid> <id> <priority> <slice_ns> <start_time>    upsert
    D <t> <tid|tgid> <id>                           delete
`<t>` is CLOCK_MONOTONIC in ns when the batch was written. Replaying the lines in order gives the table;
`RecordReader` does that incrementally (it remembers its offset and reads only what was appended).
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from gthulhu_node.backends.base import (
    ApplyResult,
    Backend,
    BackendError,
    BackendHealth,
    BackendState,
    Entry,
    EntryKey,
    KeyKind,
    MapFullError,
    check_entry,
)

log = structlog.get_logger(__name__)

# Bounded: a long history of small tuples made every full GC pass slow enough to delay reactions.
HISTORY_MAX = 4096


class DryRunBackend(Backend):
    """Holds the table in memory. `capacity` (None: unbounded) makes it refuse new keys like a full map."""

    name = "dry-run"

    @property
    def capacity(self) -> int | None:
        return self._capacity

    def __init__(self, record: Path | None = None, capacity: int | None = None) -> None:
        self.record_path = record
        self._capacity = capacity
        self.table: dict[EntryKey, Entry] = {}
        # Every change in order, for people and tests: ("U", key, entry) or ("D", key, None).
        self.history: collections.deque[tuple[str, EntryKey, Entry | None]] = collections.deque(
            maxlen=HISTORY_MAX
        )
        self.batches = 0
        self._fd: int | None = None
        self._state = BackendState.STOPPED
        self._reason = ""

    def start(self) -> None:
        self.table.clear()
        if self.record_path is not None and self._fd is None:
            self.record_path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(
                self.record_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o644
            )
        self._write(f"R {time.monotonic_ns()}\n")
        self._state = BackendState.RUNNING
        self._reason = ""
        log.info("backend_started", backend=self.name, record=str(self.record_path or ""))

    def stop(self) -> None:
        self.table.clear()
        self._write(f"R {time.monotonic_ns()}\n")
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._state is not BackendState.EJECTED:
            self._state = BackendState.STOPPED

    def eject(self, reason: str) -> None:
        """Behave like a scheduler the kernel removed: the table is gone and health() says EJECTED.

        Exists so the agent's eject -> reload -> resync path can be exercised without a sched_ext kernel.
        """
        self.table.clear()
        self._write(f"R {time.monotonic_ns()}\n")
        self._state = BackendState.EJECTED
        self._reason = reason

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        if self._state is not BackendState.RUNNING:
            raise BackendError(f"dry-run backend is {self._state.value}")
        for key, entry in upserts.items():
            check_entry(key, entry)
        result = ApplyResult()
        lines: list[str] = []
        now = time.monotonic_ns()
        table = self.table
        for key in deletes:
            if table.pop(key, None) is not None:
                result.deleted += 1
                lines.append(f"D {now} {key.kind.value} {key.id}\n")
                self.history.append(("D", key, None))
        for key, entry in upserts.items():
            if key not in table and self.capacity is not None and len(table) >= self.capacity:
                result.failed[key] = MapFullError(f"{key}: table full ({self.capacity} entries)")
                continue
            table[key] = entry
            result.upserted += 1
            lines.append(
                f"U {now} {key.kind.value} {key.id} {entry.priority} {entry.slice_ns} {entry.start_time}\n"
            )
            self.history.append(("U", key, entry))
        self.batches += 1
        if lines:
            self._write("".join(lines))
        return result

    def read_back(self) -> dict[EntryKey, Entry]:
        return dict(self.table)

    def read_keys(self, keys: Iterable[EntryKey]) -> dict[EntryKey, Entry]:
        return {k: self.table[k] for k in keys if k in self.table}

    def health(self) -> BackendHealth:
        return BackendHealth(self._state, self._reason)

    def counters(self) -> dict[str, int]:
        return {"batches": self.batches}

    def gauges(self) -> dict[str, int]:
        return {"entries": len(self.table)}

    def _write(self, text: str) -> None:
        if self._fd is None:
            return
        data = text.encode()
        while data:
            n = os.write(self._fd, data)
            data = data[n:]


@dataclass(frozen=True, slots=True)
class RecordChange:
    op: str  # "U", "D" or "R"
    time_ns: int
    key: EntryKey | None
    entry: Entry | None


class RecordReader:
    """Follows a dry-run record file from another process: `poll()` returns the changes appended since."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.table: dict[EntryKey, Entry] = {}
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[RecordChange]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return []
        try:
            if os.fstat(fd).st_size < self._offset:  # truncated by a restart
                self._offset, self._partial = 0, b""
                self.table.clear()
            chunks = []
            while True:
                data = os.pread(fd, 1 << 20, self._offset)
                if not data:
                    break
                self._offset += len(data)
                chunks.append(data)
        finally:
            os.close(fd)
        if not chunks:
            return []
        buf = self._partial + b"".join(chunks)
        lines = buf.split(b"\n")
        self._partial = lines.pop()
        changes = [parse_record_line(line.decode()) for line in lines if line]
        for ch in changes:
            if ch.op == "R":
                self.table.clear()
            elif ch.op == "U" and ch.key is not None and ch.entry is not None:
                self.table[ch.key] = ch.entry
            elif ch.op == "D" and ch.key is not None:
                self.table.pop(ch.key, None)
        return changes


def parse_record_line(line: str) -> RecordChange:
    parts = line.split()
    op, t = parts[0], int(parts[1])
    if op == "R":
        return RecordChange(op, t, None, None)
    key = EntryKey(KeyKind(parts[2]), int(parts[3]))
    if op == "D":
        return RecordChange(op, t, key, None)
    return RecordChange(op, t, key, Entry(int(parts[4]), int(parts[5]), int(parts[6])))
