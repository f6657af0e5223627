"""The `gthulhu-node` command: the agent itself (`run`) and the tools people use against it."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import cast

from gthulhu_node import __version__

# Each module under gthulhu_node/commands/ defines register(subparsers) and sets `func` on its parsers.
COMMANDS: list[str] = [
    "client",
    "run",
    "probe",
    "compare",
    "install_service",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gthulhu-node",
        description="Workload-aware CPU scheduling agent: matches Linux threads by name and gives them "
        "priority and time slice through its own sched_ext scheduler.",
    )
    parser.add_argument("--version", action="version", version=f"gthulhu-node {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"gthulhu_node.commands.{name}").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    return cast(Callable[[argparse.Namespace], int], func)(args)


if __name__ == "__main__":
    sys.exit(main())
