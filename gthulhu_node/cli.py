"""The `gthulhu-node` command: the agent itself (`run`) and the tools people use against it."""

from __future__ import annotations

import argparse
import sys

from gthulhu_node import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gthulhu-node",
        description="Workload-aware CPU scheduling agent: matches Linux threads by name and gives them "
        "priority and time slice through its own sched_ext scheduler.",
    )
    parser.add_argument("--version", action="version", version=f"gthulhu-node {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
