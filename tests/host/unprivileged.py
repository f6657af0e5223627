"""Running the project's code as another user (nobody) wherever the checkout lives.

`runuser -u nobody -- .venv/bin/python -m gthulhu_node` needs nobody to read the checkout, which a clone
under root's 0700 home (a fresh Debian machine) does not allow: "Permission denied" / "No module named
gthulhu_node". Here the interpreter starts as root, imports the whole gthulhu_node package (every
module, found by walking it: one place, so a command module imported lazily by the CLI cannot be missed
again, as `compare` once was), then drops to the user (groups, gid, uid: irreversibly) and only then runs
the code under test. What the tests check (what an unprivileged user may do to the agent) happens
entirely after the drop; only the imports, which an installed copy lets any user do, happen before it.
tests/unit/test_unprivileged.py runs this from a copy of the package in a 0700 folder, so that a module
left out fails there, wherever the checkout lives.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"

_BOOT = """
import importlib, os, pkgutil, pwd, sys
user, target, preload, *args = sys.argv[1:]
import gthulhu_node
for found in pkgutil.walk_packages(gthulhu_node.__path__, "gthulhu_node."):
    if found.name != "gthulhu_node.__main__":  # runs the CLI when imported
        importlib.import_module(found.name)
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

def command(user: str, target: str, *args: str, preload: tuple[str, ...] = ()) -> list[str]:
    """argv that runs `target` ("module:function", called with the args list) as `user`; with target
    "" the first arg is Python source run after the drop. `preload`: modules outside gthulhu_node (the
    tests' own) to import before the drop too."""
    return [str(PYTHON), "-c", _BOOT, user, target, ",".join(preload), *args]


def run(user: str, target: str, *args: str, preload: tuple[str, ...] = (), timeout: float = 60,
        path: Path = REPO, **kw: Any) -> subprocess.CompletedProcess[str]:
    """`path`: the folder gthulhu_node is imported from (the checkout, or a copy of it)."""
    env = dict(os.environ, PYTHONPATH=str(path))
    return subprocess.run(command(user, target, *args, preload=preload), capture_output=True, text=True,
                          timeout=timeout, env=env, cwd="/", **kw)


def cli(user: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """`gthulhu-node ARGS` as `user`."""
    return run(user, "gthulhu_node.cli:main", *args, timeout=timeout)
