"""Running the project's code as another user (nobody) wherever the checkout lives.

`runuser -u nobody -- .venv/bin/python -m gthulhu_node` needs nobody to read the checkout, which a clone
under root's 0700 home (a fresh Debian machine) does not allow: "Permission denied" / "No module named
gthulhu_node". Here the interpreter starts as root, imports what the code under test needs, then drops
to the user (groups, gid, uid: irreversibly) and only then runs it. What the tests check (what an
unprivileged user may do to the agent) happens entirely after the drop; only the imports, which an
installed copy lets any user do, happen before it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"

_BOOT = """
import importlib, os, pwd, sys
user, target, preload, *args = sys.argv[1:]
for name in filter(None, preload.split(",")):
    importlib.import_module(name)
module, _, func = target.partition(":")
entry = getattr(importlib.import_module(module), func) if func else None
pw = pwd.getpwnam(user)
os.setgroups([])
os.setgid(pw.pw_gid)
os.setuid(pw.pw_uid)
assert os.getuid() == os.geteuid() == pw.pw_uid and os.getgroups() == []
os.chdir("/")
if entry is not None:
    sys.argv = [module, *args]
    sys.exit(entry(args))
sys.argv = ["-c", *args[1:]]
exec(compile(args[0], "<as-user>", "exec"), {"__name__": "__main__"})
"""

# Modules the CLI imports lazily (per command) that must be loaded before the drop.
CLI_MODULES = ("gthulhu_node.commands.client", "gthulhu_node.commands.run", "gthulhu_node.commands.probe",
               "gthulhu_node.api.client", "gthulhu_node.probe", "gthulhu_node.probe.report",
               "gthulhu_node.probe.preflight", "gthulhu_node.probe.session", "gthulhu_node.probe.targets",
               "gthulhu_node.probe.histogram", "gthulhu_node.probe.loader")


def command(user: str, target: str, *args: str, preload: tuple[str, ...] = ()) -> list[str]:
    """argv that runs `target` ("module:function", called with the args list) as `user`; with target
    "" the first arg is Python source run after the drop."""
    return [str(PYTHON), "-c", _BOOT, user, target, ",".join(preload), *args]


def run(user: str, target: str, *args: str, preload: tuple[str, ...] = (), timeout: float = 60,
        **kw: Any) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(command(user, target, *args, preload=preload), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd="/", **kw)


def cli(user: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`gthulhu-node ARGS` as `user`."""
    return run(user, "gthulhu_node.cli:main", *args, preload=CLI_MODULES, timeout=timeout)
