"""/proc stat parsing, proc connector datagram parsing, the dry-run record and backend selection."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from gthulhu_node.backends import sched_attr
from gthulhu_node.backends.base import BackendUnavailable, Entry, EntryKey, InvalidEntryError, KeyKind
from gthulhu_node.backends.dryrun import DryRunBackend, RecordReader
from gthulhu_node.backends.select import select_backend
from gthulhu_node.config import AgentConfig
from gthulhu_node.tasks.events import EventKind, parse_datagram
from gthulhu_node.tasks.procfs import parse_stat, snapshot
from tests.unit.fakeproc import FakeProc


@pytest.mark.parametrize("comm", ["EngineCore_DP0", "a b", "x) (y", "((", ")", "", "python3.12"])
def test_stat_comm_with_spaces_and_parentheses(comm: str) -> None:
    line = FakeProc(Path("/nonexistent")).stat_line(42, comm, 123456).encode()
    assert parse_stat(line) == (comm, 123456)


def test_snapshot_reads_threads_and_start_times(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path)
    proc.add(10, 10, "python3.12", 7)
    proc.add(10, 11, "Engine Core (1)", 8)
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    snap = snapshot(tmp_path)
    assert snap.complete and snap.errors == 0
    assert {t: (x.tgid, x.comm, x.start_time) for t, x in snap.tasks.items()} == {
        10: (10, "python3.12", 7),
        11: (10, "Engine Core (1)", 8),
    }


def _msg(what: int, payload: bytes, ts: int = 5) -> bytes:
    body = (
        struct.pack("=IIIIHH", 1, 1, 0, 0, 16 + len(payload), 0) + struct.pack("=IIQ", what, 0, ts) + payload
    )
    return struct.pack("=IHHII", 16 + len(body), 3, 0, 0, 0) + body


def test_parse_datagram_every_kind() -> None:
    data = (
        _msg(0x1, struct.pack("=IIII", 1, 1, 501, 500))
        + _msg(0x200, struct.pack("=II", 501, 500) + b"EngineCore_DP0\0\0")
        + _msg(0x4, struct.pack("=IIII", 501, 500, 65534, 65534))  # uid change
        + _msg(0x40, struct.pack("=IIII", 501, 500, 0, 0))  # gid change: skipped
        + _msg(0x2, struct.pack("=II", 500, 500))
        + _msg(0x80000000, struct.pack("=IIIIII", 501, 500, 0, 17, 1, 1), ts=9)
    )
    out: list = []
    parse_datagram(data, len(data), out)
    assert [(e.kind, e.tid, e.tgid, e.comm) for e in out] == [
        (EventKind.FORK, 501, 500, None),
        (EventKind.COMM, 501, 500, "EngineCore_DP0"),
        (EventKind.UID, 501, 500, None),
        (EventKind.EXEC, 500, 500, None),
        (EventKind.EXIT, 501, 500, None),
    ]
    assert out[-1].timestamp_ns == 9


def test_parse_datagram_ignores_truncated_messages() -> None:
    data = _msg(0x200, struct.pack("=II", 7, 7) + b"abc\0" + b"\0" * 12)
    out: list = []
    parse_datagram(data, len(data) - 30, out)
    assert out == []


def test_dry_run_record_is_followed_by_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "rec"
    b = DryRunBackend(record=path)
    b.start()
    reader = RecordReader(path)
    reader.poll()
    k1, k2 = EntryKey(KeyKind.TID, 5), EntryKey(KeyKind.TGID, 6)
    b.apply({k1: Entry(3, 0, 9), k2: Entry(1, 60_000, 10)}, [])
    changes = reader.poll()
    assert [c.op for c in changes] == ["U", "U"] and changes[0].time_ns > 0
    assert reader.table == {k1: Entry(3, 0, 9), k2: Entry(1, 60_000, 10)}
    b.apply({}, [k1])
    reader.poll()
    assert reader.table == {k2: Entry(1, 60_000, 10)}
    b.stop()
    reader.poll()
    assert reader.table == {}


def test_dry_run_refuses_out_of_range_entries_before_writing() -> None:
    b = DryRunBackend()
    b.start()
    good, bad = EntryKey(KeyKind.TID, 5), EntryKey(KeyKind.TID, 6)
    with pytest.raises(InvalidEntryError):
        b.apply({good: Entry(3, 0, 1), bad: Entry(21, 0, 1)}, [])
    assert b.table == {}


def test_select_backend(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forced = AgentConfig.model_validate({"backend": {"kind": "dry-run"}})
    backend, reason = select_backend(forced)
    assert isinstance(backend, DryRunBackend) and "forced" in reason
    auto = AgentConfig()
    # a kernel where the EEVDF backend cannot work either (its own selection: tests/host/test_eevdf_select.py)
    monkeypatch.setattr(sched_attr, "probe", lambda: sched_attr.Probe(False, "probe says no"))
    backend, reason = select_backend(auto, sysfs=tmp_path / "missing")
    assert isinstance(backend, DryRunBackend) and "no sched_ext" in reason
    with pytest.raises(BackendUnavailable, match="sched_ext"):
        select_backend(
            AgentConfig.model_validate({"backend": {"kind": "sched_ext"}}), sysfs=tmp_path / "missing"
        )


def test_an_unknown_backend_kind_never_reaches_selection() -> None:
    """select_backend has no branch for an unknown kind: the configuration refuses it first."""
    with pytest.raises(ValueError, match=r"backend\.kind"):
        AgentConfig.model_validate({"backend": {"kind": "cfs"}})
