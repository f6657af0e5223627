"""Talking to systemd: the sd_notify protocol (READY, STATUS, WATCHDOG, RELOADING, STOPPING).

The unit is `Type=notify`: systemd considers the service started only when READY=1 arrives, which the
service sends after the scheduler is loaded and the saved intents are applied. The protocol is one datagram
of newline-separated `KEY=value` lines to the unix socket named by $NOTIFY_SOCKET (a name starting with `@`
is in the abstract namespace). It is implemented here in a few lines rather than through a library, so the
agent has no extra dependency and works the same when run by hand (no socket: every call is a no-op).
"""

from __future__ import annotations

import os
import socket
import time

import structlog

log = structlog.get_logger(__name__)


def _socket_address(name: str) -> str | bytes:
    if name.startswith("@"):
        return b"\0" + name[1:].encode()
    return name


class Notifier:
    """Sends sd_notify messages; silent and harmless when not started by systemd with a notify socket."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address: str | bytes | None = None
        self._sock: socket.socket | None = None
        name = env.get("NOTIFY_SOCKET", "")
        if name and (name.startswith("@") or name.startswith("/")):
            self._address = _socket_address(name)
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        self.watchdog_interval_s = _watchdog_interval(env)
        self.sent = 0
        self.errors = 0

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: str | int) -> bool:
        """Send one message; keys are upper-cased (`ready=1` -> `READY=1`). False when nothing was sent."""
        if self._sock is None or self._address is None:
            return False
        payload = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            self._sock.sendto(payload, self._address)
        except OSError as exc:
            self.errors += 1
            log.warning("sd_notify_failed", error=str(exc))
            return False
        self.sent += 1
        return True

    def ready(self, status: str = "") -> bool:
        return self.notify(ready=1, status=status) if status else self.notify(ready=1)

    def status(self, text: str) -> bool:
        # STATUS is one line by definition: systemctl status shows it after "Status:".
        return self.notify(status=" ".join(text.split()))

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def reloading(self) -> bool:
        # MONOTONIC_USEC lets Type=notify-reload units match the reload with its end; harmless otherwise.
        return self.notify(reloading=1, monotonic_usec=time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000)

    def stopping(self) -> bool:
        return self.notify(stopping=1)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _watchdog_interval(env: os._Environ[str] | dict[str, str]) -> float | None:
    """Half of $WATCHDOG_USEC in seconds (the documented ping rate), or None when no watchdog applies.

    $WATCHDOG_PID, when set, names the process the watchdog is meant for; another process must not ping.
    """
    usec = env.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    pid = env.get("WATCHDOG_PID", "")
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6 / 2
