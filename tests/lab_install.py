"""The agent installed as a host gets it, for the lab's systemd tests: `make install`'s layout under
/opt/gthulhu-node, built once per test run on this machine and handed to the guest as a folder.

Why not the checkout's .venv: the shipped unit has ProtectHome=yes and PrivateTmp=yes, so a service whose
ExecStart points into a checkout under /root or /tmp cannot start (a fresh Debian machine: root's home is
0700), and a lab drop-in that binds the checkout back in tests a unit nobody ships.

A virtual environment records the path it was made at (its scripts' #! lines), so it is made at its real
path: in a private mount namespace where a tmpfs covers /opt and this run's folder is bound at
/opt/gthulhu-node. Nothing outside the folder changes on this machine. The guest binds the same folder at
/opt/gthulhu-node (tests/vm/guest_service.py), and `gthulhu-node install-service` from it writes the
shipped unit and the default configuration, as `make install` does.

- x86_64: scripts/install itself (the venv with its pinned dependencies from pip, the package copied in,
  not linked to the checkout). Its own unit and configuration go to a discarded folder of the stage.
- aarch64: the arm64 guest's Python packages live in its Debian root's site-packages (tests/vm/rootfs.py);
  the environment is the wheel (`make wheel`, pure Python with every architecture's objects) installed
  with pip into a venv on /usr/bin/python3 with the system site-packages, the way docs/packaging.md tells
  a host to install the wheel. Python 3.11 on both sides, and a venv holds no binaries, only a symlink to
  /usr/bin/python3, so the one made here runs there.

A stage is reused only within the same test run (xdist gives every worker of one run the same
PYTEST_XDIST_TESTRUNUID), never from an earlier run, whose sources may differ.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.vm.lab import Lab

REPO = Path(__file__).resolve().parents[1]
PREFIX = "/opt/gthulhu-node"

# Root, in a private mount namespace: $1 the stage, then the command that installs into /opt/gthulhu-node.
_IN_NAMESPACE = """
set -euo pipefail
stage=$1; shift
mount -t tmpfs -o mode=0755 tmpfs /opt
mkdir -p /opt/gthulhu-node "$stage/opt/gthulhu-node"
mount --bind "$stage/opt/gthulhu-node" /opt/gthulhu-node
"$@"
"""


def _run_id() -> str:
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid-{os.getpid()}"


def _in_namespace(stage: Path, argv: list[str], env: dict[str, str] | None = None) -> None:
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "/bin/bash", "-c", _IN_NAMESPACE,
                          "lab-install", str(stage), *argv], capture_output=True, text=True, check=False,
                         timeout=1800, cwd=REPO, env=dict(os.environ, **(env or {})))
    assert out.returncode == 0, f"{argv[0]} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def _build(stage: Path, arch: str) -> None:
    if arch == "x86_64":
        discard = stage / "discard"
        _in_namespace(stage, [str(REPO / "scripts" / "install")],
                      env={"PREFIX": PREFIX, "CONFDIR": str(discard / "etc"),
                           "UNITDIR": str(discard / "units"), "DESTDIR": ""})
        shutil.rmtree(discard)
        return
    built = subprocess.run([str(REPO / "scripts" / "build-wheel")], capture_output=True, text=True,
                           check=True, cwd=REPO, timeout=900)
    wheel = built.stdout.strip().splitlines()[-1]
    venv = f"{PREFIX}/venv"
    _in_namespace(stage, ["/bin/bash", "-c",
                          f"/usr/bin/python3 -m venv --system-site-packages --without-pip {venv} && "
                          f"{REPO}/.venv/bin/python -m pip --python {venv}/bin/python install -q --no-deps "
                          f"--no-compile --no-warn-script-location {wheel} && "
                          f"install -m 0644 {REPO}/README.md {PREFIX}/README.md"])


def session_install(arch: str = "x86_64") -> Path:
    """A folder holding `opt/gthulhu-node` (venv, ...) for `arch`, built at most once per test run."""
    base = REPO / "dist" / f"lab-install-{arch}"
    base.parent.mkdir(exist_ok=True)
    stamp = base.with_name(base.name + ".run")
    with base.with_name(base.name + ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists() and stamp.read_text() == _run_id() and (base / "opt/gthulhu-node/venv").is_dir():
            return base
        stamp.unlink(missing_ok=True)
        shutil.rmtree(base, ignore_errors=True)
        base.mkdir()
        _build(base, arch)
        stamp.write_text(_run_id())
        return base


def install_in_guest(lab: Lab) -> None:
    """This run's installation into the guest's /opt/gthulhu-node, its /etc writable (a copy of its root's),
    and the shipped unit and default configuration written by `gthulhu-node install-service`."""
    stage = session_install(lab.arch)
    tar = lab.scratch_host / "etc.tar"
    if not tar.exists():
        subprocess.run(["tar", "-C", str(lab.root), "-cf", str(tar), "etc"], check=True)
    lab.run(f".venv/bin/python tests/vm/guest_service.py install {stage} {lab.scratch_guest / 'etc.tar'}",
            timeout=600).check("install")


def uninstall_in_guest(lab: Lab) -> None:
    lab.run(".venv/bin/python tests/vm/guest_service.py uninstall", timeout=300).check("uninstall")
