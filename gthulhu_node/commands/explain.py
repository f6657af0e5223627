"""`gthulhu-node explain PID|TID|--comm REGEX`: why threads are (not) governed, as the agent answers it
(the Explain RPC; gthulhu_node/explain.py computes it inside the agent).

Exit codes, for scripts: 0 every thread explained is governed (by an intent, or, for the agent's own
threads on the sched_ext backend, by the agent's own boost: the scheduler gives them a strategy all the
same); 1 at least one is not; 2 an error (the agent cannot be reached, no such task, a bad pattern).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from typing import Any

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.commands.client import (
    TIMEOUT_S,
    _call,
    _connection_args,
    _dump,
    _err,
    _quiet_logs,
    _slice,
    _table,
    _to_dict,
)

EXIT_GOVERNED, EXIT_NOT_GOVERNED, EXIT_ERROR = 0, 1, 2
STAT_LABELS = {
    "boosted_runs": "boosted runs", "demotions": "guard demotions", "preemptions": "preemptions it made"}


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "explain", help="why a thread is (not) governed: every intent against it, the winner and why",
        description="For each thread: its comm, owner, cgroup and exe; every intent of every source, "
        "matched or not with the first reason it did not; the winner, why it wins and what it shadows; "
        "what the agent wrote for the thread's TID and TGID and what the backend reads back. A PID "
        "explains each of its threads. Exit status: 0 every thread governed, 1 one is not, 2 an error.")
    p.add_argument("pid", nargs="?", type=int, default=0, metavar="PID|TID",
                   help="a process (each of its threads) or one thread")
    p.add_argument("--comm", default="", metavar="REGEX",
                   help="every thread whose comm matches this RE2 pattern (unanchored search)")
    _connection_args(p)
    p.set_defaults(func=cmd_explain)


def cmd_explain(args: argparse.Namespace) -> int:
    _quiet_logs()
    if bool(args.pid) == bool(args.comm):
        _err("explain takes a PID or TID, or --comm REGEX (one of them)")
        return EXIT_ERROR
    request = pb.ExplainRequest(pid=args.pid, comm_regex=args.comm)
    rc, resp = _call(args, lambda s: s.Explain(request, timeout=TIMEOUT_S))
    if rc:
        return EXIT_ERROR
    if args.output == "json":
        _dump(_to_dict(resp))
    else:
        print("\n\n".join(describe(t) for t in resp.threads))
    return exit_status(resp.threads)


def exit_status(threads: Iterable[pb.ThreadExplanation]) -> int:
    """0 when every thread has a strategy: an intent's, or the agent's own boost (`agent_boost`)."""
    return EXIT_GOVERNED if all(t.winner or t.agent_boost for t in threads) else EXIT_NOT_GOVERNED


def _ms(ns: float) -> str:
    """A duration in ms, or in us below a millisecond (a run-queue wait of 3 us is not "0.00 ms")."""
    return f"{ns / 1e6:,.2f} ms" if ns >= 1e6 or ns == 0 else f"{ns / 1e3:,.1f} us"


def _age(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _window(s: pb.SchedStat) -> str:
    per = f", {_ms(s.wait_ns / s.timeslices)} each" if s.timeslices else ""
    return (f"{s.cpu_share:.1%} of a CPU, run-queue waits {_ms(s.wait_ns)} over {s.timeslices:,} "
            f"timeslices{per}")


def lately(t: pb.ThreadExplanation) -> list[str]:
    """What the scheduler did with the thread lately: the kernel's schedstat and the agent's probe."""
    if t.HasField("recent"):
        out = [f"  kernel schedstat, last {t.recent.seconds:.2f} s: {_window(t.recent)}"]
        if t.HasField("since_start"):
            out.append(f"  kernel schedstat, since it started {_age(t.since_start.seconds)} ago: "
                       f"{_window(t.since_start)}")
        elif t.schedstat_note:
            out.append(f"  kernel schedstat, {t.schedstat_note}")
    else:
        out = [f"  kernel schedstat: {t.schedstat_note or 'not available'}"]
    if t.probe_waits:
        out.append(f"  run-queue probe, {t.probe_intent}: {t.probe_waits:,} waits, "
                   f"mean {_ms(t.probe_mean_ns)}, p99 {_ms(t.probe_p99_ns)} ({t.probe_note})")
    else:
        out.append(f"  run-queue probe: {t.probe_note or 'not available'}")
    return out


def _entry(e: pb.SchedEntry, present: bool) -> str:
    return f"prio {e.priority} slice {_slice(e.slice_ns)}" if present else "-"


def describe(t: pb.ThreadExplanation) -> str:
    """One thread, for people."""
    owner = (f"uid {t.uid}, cgroup {t.cgroup or '-'}, exe {t.exe or '-'}" if t.owner_known
             else f"owner unknown ({t.owner_error or 'the process is gone'})")
    pod = f", pod {t.pod_uid}" if t.pod_uid else ""
    out = [f"thread {t.tid} ({t.comm}) of process {t.tgid}: {owner}{pod}"]
    if t.winner:
        out.append(f"governed by {t.winner}: priority {t.priority}, slice {_slice(t.slice_ns)}, "
                   f"scope {t.scope}")
        out.extend(f"  {w}" for w in t.why)
    elif t.agent_boost:
        out.append(f"governed by the agent's own boost, not an intent: {t.agent_boost}")
    else:
        out.append("not governed: no intent matches it (reasons below)")
    if t.agent_winner != t.winner:
        out.append(f"  the agent's table says {t.agent_winner or 'none'}: a change is being applied; "
                   "ask again")
    rows = []
    for i in t.intents:
        verdict = "WINS" if i.intent == t.winner else "shadowed" if i.intent in t.shadows else \
            "matches" if i.matched else "no"
        reason = i.reason or i.note or (f"loses to {t.winner}" if verdict == "shadowed" else "-")
        rows.append([i.intent, verdict, i.field or "-", reason])
    out.append(_table(["INTENT", "MATCH", "FIELD", "REASON"], rows) if rows else "no intents in any source")
    out.append(f"agent (backend {t.backend}):" + (f" {t.read_back}" if t.read_back else ""))
    if t.entries:
        out.append(_table(
            ["KEY", "INTENT", "DESIRED", "APPLIED", "READ BACK", "REFUSED"],
            [[e.key, e.intent or "-", _entry(e.desired, e.HasField("desired")),
              _entry(e.applied, e.HasField("applied")), _entry(e.read_back, e.HasField("read_back")),
              e.failure or "-"] for e in t.entries]))
    else:
        out.append("  no entry for its TID or TGID")
    if t.task_stats:
        out.append("  scheduler since load: " + ", ".join(
            f"{n} {STAT_LABELS.get(name, name)}" for name, n in sorted(t.task_stats.items())))
    else:
        out.append(f"  scheduler since load: {t.task_stats_note or 'not available'}")
    out.extend(lately(t))
    if t.kernel:
        out.append("  kernel now: " + ", ".join(f"{k} {v}" for k, v in sorted(t.kernel.items())))
    if t.backend_note:
        out.append(f"  {t.backend} cannot express: {t.backend_note}")
    return "\n".join(out)
