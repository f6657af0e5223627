"""`make install` (scripts/install) into a scratch prefix: a working virtual environment with the BPF object,
a unit whose ExecStart is that environment and that `systemd-analyze verify` accepts, the default
configuration installed once and a user's configuration never overwritten."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.host.agent_support import REPO, short_dir

pytestmark = pytest.mark.host


@pytest.fixture
def scratch() -> Iterator[Path]:
    d = short_dir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


def install(scratch: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PREFIX=str(scratch / "opt"), CONFDIR=str(scratch / "etc"),
               UNITDIR=str(scratch / "units"))
    return subprocess.run([str(REPO / "scripts" / "install")], capture_output=True, text=True, env=env,
                          timeout=600, check=False)


def test_install_and_reinstall(scratch: Path) -> None:
    first = install(scratch)
    assert first.returncode == 0, first.stderr
    unit = scratch / "units" / "gthulhu-node.service"
    text = unit.read_text()
    exe = scratch / "opt" / "venv" / "bin" / "gthulhu-node"
    assert f"ExecStart={exe} run --config {scratch / 'etc' / 'config.yaml'}\n" in text
    assert "Type=notify\n" in text and "WatchdogSec=" in text

    version = subprocess.run([str(exe), "--version"], capture_output=True, text=True, check=True, cwd="/")
    assert version.stdout.startswith("gthulhu-node ")
    # the package is a copy (not an editable link to this checkout) and carries the scheduler object
    where = subprocess.run(
        [str(scratch / "opt" / "venv" / "bin" / "python"), "-c",
         "import gthulhu_node, importlib.resources as r, platform; print(gthulhu_node.__file__); "
         "obj = f'data/gthulhu.{platform.machine()}.bpf.o'; "
         "print(r.files('gthulhu_node').joinpath(obj).read_bytes()[:4])"],
        capture_output=True, text=True, check=True, cwd="/")
    module, magic = where.stdout.splitlines()
    assert module.startswith(str(scratch / "opt" / "venv"))
    assert magic == repr(b"\x7fELF")

    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            check=False)
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr
    # The unit's exposure as systemd scores it (it was 4.0: no syscall filter, any IP address, no
    # PrivateMounts); the VM's systemd tests check that the agent still works under it.
    security = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                              capture_output=True, text=True, check=False)
    exposure = float(security.stdout.split("Overall exposure level for gthulhu-node.service:")[1].split()[0])
    assert exposure < 3.0, security.stdout
    assert (scratch / "opt" / "remote-api.conf").read_text() == (
        REPO / "systemd" / "gthulhu-node.service.d" / "remote-api.conf").read_text()

    config = scratch / "etc" / "config.yaml"
    assert config.read_text() == (REPO / "systemd" / "config.yaml").read_text()
    assert (scratch / "etc" / "policies.d" / "vllm.yaml.example").is_file()
    # a user's edit survives a second install (an upgrade)
    config.write_text("log: {level: debug}\n")
    second = install(scratch)
    assert second.returncode == 0, second.stderr
    assert config.read_text() == "log: {level: debug}\n"
    assert "left as it is" in second.stdout


def test_the_documented_exposure_is_the_measured_one() -> None:
    """docs/security.md said 2.5 while systemd scored the unit 2.7 (issue 38, item 8): the figure the
    documents give is the one `systemd-analyze security --offline=yes` computes for the shipped unit."""
    unit = REPO / "systemd" / "gthulhu-node.service"
    security = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(unit)],
                              capture_output=True, text=True, check=False, timeout=60)
    measured = security.stdout.split("Overall exposure level for gthulhu-node.service:")[1].split()[0]
    said = (REPO / "docs" / "security.md").read_text().split("scores `systemd/gthulhu-node.service` **")[1]
    assert said.split("**")[0] == measured
    assert f"exposure {measured} in `systemd-analyze security" in (REPO / "docs" / "service.md").read_text()
