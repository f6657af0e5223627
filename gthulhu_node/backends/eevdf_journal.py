"""The EEVDF backend's journal: which threads the agent changed, written ahead of each change.

Nice values and slice requests outlive the agent (a sched_ext scheduler dies with it), so a successor
must be able to undo what a killed agent wrote. The journal is appended to, one line per change, and
compacted now and then; rewriting the whole set on every apply cost about 0.55 ms per change, more than
the rest of the reaction (docs/eevdf.md, "The journal").

Format (text, one record per line, each appended with one write(2) to an O_APPEND descriptor):
    H <boot_id> <base_slice_ns>                  first line (written only by compaction, atomically)
    + <tid> <tgid> <start_time> <original> <applied>    the thread is ours, or about to be
    - <tid>                                      the thread is no longer ours (restored, exited, foreign)
where <original> and <applied> are each `<policy> <nice> <runtime_ns> <reset_on_fork 0|1>`, and the
last `+` for a tid wins. Crash consistency (kill -9 at any moment):
- a `+` goes out before sched_setattr, with the attributes the kernel will report back, so no write of
  ours is ever unjournaled; a `-` goes out after the restore, so a thread is never forgotten while it
  still shows our write. A crash between the two leaves a thread that already shows its original: the
  successor finds it not showing our write and leaves it alone, which is what it should get.
- a kill mid-write leaves at most one torn last line (no newline), which the reader drops: it was the
  `+` of a write that never happened, or the `-` of a thread already restored.
- compaction writes the live set to a temporary file and renames it over the journal: a crash leaves the
  old journal or the new one, both complete.
No fsync: a power loss also changes the boot id, and a journal from another boot is ignored anyway.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import structlog

from gthulhu_node.backends.sched_attr import SchedAttr

log = structlog.get_logger(__name__)

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# Compaction when the file holds this many lines more than the live set needs (and at least this many).
COMPACT_SLACK = 4096


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """One thread a (possibly dead) agent changed: who it is, what it had, what was written."""

    tid: int
    tgid: int
    start_time: int
    original: SchedAttr
    applied: SchedAttr
    # What we wrote to the thread before `applied` (its entry changed): a kill between the `+` of a new
    # write and the write itself leaves the thread showing one of these, still ours to restore.
    earlier: tuple[SchedAttr, ...] = ()

    def ours(self, current: SchedAttr) -> bool:
        """Whether the thread shows a write of ours (else someone changed it, or it was restored)."""
        return any(current.same_settings(a) for a in (self.applied, *self.earlier))


class ThreadJournal:
    """The append-only journal of one agent (see the module docstring). Not thread-safe."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = -1
        self._live: dict[int, str] = {}  # tid -> its `+` line, what compaction writes
        self._lines = 0
        self._header = ""
        self.write_failures = 0

    def leftovers(self) -> list[JournalRecord]:
        """What a predecessor left changed (this boot's threads only). The caller restores them, then
        calls begin(), which empties the journal: in this order, a crash meanwhile loses nothing."""
        return read_journal(self.path)

    def begin(self, base_slice_ns: int) -> None:
        """Start this agent's journal with nothing in it."""
        self._header = f"H {boot_id() or '-'} {base_slice_ns}\n"
        self._live.clear()
        self.compact()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def changing(self, record: JournalRecord) -> None:
        """Before a write to the thread: `record.applied` is what the kernel will report afterwards."""
        line = (
            f"+ {record.tid} {record.tgid} {record.start_time} {_fmt(record.original)} "
            f"{_fmt(record.applied)}\n"
        )
        before = self._live.get(record.tid)
        self._live[record.tid] = line
        self._append(line, keep=before or "")

    def released(self, tid: int) -> None:
        """After the thread was given back (or found gone or changed by someone else)."""
        if self._live.pop(tid, None) is not None:
            self._append(f"- {tid}\n")

    def compact(self, keep: str = "") -> None:
        """Replace the file by the live set, atomically, and append to the new file from now on.

        `keep`: a thread's `+` line being replaced right now, written before the live set (see
        JournalRecord.earlier)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC, 0o600)
            try:
                _write_all(fd, (self._header + keep + "".join(self._live.values())).encode())
                os.replace(tmp, self.path)
            except BaseException:
                os.close(fd)
                raise
        except OSError as exc:
            self.write_failures += 1
            log.warning("eevdf_journal_write_failed", path=str(self.path), error=exc.strerror)
            return
        self.close()
        self._fd = fd
        self._lines = 1 + len(self._live)

    def _append(self, line: str, keep: str = "") -> None:
        if self._fd < 0 or self._lines > 2 * len(self._live) + COMPACT_SLACK:
            # Too long, or an earlier write failed: the live set already holds this change.
            self.compact(keep)
            return
        try:
            _write_all(self._fd, line.encode())
            self._lines += 1
        except OSError as exc:
            self.write_failures += 1
            log.warning("eevdf_journal_write_failed", path=str(self.path), error=exc.strerror)
            self.close()


def read_journal(path: Path) -> list[JournalRecord]:
    """The threads a journal names as changed, if it is from this boot; [] when absent or unreadable.

    A journal in the JSON format of earlier versions (one object with every thread) is read too, so a
    crash just before an upgrade is still undone.
    """
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("eevdf_journal_unreadable", path=str(path), error=exc.strerror)
        return []
    if data.startswith(b"{"):
        return _read_json(path, data)
    lines = data.split(b"\n")
    lines.pop()  # after the last newline: empty, or a record torn by a kill mid-write
    live: dict[int, JournalRecord] = {}
    bad = 0
    for i, raw in enumerate(lines):
        parts = raw.decode("ascii", "replace").split()
        try:
            if i == 0:
                if parts[0] != "H":
                    raise ValueError("no header")
                if parts[1] != (boot_id() or "-"):
                    return []  # another boot's tids and start times name other tasks
            elif parts[0] == "+":
                tid, tgid, start = int(parts[1]), int(parts[2]), int(parts[3])
                original, applied = _parse(parts[4:8]), _parse(parts[8:12])
                prev = live.get(tid)
                earlier = (*prev.earlier, prev.applied) if prev and prev.start_time == start else ()
                live[tid] = JournalRecord(tid, tgid, start, original, applied, earlier)
            elif parts[0] == "-":
                live.pop(int(parts[1]), None)
            else:
                raise ValueError(f"unknown record {parts[0]!r}")
        except (ValueError, IndexError):
            if i == 0:
                log.warning("eevdf_journal_unreadable", path=str(path), error="no header line")
                return []
            bad += 1
    if bad:
        log.warning("eevdf_journal_lines_skipped", path=str(path), lines=bad)
    return list(live.values())


def boot_id() -> str:
    try:
        return BOOT_ID.read_text().strip()
    except OSError:
        return ""


def _read_json(path: Path, data: bytes) -> list[JournalRecord]:
    try:
        doc = json.loads(data)
        if doc.get("boot_id") != boot_id():
            return []
        return [
            JournalRecord(
                int(r["tid"]),
                int(r["tgid"]),
                int(r["start_time"]),
                _attr_from_json(r["original"]),
                _attr_from_json(r["applied"]),
            )
            for r in doc["threads"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        log.warning("eevdf_journal_unreadable", path=str(path), error=str(exc))
        return []


def _attr_from_json(data: dict[str, int | bool]) -> SchedAttr:
    return SchedAttr(
        int(data["policy"]), int(data["nice"]), int(data["runtime_ns"]), bool(data["reset_on_fork"])
    )


def _fmt(attr: SchedAttr) -> str:
    return f"{attr.policy} {attr.nice} {attr.runtime_ns} {int(attr.reset_on_fork)}"


def _parse(fields: list[str]) -> SchedAttr:
    if len(fields) != 4:
        raise ValueError("short record")
    return SchedAttr(int(fields[0]), int(fields[1]), int(fields[2]), fields[3] == "1")


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]
