"""`gthulhu-node compare`: an intent file on and off in alternating windows, measured side by side.

What the node-policy advice asks before production ("measure throughput, TTFT/TPOT, scheduler wait time
and overall CPU contention"), for the scheduler wait and CPU part, on the operator's own host and load:
gthulhu_node/probe/compare.py has the method; docs/probe.md a recipe for a vLLM or llama.cpp server.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import grpc

from gthulhu_node.api import convert
from gthulhu_node.api.client import ConnectError, Target, describe_rpc_error, stub
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.cli import exit_code
from gthulhu_node.config import ApiConfig
from gthulhu_node.intents.localfiles import PolicyFileError, read_file
from gthulhu_node.intents.model import Intent

DEFAULT_SOURCE = "compare"
TIMEOUT_S = 15.0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "compare",
        help="alternate an intent file on and off and compare the matched threads' run-queue wait and CPU",
        description="Apply the intents of FILE (as source --source) and take them away again, in "
        "alternating windows whose order flips every pair, for --duration seconds; meanwhile the BCC probe "
        "measures the run-queue waits of the threads the intents' patterns match, and /proc their CPU "
        "time. Prints both sides with the spread across windows. Needs root, BCC and the kernel's "
        "headers (as `gthulhu-node probe`), and the agent running. The source is left empty at the end.",
    )
    p.add_argument("-f", "--file", type=Path, required=True, help="intents (YAML or JSON, as apply takes)")
    p.add_argument("--duration", type=float, default=120.0, metavar="S",
                   help="total measuring time, both sides (120)")
    p.add_argument("--window", type=float, default=10.0, metavar="S", help="length of one window (10)")
    p.add_argument("--settle", type=float, default=1.0, metavar="S",
                   help="wait after each switch before measuring (1)")
    p.add_argument("--source", default=DEFAULT_SOURCE, help=f"source name to apply as ({DEFAULT_SOURCE})")
    p.add_argument("--socket", type=Path, default=ApiConfig().socket, help="the agent's API socket")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table")
    p.set_defaults(func=run)


def pattern(intents: list[Intent]) -> str:
    """One RE2 pattern for the threads any of the intents names (the same threads on both sides)."""
    return "|".join(f"(?:{i.command_regex})" for i in intents)


def run(args: argparse.Namespace) -> int:
    try:
        intents = list(read_file(args.file).intents)
    except PolicyFileError as exc:
        print(f"gthulhu-node compare: {args.file}: {exc}", file=sys.stderr)
        return exit_code(exc)
    if not intents:
        print(f"gthulhu-node compare: {args.file} holds no intent", file=sys.stderr)
        return 2
    pairs = int(args.duration // (2 * args.window))
    if args.window <= 0 or pairs < 1:
        print("gthulhu-node compare: --duration must hold at least one window per side "
              "(2 x --window)", file=sys.stderr)
        return 2
    from gthulhu_node.probe import BackgroundProbe, ProbeUnavailable
    from gthulhu_node.probe import compare as method

    target = Target(args.socket, None, None, None, None, None)
    try:
        channel, agent = stub(target)
    except ConnectError as exc:
        print(f"gthulhu-node compare: {exc}", file=sys.stderr)
        return exit_code(exc)

    def switch(on: bool) -> None:
        chosen = [convert.intent_to_pb(i) for i in intents] if on else []
        agent.ApplyIntents(pb.ApplyIntentsRequest(source=args.source, intents=chosen), timeout=TIMEOUT_S)

    regex = pattern(intents)
    try:
        with channel:
            switch(False)  # a reachable agent before the probe's seconds of compiling
            probe = BackgroundProbe(regex=regex)
            try:
                def progress(i: int, n: int, on: bool) -> None:
                    if args.output == "table":
                        print(f"window {i + 1}/{n}: intents {'on' if on else 'off'}", file=sys.stderr)

                windows = method.run_windows(
                    pairs, args.window, switch,
                    lambda: method.merged(probe.snapshot().intents.values()),
                    lambda: method.read_cpu_ns(probe.tids()),
                    settle_s=args.settle, progress=progress)
            finally:
                probe.stop()
                switch(False)
    except ProbeUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return exit_code(exc)
    except grpc.RpcError as exc:
        print(f"gthulhu-node compare: {describe_rpc_error(exc, target)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    summary = method.summarize(windows)
    if args.output == "json":
        doc = {"file": str(args.file), "regex": regex, "window_s": args.window, "sides": summary,
               "windows": [{"on": w.on, "seconds": round(w.seconds, 3), "cpu_cores": round(w.cpu_cores, 3),
                            "threads": w.threads, **w.waits.summary()} for w in windows]}
        print(json.dumps(doc, indent=2))
    else:
        print(f"{args.file}: {len(intents)} intents, on and off in {len(windows)} windows of "
              f"{args.window:g} s; threads whose comm matches {regex}")
        print("run-queue wait of each wait (percentiles within power-of-two buckets); CPU cores the "
              "threads used:")
        print(method.table(summary, windows))
    return 0
