"""`gthulhu-node install-service`: the systemd unit and a default configuration, from the installed package.

Why a command and not a script: a wheel installed with pip or pipx has no checkout next to it, so the unit,
the default configuration and the policy example travel inside the package (gthulhu_node/share/) and this
command writes them where systemd and the agent look. `make install` (scripts/install) and `make deb`
(scripts/build-deb) call it too, so the three ways of installing write the same files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from gthulhu_node import config as configuration

UNIT_NAME = "gthulhu-node.service"


def share() -> Any:
    """The packaged unit, default configuration and examples (a Traversable: may live in a zip)."""
    return resources.files("gthulhu_node").joinpath("share")


def default_executable() -> Path:
    """This environment's `gthulhu-node`: where pip or pipx put the entry point next to this Python."""
    beside = Path(sys.prefix) / "bin" / "gthulhu-node"
    if beside.exists():
        return beside
    found = shutil.which("gthulhu-node")
    return Path(found) if found else beside


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "install-service",
        help="install the systemd unit and a default configuration from this package (root)",
        description="Write the systemd unit (ExecStart: this environment's gthulhu-node), the default "
        "configuration unless one exists (an operator's configuration is never overwritten) and the policy "
        "example; then reload systemd. The service is not started: a scheduler that replaces the kernel's "
        "policy is switched on by a person (systemctl enable --now gthulhu-node).",
    )
    p.add_argument("--unit-dir", type=Path, default=Path("/etc/systemd/system"),
                   help="where the unit goes (/etc/systemd/system)")
    p.add_argument("--config-dir", type=Path, default=configuration.DEFAULT_PATH.parent,
                   help=f"where the configuration goes ({configuration.DEFAULT_PATH.parent})")
    p.add_argument("--exec", dest="executable", type=Path, default=None,
                   help="the gthulhu-node the unit starts (default: this environment's)")
    p.add_argument("--documentation", default="",
                   help="the unit's Documentation= URL (default: none)")
    p.add_argument("--root", type=Path, default=Path("/"),
                   help="a staging root the paths above are written under (packaging, tests); "
                   "the unit still names the paths without it")
    p.add_argument("--no-reload", action="store_true", help="do not run systemctl daemon-reload")
    p.set_defaults(func=run)


def unit_text(executable: Path, config_path: Path, documentation: str) -> str:
    """The packaged unit with this installation's ExecStart (and Documentation=, or none)."""
    lines = []
    for line in share().joinpath(UNIT_NAME).read_text().splitlines():
        if line.startswith("ExecStart="):
            line = f"ExecStart={executable} run --config {config_path}"
        elif line.startswith("Documentation="):
            if not documentation:
                continue
            line = f"Documentation={documentation}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str) -> None:
    """Atomic, 0644: a unit half-written by an interrupted install must never be what systemd reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def _under(root: Path, path: Path) -> Path:
    return root / path.relative_to("/") if path.is_absolute() else root / path


def run(args: argparse.Namespace) -> int:
    executable: Path = args.executable or default_executable()
    config_dir: Path = args.config_dir.absolute()
    unit_dir: Path = args.unit_dir.absolute()
    config_path = config_dir / "config.yaml"

    unit = _under(args.root, unit_dir) / UNIT_NAME
    _write(unit, unit_text(executable, config_path, args.documentation))
    print(f"install-service: unit into {unit} (ExecStart={executable})")

    staged_config = _under(args.root, config_path)
    if staged_config.exists():
        print(f"install-service: {staged_config} exists, left as it is")
    else:
        _write(staged_config, share().joinpath("config.yaml").read_text())
        print(f"install-service: default configuration into {staged_config}")
    # The example is ours to refresh; the agent reads only *.yaml, *.yml and *.json.
    example = "vllm.yaml.example"
    _write(_under(args.root, config_dir / "policies.d" / example),
           share().joinpath("policies.d", example).read_text())

    systemd_runs = Path("/run/systemd/system").is_dir()
    if args.no_reload or args.root != Path("/") or not systemd_runs:
        print("install-service: done (no daemon-reload)")
        return 0
    reload = subprocess.run(["systemctl", "daemon-reload"], check=False)
    if reload.returncode != 0:
        print("install-service: systemctl daemon-reload failed", file=sys.stderr)
        return 1
    print("install-service: done. Start it with: systemctl enable --now gthulhu-node")
    return 0
