"""`gthulhu-node run`: the agent itself, as systemd runs it (see gthulhu_node/service.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gthulhu_node import config as configuration
from gthulhu_node.cli import exit_code


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run", help="run the agent (what the systemd unit starts)",
        description="Load the scheduler, apply the saved and local intents, serve the API and metrics, "
        "and keep every matching thread scheduled until stopped (SIGTERM/SIGINT); SIGHUP re-reads the "
        "local policy files.",
    )
    parser.add_argument("--config", "-c", type=Path, default=None,
                        help=f"configuration file (default {configuration.DEFAULT_PATH}; "
                        "all defaults when that file is absent)")
    parser.add_argument("--log-format", choices=["auto", "journald", "json", "console"], default=None,
                        help="override log.format from the configuration")
    parser.add_argument("--check", action="store_true",
                        help="only validate the configuration and exit (0: valid, 2: not); what an operator "
                        "or a package's test runs after editing it, without touching the scheduler")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from gthulhu_node import preflight

    try:
        cfg = configuration.load(args.config)
        preflight.check(cfg)
    except configuration.ConfigError as exc:
        # One clear line; systemd shows it in `systemctl status` and the journal.
        print("gthulhu-node: configuration error: " + " ".join(str(exc).split()), file=sys.stderr)
        return exit_code(exc)
    if args.check:
        print(f"gthulhu-node: configuration {args.config or configuration.DEFAULT_PATH} is valid "
              f"(backend {cfg.backend.kind})")
        return 0
    if args.log_format:
        cfg.log.format = args.log_format
    from gthulhu_node import privileges
    from gthulhu_node.service import Service

    path = str(args.config or configuration.DEFAULT_PATH)
    # Always on: nothing the agent does after its start needs CAP_SYS_ADMIN (gthulhu_node/privileges.py).
    return Service(cfg, config_path=path, release_privileges=privileges.release).run()
