"""Logging: structlog events rendered for journald, JSON lines or a terminal, with a per-event rate limit.

Components log named events with fields (`log.info("task_matched", intent_id=..., tid=..., comm=...)`).
This module decides how they leave the process:

- `journald`: one datagram per record over the journal's native protocol to /run/systemd/journal/socket,
  every field its own journal field, upper-cased (EVENT, INTENT_ID, TID, COMM, SLICE_NS, LOGGER, ...), plus
  MESSAGE (the event and its fields on one line), PRIORITY (the syslog level), SYSLOG_IDENTIFIER and
  CODE_FILE/CODE_LINE/CODE_FUNC. So `journalctl -u gthulhu-node EVENT=task_matched TID=1234` works.
  Field names journald reserves are renamed: our `priority` (an intent's scheduling priority) becomes
  SCHED_PRIORITY, because PRIORITY is the record's syslog level; `message` becomes DETAIL. TID is the task
  the event is about (journald does not set TID itself for native-protocol records).
- `json`: one JSON object per line on stderr. `console`: coloured key=value lines on stderr.
- `auto`: journald when systemd started us with the journal as our output ($JOURNAL_STREAM or
  $INVOCATION_ID set and the socket present), console on a terminal, JSON otherwise.

No flood: each event name may produce at most `rate_limit_per_s` records per second. Beyond that, records
of that event are dropped and counted, and when the second is over one summary record says so:
`task_matched_suppressed count=4980 limit_per_s=20`. Library loggers (stdlib `logging`) are routed through
the same pipeline as the event `library_log`.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

from gthulhu_node.config import LogConfig

JOURNAL_SOCKET = "/run/systemd/journal/socket"
SYSLOG_IDENTIFIER = "gthulhu-node"

# syslog(3) levels, as journald's PRIORITY field wants them
_SYSLOG_LEVEL = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7}
_LEVEL_NUMBER = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}

# Our field name -> journal field name, where the plain upper-casing would collide with a field journald
# defines with another meaning (systemd.journal-fields(7)).
_RENAMED = {
    "priority": "SCHED_PRIORITY",
    "message": "DETAIL",
    "message_id": "DETAIL_ID",
    "syslog_identifier": "DETAIL_IDENTIFIER",
    "syslog_facility": "DETAIL_FACILITY",
    "syslog_pid": "DETAIL_PID",
    "errno": "ERROR_ERRNO",
    "invocation_id": "DETAIL_INVOCATION_ID",
    "documentation": "DETAIL_DOCUMENTATION",
}
_DROPPED_FOR_JOURNAL = {"timestamp", "level", "event"}


# ---------------------------------------------------------------------------------------------------------
# Rate limiting


@dataclass
class _Window:
    start: float
    count: int = 0
    suppressed: int = 0
    level: str = "info"


@dataclass
class LogStats:
    """Counters for metrics: what the logging pipeline did."""

    records: int = 0
    suppressed: dict[str, int] = field(default_factory=dict)  # event name -> records dropped by the limit
    send_errors: int = 0  # journald datagrams that could not be sent


class RateLimiter:
    """At most `limit` records per event name per `window_s`; counts the rest and summarises them.

    A structlog processor. The summary of a window is emitted by the next record after the window ends
    or by `flush()` (the service calls it every second), whichever comes first, so a flood that stops
    still gets its summary.
    """

    def __init__(self, limit: int, window_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[str, _Window] = {}
        self._next_deadline = float("inf")
        self.stats = LogStats()
        self.emit_summary: Callable[[str, str, int], None] = lambda level, event, count: None

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        event = str(event_dict.get("event", ""))
        now = self._clock()
        with self._lock:
            due = self._expire(now) if now >= self._next_deadline else []
            window = self._windows.get(event)
            if window is None or now - window.start >= self.window_s:
                if window is not None and window.suppressed:
                    due.append((window.level, event, window.suppressed))
                window = self._windows[event] = _Window(start=now)
                self._next_deadline = min(self._next_deadline, now + self.window_s)
            window.count += 1
            drop = self.limit > 0 and window.count > self.limit and not event.endswith("_suppressed")
            if drop:
                window.suppressed += 1
                if _LEVEL_NUMBER.get(method_name, 20) > _LEVEL_NUMBER.get(window.level, 20):
                    window.level = method_name
                self.stats.suppressed[event] = self.stats.suppressed.get(event, 0) + 1
            else:
                self.stats.records += 1
        for level, name, count in due:
            self.emit_summary(level, name, count)
        if drop:
            raise structlog.DropEvent
        return event_dict

    def flush(self, force: bool = False) -> None:
        """Emit the summaries of windows that are over (all of them when `force`, at shutdown)."""
        with self._lock:
            due = self._expire(float("inf") if force else self._clock())
        for level, name, count in due:
            self.emit_summary(level, name, count)

    def _expire(self, now: float) -> list[tuple[str, str, int]]:
        due: list[tuple[str, str, int]] = []
        deadline = float("inf")
        for name, window in list(self._windows.items()):
            if now - window.start >= self.window_s:
                if window.suppressed:
                    due.append((window.level, name, window.suppressed))
                del self._windows[name]
            else:
                deadline = min(deadline, window.start + self.window_s)
        self._next_deadline = deadline
        return due


# ---------------------------------------------------------------------------------------------------------
# The journal's native protocol


def journal_field_name(key: str) -> str:
    """Our lower-case field name as a valid journal field name: [A-Z0-9_], not starting with _ or a digit."""
    if key in _RENAMED:
        return _RENAMED[key]
    name = "".join(ch if ch.isalnum() and ch.isascii() else "_" for ch in key.upper()).lstrip("_")
    if not name or name[0].isdigit():
        name = "F_" + name
    return name[:64]


def _field_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    try:
        return json.dumps(value, default=str, sort_keys=True)
    except (TypeError, ValueError):
        return repr(value)


def encode_journal_record(fields: list[tuple[str, str]]) -> bytes:
    """The native protocol's framing: `KEY=value\\n`, or for values with a newline
    `KEY\\n` + 64-bit little-endian length + value + `\\n`."""
    out = bytearray()
    for key, value in fields:
        data = value.encode("utf-8", "replace")
        if b"\n" in data:
            out += key.encode() + b"\n" + len(data).to_bytes(8, "little") + data + b"\n"
        else:
            out += key.encode() + b"=" + data + b"\n"
    return bytes(out)


def _message(event_dict: EventDict) -> str:
    """The human line: the event, then its fields as key=value (quoted when they contain spaces)."""
    parts = [str(event_dict.get("event", ""))]
    for key, value in event_dict.items():
        if key in ("event", "level", "timestamp", "exception", "logger") or key.startswith("code_"):
            continue
        text = _field_text(value)
        if not text or any(ch.isspace() for ch in text) or '"' in text:
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    if "exception" in event_dict:
        last = str(event_dict["exception"]).strip().splitlines()[-1:]
        if last:
            parts.append(f"exception={json.dumps(last[0])}")
    return " ".join(parts)


class JournalRenderer:
    """Final processor for the journald format: the event dict as a native-protocol datagram."""

    def __init__(self, identifier: str = SYSLOG_IDENTIFIER) -> None:
        self.identifier = identifier

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> bytes:
        level = str(event_dict.get("level", method_name))
        fields: list[tuple[str, str]] = [
            ("MESSAGE", _message(event_dict)),
            ("PRIORITY", str(_SYSLOG_LEVEL.get(level, 6))),
            ("SYSLOG_IDENTIFIER", self.identifier),
            ("EVENT", str(event_dict.get("event", ""))),
        ]
        for key, value in event_dict.items():
            if key in _DROPPED_FOR_JOURNAL:
                continue
            if key == "code_file":
                fields.append(("CODE_FILE", _field_text(value)))
            elif key == "code_line":
                fields.append(("CODE_LINE", _field_text(value)))
            elif key == "code_func":
                fields.append(("CODE_FUNC", _field_text(value)))
            else:
                fields.append((journal_field_name(key), _field_text(value)))
        return encode_journal_record(fields)


class JournalSender:
    """Sends datagrams to journald. Large records go through a sealed memfd, as the protocol allows."""

    def __init__(self, path: str = JOURNAL_SOCKET, stats: LogStats | None = None) -> None:
        self.path = path
        self.stats = stats or LogStats()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # A stalled journald must not stall the engine loop for long; a record that cannot go is counted.
        self._sock.settimeout(0.2)
        with contextlib.suppress(OSError):
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self._lock = threading.Lock()

    def send(self, datagram: bytes) -> None:
        with self._lock:
            try:
                self._sock.sendto(datagram, self.path)
                return
            except OSError as exc:
                if exc.errno not in (90, 105):  # EMSGSIZE, ENOBUFS: too big for one datagram
                    self.stats.send_errors += 1
                    return
            try:
                self._send_memfd(datagram)
            except OSError:
                self.stats.send_errors += 1

    def _send_memfd(self, datagram: bytes) -> None:
        fd = os.memfd_create("gthulhu-node-journal", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.write(fd, datagram)
            seals = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
            self._sock.sendmsg([], ancillary, 0, self.path)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._sock.close()


class _JournalLogger:
    """The structlog "logger" for journald: every method sends the rendered datagram."""

    def __init__(self, sender: JournalSender) -> None:
        self._sender = sender

    def msg(self, message: bytes) -> None:
        self._sender.send(message)

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


class _StreamLogger:
    """The structlog "logger" for json/console: one line per record on a stream, serialised by a lock."""

    def __init__(self, stream: TextIO, lock: threading.Lock) -> None:
        self._stream = stream
        self._lock = lock

    def msg(self, message: str) -> None:
        with self._lock:
            self._stream.write(message + "\n")
            self._stream.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


# ---------------------------------------------------------------------------------------------------------
# Configuration


def _under_systemd_journal(environ: MutableMapping[str, str], socket_path: str) -> bool:
    return bool(environ.get("JOURNAL_STREAM") or environ.get("INVOCATION_ID")) and os.path.exists(socket_path)


def resolve_format(wanted: str, environ: MutableMapping[str, str] | None = None,
                   stream: TextIO | None = None, socket_path: str = JOURNAL_SOCKET) -> str:
    """What `auto` means here and now: journald under systemd, console on a tty, JSON otherwise."""
    if wanted != "auto":
        return wanted
    env = os.environ if environ is None else environ
    if _under_systemd_journal(env, socket_path):
        return "journald"
    out = stream or sys.stderr
    return "console" if out.isatty() else "json"


def _add_logger_name(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    name = getattr(logger, "name", None)
    if name and "logger" not in event_dict:
        event_dict["logger"] = name
    return event_dict


def _rename_callsite(logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
    """CallsiteParameterAdder's names -> the journal's CODE_* names (as code_file, code_line, code_func)."""
    for ours, theirs in (("pathname", "code_file"), ("lineno", "code_line"), ("func_name", "code_func")):
        if ours in event_dict:
            event_dict[theirs] = event_dict.pop(ours)
    return event_dict


class _NamedLoggerFactory:
    """structlog.get_logger(__name__) keeps the module name, which the pipeline adds as `logger`."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self._make = make

    def __call__(self, *args: Any) -> Any:
        inner = self._make()
        return _Named(inner, str(args[0]) if args else "")


class _Named:
    def __init__(self, inner: Any, name: str) -> None:
        self._inner = inner
        self.name = name

    def __getattr__(self, item: str) -> Any:
        return getattr(self._inner, item)


class _StdlibBridge(logging.Handler):
    """Routes stdlib `logging` records (grpc, pyroute2, ...) into the structlog pipeline."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith("gthulhu_node.logs"):
            return
        level = record.levelname.lower()
        method = level if level in _LEVEL_NUMBER else "info"
        bound = structlog.get_logger(record.name)
        try:
            getattr(bound, method)("library_log", message=record.getMessage())
        except Exception:  # logging must never raise into the caller
            self.handleError(record)


@dataclass
class LoggingSetup:
    """What configure() set up; the service keeps it to flush summaries and read stats."""

    format: str
    limiter: RateLimiter
    sender: JournalSender | None = None

    @property
    def stats(self) -> LogStats:
        return self.limiter.stats

    def flush(self, force: bool = False) -> None:
        self.limiter.flush(force)

    def close(self) -> None:
        self.limiter.flush(force=True)
        if self.sender is not None:
            self.sender.close()


_current: LoggingSetup | None = None


def configure(config: LogConfig, *, stream: TextIO | None = None, journal_socket: str = JOURNAL_SOCKET,
              environ: MutableMapping[str, str] | None = None) -> LoggingSetup:
    """Configure structlog (and the stdlib bridge) for the whole process. Call once, early."""
    global _current
    fmt = resolve_format(config.format, environ, stream, journal_socket)
    level = _LEVEL_NUMBER[config.level]
    limiter = RateLimiter(config.rate_limit_per_s)
    out = stream or sys.stderr
    sender: JournalSender | None = None

    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_logger_name,
        structlog.processors.add_log_level,
        limiter,
    ]
    if fmt == "journald":
        sender = JournalSender(journal_socket, limiter.stats)
        journal_sender = sender
        processors += [
            structlog.processors.CallsiteParameterAdder(
                {
                    structlog.processors.CallsiteParameter.PATHNAME,
                    structlog.processors.CallsiteParameter.LINENO,
                    structlog.processors.CallsiteParameter.FUNC_NAME,
                },
                additional_ignores=["gthulhu_node.logs"],
            ),
            _rename_callsite,
            structlog.processors.format_exc_info,
            JournalRenderer(),
        ]
        factory = _NamedLoggerFactory(lambda: _JournalLogger(journal_sender))
    else:
        lock = threading.Lock()
        processors += [structlog.processors.TimeStamper(fmt="iso", utc=True)]
        if fmt == "json":
            processors += [structlog.processors.format_exc_info,
                           structlog.processors.JSONRenderer(default=str)]
        else:
            processors += [structlog.dev.ConsoleRenderer(colors=out.isatty())]
        factory = _NamedLoggerFactory(lambda: _StreamLogger(out, lock))

    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=factory,
        cache_logger_on_first_use=False,
    )
    summary_log = structlog.get_logger("gthulhu_node.logs")

    def emit_summary(level_name: str, event: str, count: int) -> None:
        getattr(summary_log, level_name if level_name in _LEVEL_NUMBER else "info")(
            f"{event}_suppressed", count=count, limit_per_s=limiter.limit, window_s=limiter.window_s,
            suppressed_event=event,
        )

    limiter.emit_summary = emit_summary

    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _StdlibBridge):
            root.removeHandler(handler)
    root.addHandler(_StdlibBridge())
    root.setLevel(max(level, logging.INFO))  # library debug output is noise even at our debug level

    if _current is not None and _current.sender is not None:
        _current.sender.close()
    _current = LoggingSetup(format=fmt, limiter=limiter, sender=sender)
    return _current


def current() -> LoggingSetup | None:
    """The active setup, if configure() ran (metrics read its stats)."""
    return _current
