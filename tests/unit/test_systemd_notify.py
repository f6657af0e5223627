"""sd_notify over a real unix datagram socket, path and abstract names, and the watchdog interval."""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path

from gthulhu_node.systemd import Notifier


def test_notify_to_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(1)
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.ready(status="ready: 1 intent applied")
    assert notifier.status("line one\nline two")
    assert notifier.reloading()
    assert notifier.stopping()
    messages = [sock.recv(4096).decode() for _ in range(4)]
    assert messages[0] == "READY=1\nSTATUS=ready: 1 intent applied"
    assert messages[1] == "STATUS=line one line two"
    lines = messages[2].split("\n")
    assert lines[0] == "RELOADING=1" and lines[1].startswith("MONOTONIC_USEC=") and int(lines[1][15:]) > 0
    assert messages[3] == "STOPPING=1"
    notifier.close()
    sock.close()


def test_notify_to_an_abstract_socket() -> None:
    name = f"gthulhu-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(1)
    notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
    assert notifier.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    sock.close()


def test_without_systemd_everything_is_a_no_op() -> None:
    notifier = Notifier({})
    assert not notifier.enabled
    assert not notifier.ready()
    assert notifier.watchdog_interval_s is None


def test_watchdog_interval_is_half_and_respects_watchdog_pid() -> None:
    assert Notifier({"WATCHDOG_USEC": "20000000"}).watchdog_interval_s == 10.0
    mine = {"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_interval_s == 10.0
    assert Notifier({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}).watchdog_interval_s is None
    assert Notifier({"WATCHDOG_USEC": "0"}).watchdog_interval_s is None


def test_a_missing_socket_is_counted_not_raised(tmp_path: Path) -> None:
    notifier = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert not notifier.ready()
    assert notifier.errors == 1
