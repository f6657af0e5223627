"""`gthulhu-node apply | status | matches | delete`: the API for people (tables) and scripts (`-o json`).

Exit codes: 0 done; 1 the agent refused the request (the message says why); 2 the file is invalid;
3 the agent cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import structlog
from google.protobuf.json_format import MessageToDict

from gthulhu_node import config as configuration
from gthulhu_node.api import convert
from gthulhu_node.api.client import ConnectError, Target, describe_rpc_error, stub
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.cli import exit_code
from gthulhu_node.intents.localfiles import PolicyFileError, read_guarded
from gthulhu_node.intents.model import Intent, intent_key
from gthulhu_node.intents.parse import IntentValidationError, intent_to_doc

DEFAULT_SOURCE = "cli"
TIMEOUT_S = 15.0
STATE_NAMES = {
    pb.INTENT_STATE_PENDING: "Pending",
    pb.INTENT_STATE_APPLIED: "Applied",
    pb.INTENT_STATE_FAILED: "Failed",
    pb.INTENT_STATE_NOT_FOR_THIS_NODE: "NotForThisNode",
}
EXIT_REFUSED, EXIT_BAD_FILE, EXIT_UNREACHABLE = 1, 2, 3


def _connection_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--socket", type=Path, default=None,
                   help="the agent's unix socket (default: api.socket of --config)")
    g.add_argument("--config", "-c", type=Path, default=None,
                   help="read api.socket and node name/labels from this file "
                   f"(default {configuration.DEFAULT_PATH})")
    g.add_argument("--address", help="host:port of a TCP listener (mutual TLS)")
    g.add_argument("--tls-cert", type=Path, help="client certificate (PEM)")
    g.add_argument("--tls-key", type=Path, help="client key (PEM)")
    g.add_argument("--tls-ca", type=Path, help="CA that signed the agent's certificate (PEM)")
    g.add_argument("--tls-server-name", help="expected name in the agent's certificate")
    p.add_argument("-o", "--output", choices=["table", "json"], default="table")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("apply", help="apply intents from a file (replaces that source's set)",
                              description="Send every intent of FILE (YAML or JSON, same forms as the "
                              "policy files) as the full set of SOURCE. With --dry-run, nothing is sent: "
                              "the file is validated and matched against this host's threads right now.")
    p.add_argument("-f", "--file", type=Path, required=True)
    p.add_argument("--source", default=DEFAULT_SOURCE, help=f"source name (default {DEFAULT_SOURCE})")
    p.add_argument("--generation", type=int, default=0,
                   help="generation of this set (0: the next one; a lower one than stored is refused)")
    p.add_argument("--dry-run", action="store_true", help="validate and preview; change nothing")
    _connection_args(p)
    p.set_defaults(func=cmd_apply)

    p = subparsers.add_parser("status", help="per-intent status and the agent's summary")
    p.add_argument("--source", default="", help="only this source")
    _connection_args(p)
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("matches", help="the threads intents govern right now")
    p.add_argument("--intent", default="", help="only this intent (source/id)")
    _connection_args(p)
    p.set_defaults(func=cmd_matches)

    p = subparsers.add_parser("delete", help="delete one intent (ID or SOURCE/ID)")
    p.add_argument("id")
    p.add_argument("--source", default=DEFAULT_SOURCE, help=f"source name (default {DEFAULT_SOURCE})")
    _connection_args(p)
    p.set_defaults(func=cmd_delete)


# ---- plumbing ------------------------------------------------------------------------------------------


def _quiet_logs() -> None:
    """Library code logs through structlog; a CLI shows only what goes wrong."""
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def _config(args: argparse.Namespace) -> configuration.AgentConfig:
    try:
        return configuration.load(args.config)
    except configuration.ConfigError as exc:
        raise ConnectError(f"configuration: {exc}") from None


def _target(args: argparse.Namespace) -> Target:
    sock = args.socket or _config(args).api.socket
    return Target(sock, args.address, args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def _err(msg: str) -> None:
    print("gthulhu-node: " + " ".join(msg.split()), file=sys.stderr)


def _call(args: argparse.Namespace, fn: Callable[[Any], Any]) -> tuple[int, Any]:
    target: Target | None = None
    try:
        target = _target(args)
        channel, s = stub(target)
        with channel:
            return 0, fn(s)
    except ConnectError as exc:
        _err(str(exc))
        return exit_code(exc), None
    except grpc.RpcError as exc:
        assert target is not None
        _err(describe_rpc_error(exc, target))
        code = exc.code() if isinstance(exc, grpc.Call) else None
        unreachable = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        return (EXIT_UNREACHABLE if unreachable else EXIT_REFUSED), None


def _dump(obj: Any) -> None:
    print(json.dumps(obj, indent=2, ensure_ascii=False))


def _to_dict(msg: Any) -> dict[str, Any]:
    return MessageToDict(msg, always_print_fields_with_no_presence=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells)


def _slice(ns: int) -> str:
    if ns == 0:
        return "default"
    return f"{ns / 1e6:g}ms" if ns >= 1_000_000 else f"{ns / 1e3:g}us"


def _ago(seconds: float) -> str:
    if seconds <= 0:
        return "-"
    d = max(0, int(time.time() - seconds))
    return f"{d}s ago" if d < 120 else f"{d // 60}m ago" if d < 7200 else f"{d // 3600}h ago"


# ---- commands ------------------------------------------------------------------------------------------


def _read_intents(path: Path) -> list[Intent]:
    result, error = read_guarded(path)
    if result is None:
        raise PolicyFileError(error or "not loaded")
    for note in result.notes:
        print(f"note: {path}: {note}", file=sys.stderr)
    return list(result.intents)


def cmd_apply(args: argparse.Namespace) -> int:
    _quiet_logs()
    try:
        intents = _read_intents(args.file)
    except PolicyFileError as exc:
        _err(f"{args.file}: {exc}")
        return exit_code(exc)
    if args.dry_run:
        return _dry_run(args, intents)
    request = pb.ApplyIntentsRequest(
        source=args.source, generation=args.generation, intents=[convert.intent_to_pb(i) for i in intents]
    )
    rc, resp = _call(args, lambda s: s.ApplyIntents(request, timeout=TIMEOUT_S))
    if rc:
        return rc
    if args.output == "json":
        _dump(_to_dict(resp))
    else:
        what = "applied" if resp.changed else "unchanged (the agent already holds this set)"
        print(f"{len(intents)} intents from {args.file} as source {args.source!r}: {what}, "
              f"generation {resp.generation}. See `gthulhu-node status --source {args.source}`.")
    return 0


def _dry_run(args: argparse.Namespace, intents: list[Intent]) -> int:
    from gthulhu_node.preview import preview

    try:
        cfg = _config(args)
    except ConnectError as exc:
        _err(str(exc))
        return EXIT_BAD_FILE
    others, compared = _running_intents(args, exclude_source=args.source)
    result = preview(args.source, intents, node_name=cfg.node.name, node_labels=dict(cfg.node.labels),
                     others=others, proc_root=cfg.watch.proc_root,
                     named_only=cfg.security.unprivileged_tasks == "named_only")
    if args.output == "json":
        _dump({
            "valid": True,
            "comparedWithRunningAgent": compared,
            "tasksScanned": result.tasks_scanned,
            "intents": [{"key": p.key, "intent": intent_to_doc(p.intent), "forThisNode": p.for_this_node,
                         "matchedTasks": p.matched_tasks, "warnings": list(p.warnings)}
                        for p in result.intents],
            "matches": [{"tid": m.tid, "tgid": m.tgid, "comm": m.comm, "intent": m.intent,
                         "priority": m.priority, "sliceNs": m.slice_ns, "scope": m.scope}
                        for m in result.matches],
        })
        return 0
    print(f"{args.file}: {len(intents)} valid intents (dry run: nothing was changed; "
          f"{result.tasks_scanned} threads scanned"
          + (f"; compared with {len(others)} intents of the running agent)" if compared else ")"))
    print(_table(["INTENT", "PRIO", "SLICE", "SCOPE", "WOULD GOVERN", "PATTERN"],
                 [[p.key, p.intent.priority, _slice(p.intent.execution_time), p.intent.scope.value,
                   f"{p.matched_tasks} tasks" if p.for_this_node else "-", p.intent.command_regex]
                  for p in result.intents]))
    for p in result.intents:
        for w in p.warnings:
            print(f"  {p.key}: {w}")
    if result.matches:
        print()
        print(_table(["TID", "TGID", "COMM", "INTENT", "PRIO", "SLICE", "SCOPE"],
                     [[m.tid, m.tgid, m.comm, m.intent, m.priority, _slice(m.slice_ns), m.scope]
                      for m in result.matches]))
    return 0


def _running_intents(args: argparse.Namespace, exclude_source: str) -> tuple[list[tuple[str, Intent]], bool]:
    """Intents of the running agent's other sources, when it can be reached (quietly none otherwise)."""
    try:
        channel, s = stub(_target(args))
        with channel:
            resp = s.GetStatus(pb.GetStatusRequest(), timeout=3)
    except (ConnectError, grpc.RpcError):
        return [], False
    out = []
    for st in resp.intents:
        if st.source == exclude_source:
            continue
        try:
            out.append((intent_key(st.source, st.intent.id), convert.intent_from_pb(st.intent)))
        except IntentValidationError:
            continue  # an entry a lenient sender pushed that became no intent: listed, governs nothing
    return out, True


def cmd_status(args: argparse.Namespace) -> int:
    _quiet_logs()
    rc, resp = _call(args, lambda s: s.GetStatus(pb.GetStatusRequest(source=args.source), timeout=TIMEOUT_S))
    if rc:
        return rc
    if args.output == "json":
        _dump(_to_dict(resp))
        return 0
    a = resp.agent
    labels = ",".join(f"{k}={v}" for k, v in sorted(a.node_labels.items()))
    print(f"node {a.node_name}{' (' + labels + ')' if labels else ''}: "
          f"{'ready' if a.ready else 'not ready'}, backend {a.backend} ({a.scheduler_state}), "
          f"{a.matched_tasks} tasks matched")
    if a.backend_reason:
        print(f"  backend: {a.backend_reason}")
    if a.scheduler_reason:
        print(f"  scheduler: {a.scheduler_reason}")
    if a.capabilities:
        print(f"  capabilities: {a.capabilities}")
    if a.cgroup_cpu_max:
        print(f"  cgroup cpu.max: {a.cgroup_cpu_max}")
    for w in a.warnings:
        print(f"  warning: {w}")
    for src in resp.sources:
        for e in src.errors:
            print(f"  source {src.source}: error: {e}")
        for n in src.notes:
            print(f"  source {src.source}: note: {n}")
    if not resp.intents:
        print("no intents" + (f" in source {args.source!r}" if args.source else ""))
        return 0
    print()
    rows = []
    for st in resp.intents:
        rows.append([st.key, STATE_NAMES.get(st.state, "?"), st.matched_tasks, st.intent.priority,
                     _slice(st.intent.execution_time), st.intent.command_regex,
                     _ago(st.last_changed.ToNanoseconds() / 1e9)])
    print(_table(["INTENT", "STATE", "TASKS", "PRIO", "SLICE", "PATTERN", "CHANGED"], rows))
    for st in resp.intents:
        if st.reason:
            print(f"  {st.key}: {st.reason}")
        for w in st.warnings:
            print(f"  {st.key}: {w}")
    return 0


def cmd_matches(args: argparse.Namespace) -> int:
    _quiet_logs()
    request = pb.ListMatchesRequest(intent=args.intent)
    rc, resp = _call(args, lambda s: s.ListMatches(request, timeout=TIMEOUT_S))
    if rc:
        return rc
    if args.output == "json":
        _dump(_to_dict(resp))
        return 0
    if not resp.matches:
        print("no thread is governed by an intent right now")
        return 0
    print(_table(["TID", "TGID", "COMM", "INTENT", "PRIO", "SLICE", "SCOPE", "BEATS"],
                 [[m.tid, m.tgid, m.comm, m.intent, m.priority, _slice(m.slice_ns), m.scope,
                   ",".join(m.overlaps) or "-"] for m in resp.matches]))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    _quiet_logs()
    source, sep, intent_id = args.id.rpartition("/")
    if not sep:
        source, intent_id = args.source, args.id
    request = pb.DeleteIntentRequest(source=source, id=intent_id)
    rc, _ = _call(args, lambda s: s.DeleteIntent(request, timeout=TIMEOUT_S))
    if rc:
        return rc
    if args.output == "json":
        _dump({"deleted": f"{source}/{intent_id}"})
    else:
        print(f"deleted {source}/{intent_id}")
    return 0
