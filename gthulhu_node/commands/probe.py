"""`gthulhu-node probe`: run-queue wait latency of matched threads (or an ad-hoc regex), from the kernel."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from gthulhu_node.cli import exit_code
from gthulhu_node.config import ApiConfig


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "probe",
        help="measure how long matched threads wait for a CPU (BCC; needs root and kernel headers)",
        description="Attach BCC raw tracepoint programs (sched_wakeup, sched_wakeup_new, sched_switch) "
        "filtered in the kernel to the threads the agent's intents match (or to a regex on comm, without the "
        "agent), and report each thread's and intent's run-queue wait: p50/p90/p99/max from log2 "
        "histograms, interpolated within a bucket.",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument("--intent", metavar="KEY", help='one intent, "source/id"')
    which.add_argument("--all", action="store_true", help="every intent (the default)")
    which.add_argument("--regex", metavar="RE", help="threads whose comm matches this RE2 pattern; "
                       "no agent needed (measure before a policy exists)")
    p.add_argument("--duration", type=float, default=10.0, metavar="S", help="seconds to measure (10)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.add_argument("--socket", type=Path, default=ApiConfig().socket, help="the agent's API socket")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.duration <= 0:
        print("gthulhu-node probe: --duration must be positive", file=sys.stderr)
        return 2
    from gthulhu_node.probe import ProbeUnavailable, measure
    from gthulhu_node.probe.report import table

    try:
        result = measure(args.duration, regex=args.regex, intent=args.intent, socket_path=args.socket)
    except ProbeUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return exit_code(exc)
    except KeyboardInterrupt:
        return 130
    if args.output == "json":
        print(json.dumps(result.to_json(), indent=2))
    else:
        print(table(result))
    return 0
