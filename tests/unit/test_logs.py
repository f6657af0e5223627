"""Logging: the journal's native protocol (received on a real unix datagram socket), JSON lines, the choice
of format, and the per-event rate limit with its summary record."""

from __future__ import annotations

import io
import json
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from gthulhu_node import logs
from gthulhu_node.config import LogConfig


def parse_journal(datagram: bytes) -> dict[str, str]:
    """Decode the native protocol independently of the encoder (KEY=value or KEY\\n<len64le><data>\\n)."""
    fields: dict[str, str] = {}
    pos = 0
    while pos < len(datagram):
        nl = datagram.index(b"\n", pos)
        line = datagram[pos:nl]
        if b"=" in line:
            key, _, value = line.partition(b"=")
            fields[key.decode()] = value.decode()
            pos = nl + 1
        else:
            size = int.from_bytes(datagram[nl + 1:nl + 9], "little")
            fields[line.decode()] = datagram[nl + 9:nl + 9 + size].decode()
            assert datagram[nl + 9 + size:nl + 10 + size] == b"\n"
            pos = nl + 10 + size
    return fields


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[tuple[str, socket.socket]]:
    path = str(tmp_path / "journal.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.5)
    yield path, sock
    sock.close()


def received(sock: socket.socket) -> list[dict[str, str]]:
    out = []
    while True:
        try:
            out.append(parse_journal(sock.recv(1 << 20)))
        except TimeoutError:
            return out


def test_journald_fields_upper_cased_reserved_renamed(journal: tuple[str, socket.socket]) -> None:
    path, sock = journal
    setup = logs.configure(LogConfig(format="journald"), journal_socket=path)
    structlog.get_logger("gthulhu_node.reconciler").info(
        "task_matched", intent_id="local/vllm", tid=4242, comm="EngineCore_DP0", priority=10,
        slice_ns=2000000)
    setup.close()
    (record,) = received(sock)
    assert record["EVENT"] == "task_matched"
    assert record["INTENT_ID"] == "local/vllm"
    assert record["TID"] == "4242"
    assert record["COMM"] == "EngineCore_DP0"
    assert record["SLICE_NS"] == "2000000"
    # our `priority` must not collide with journald's syslog level
    assert record["SCHED_PRIORITY"] == "10"
    assert record["PRIORITY"] == "6"
    assert record["SYSLOG_IDENTIFIER"] == "gthulhu-node"
    assert record["LOGGER"] == "gthulhu_node.reconciler"
    assert record["CODE_FILE"].endswith("test_logs.py")
    assert int(record["CODE_LINE"]) > 0
    assert record["MESSAGE"].startswith("task_matched intent_id=local/vllm tid=4242")


def test_journald_multiline_values_use_binary_framing(journal: tuple[str, socket.socket]) -> None:
    path, sock = journal
    setup = logs.configure(LogConfig(format="journald"), journal_socket=path)
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        structlog.get_logger("t").exception("policy_file_invalid", file="/etc/x.yaml")
    setup.close()
    (record,) = received(sock)
    assert record["PRIORITY"] == "3"
    assert "Traceback" in record["EXCEPTION"] and "bad\nthing" in record["EXCEPTION"]
    assert "\n" not in record["MESSAGE"]


def test_journald_large_record_goes_through_memfd(journal: tuple[str, socket.socket]) -> None:
    path, sock = journal
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    setup = logs.configure(LogConfig(format="journald"), journal_socket=path)
    structlog.get_logger("t").info("big", blob="x" * (4 << 20))
    msg, ancdata, _, _ = sock.recvmsg(1 << 16, socket.CMSG_SPACE(4))
    setup.close()
    assert msg == b""
    (level, kind, data), = ancdata
    assert (level, kind) == (socket.SOL_SOCKET, socket.SCM_RIGHTS)
    fd = int.from_bytes(data[:4], "little")
    with open(fd, "rb") as fh:
        fh.seek(0)  # the sender's writes moved the shared offset; journald maps the file from its start
        record = parse_journal(fh.read())
    assert record["BLOB"] == "x" * (4 << 20)
    assert setup.stats.send_errors == 0


def test_rate_limit_summarises_a_flood(journal: tuple[str, socket.socket]) -> None:
    path, sock = journal
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    setup = logs.configure(LogConfig(format="journald", rate_limit_per_s=5), journal_socket=path)
    log = structlog.get_logger("t")
    for tid in range(1000):
        log.info("task_matched", tid=tid)
    log.info("intent_applied", intent_id="local/a")  # another event is not limited by the flood
    setup.flush(force=True)
    records = received(sock)
    setup.close()
    matched = [r for r in records if r["EVENT"] == "task_matched"]
    assert [r["TID"] for r in matched] == ["0", "1", "2", "3", "4"]
    assert any(r["EVENT"] == "intent_applied" for r in records)
    (summary,) = [r for r in records if r["EVENT"] == "task_matched_suppressed"]
    assert summary["COUNT"] == "995"
    assert summary["LIMIT_PER_S"] == "5"
    assert setup.stats.suppressed == {"task_matched": 995}


def test_rate_limit_window_reopens() -> None:
    now = [0.0]
    limiter = logs.RateLimiter(2, clock=lambda: now[0])
    summaries: list[tuple[str, str, int]] = []
    limiter.emit_summary = lambda level, event, count: summaries.append((level, event, count))
    passed = 0
    for step in range(6):
        now[0] = step * 0.3  # windows: [0, 1.0) has 4 calls, then a new one from 1.2
        try:
            limiter(None, "warning", {"event": "map_full"})
            passed += 1
        except structlog.DropEvent:
            pass
    assert passed == 4
    assert summaries == [("warning", "map_full", 2)]


def test_json_lines_and_stdlib_bridge() -> None:
    out = io.StringIO()
    setup = logs.configure(LogConfig(format="json"), stream=out)
    structlog.get_logger("gthulhu_node.x").warning("scan_incomplete", errors=3)
    logging.getLogger("grpc._server").error("exception calling %s", "Apply")
    setup.close()
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert lines[0]["event"] == "scan_incomplete" and lines[0]["errors"] == 3
    assert lines[0]["level"] == "warning" and lines[0]["logger"] == "gthulhu_node.x" and lines[0]["timestamp"]
    assert lines[1]["event"] == "library_log" and lines[1]["logger"] == "grpc._server"
    assert lines[1]["message"] == "exception calling Apply"


def test_level_filter() -> None:
    out = io.StringIO()
    setup = logs.configure(LogConfig(format="json", level="warning"), stream=out)
    structlog.get_logger("t").info("quiet")
    structlog.get_logger("t").error("loud")
    setup.close()
    assert [json.loads(x)["event"] for x in out.getvalue().splitlines()] == ["loud"]


def test_auto_format(tmp_path: Path) -> None:
    sock_path = tmp_path / "sock"
    sock_path.touch()
    tty = io.StringIO()
    tty.isatty = lambda: True  # type: ignore[method-assign]
    assert logs.resolve_format("auto", {"JOURNAL_STREAM": "8:123"}, tty, str(sock_path)) == "journald"
    assert logs.resolve_format("auto", {"INVOCATION_ID": "ab"}, io.StringIO(), str(sock_path)) == "journald"
    # under systemd but no journal socket (a container without journald): not journald
    assert logs.resolve_format("auto", {"INVOCATION_ID": "ab"}, io.StringIO(), str(tmp_path / "no")) == "json"
    assert logs.resolve_format("auto", {}, tty, str(sock_path)) == "console"
    assert logs.resolve_format("auto", {}, io.StringIO(), str(sock_path)) == "json"
    assert logs.resolve_format("json", {"JOURNAL_STREAM": "8:1"}, tty, str(sock_path)) == "json"


def test_field_names() -> None:
    assert logs.journal_field_name("intent_id") == "INTENT_ID"
    assert logs.journal_field_name("priority") == "SCHED_PRIORITY"
    assert logs.journal_field_name("message") == "DETAIL"
    assert logs.journal_field_name("_private") == "PRIVATE"
    assert logs.journal_field_name("9lives") == "F_9LIVES"
    assert logs.journal_field_name("a-b.c") == "A_B_C"
