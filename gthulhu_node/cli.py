"""The `gthulhu-node` command: the agent itself (`run`) and the tools people use against it."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable
from typing import cast

from gthulhu_node import __version__
from gthulhu_node.errors import GthulhuError, edge_of

# Each module under gthulhu_node/commands/ defines register(subparsers) and sets `func` on its parsers.
COMMANDS: list[str] = [
    "client",
    "explain",
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


def exit_code(exc: GthulhuError) -> int:
    """The command line's one mapping of our exceptions (gthulhu_node/errors.py, the `exit` column):
    1 refused or failed, 2 bad input (a file, the configuration), 3 the agent cannot be reached."""
    return edge_of(exc).exit


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 0
    try:
        return cast(Callable[[argparse.Namespace], int], func)(args)
    except GthulhuError as exc:  # what a command did not answer itself: one line, the kind's exit code
        print("gthulhu-node: " + " ".join(str(exc).split()), file=sys.stderr)
        return exit_code(exc)


if __name__ == "__main__":
    sys.exit(main())
