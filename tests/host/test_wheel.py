"""The wheel (`make wheel`) as a user installs it: into a fresh virtual environment with nothing of this
checkout on the path. It must carry the prebuilt scheduler objects and the unit/default configuration
(package data), its `gthulhu-node` must run, `install-service` must write a unit systemd accepts and a
configuration the agent loads, and the installed agent must serve (dry-run backend)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.host.agent_support import REPO, agent_process, short_dir

pytestmark = pytest.mark.host


def build_wheel() -> Path:
    """scripts/build-wheel prints the path of the wheel it built."""
    out = subprocess.run([str(REPO / "scripts" / "build-wheel")], capture_output=True, text=True, check=True,
                         timeout=600)
    return Path(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def wheel() -> Path:
    return build_wheel()


@pytest.fixture(scope="module")
def venv(wheel: Path) -> Iterator[Path]:
    """A fresh environment from the system's Python (the one a user has), the wheel installed by pip."""
    base = short_dir()
    env = base / "venv"
    subprocess.run([sys.base_prefix + "/bin/python3", "-m", "venv", str(env)], check=True, timeout=120)
    pip = subprocess.run([str(env / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)],
                         capture_output=True, text=True, check=False, timeout=900, cwd="/")
    assert pip.returncode == 0, pip.stderr[-3000:]
    yield env
    shutil.rmtree(base, ignore_errors=True)


def installed(env: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(env / "bin" / "gthulhu-node"), *args], capture_output=True, text=True,
                          check=False, cwd="/", timeout=120)


def test_wheel_runs_and_carries_the_scheduler_objects(venv: Path) -> None:
    version = installed(venv, "--version")
    assert version.returncode == 0 and version.stdout.startswith("gthulhu-node "), version.stderr
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import gthulhu_node, importlib.resources as r; d = r.files('gthulhu_node') / 'data'; "
         "print(gthulhu_node.__file__); "
         "print(*(d.joinpath(f'{s}.{a}.bpf.o').read_bytes()[:4] for a in ('x86_64', 'aarch64') "
         "for s in ('gthulhu', 'gthulhu-6.12', 'gthulhu-6.17')))"],
        capture_output=True, text=True, check=True, cwd="/")
    module, magics = where.stdout.splitlines()
    assert module.startswith(str(venv)), "the package came from the checkout, not the wheel"
    elf = repr(b"\x7fELF")
    assert magics == " ".join([elf] * 6)


def test_the_wheel_carries_each_architectures_objects_and_nothing_else(wheel: Path) -> None:
    """One wheel for every machine: both architectures' objects (the loader picks by platform.machine()),
    no other object (the names from before there was one per architecture are gone), each the one the
    build made (test_scheduler_arm64.py checks the arm64 ones against the arm64 kernel)."""
    with zipfile.ZipFile(wheel) as archive:
        objects = {n for n in archive.namelist() if n.endswith(".bpf.o")}
        assert objects == {f"gthulhu_node/data/{stem}.{arch}.bpf.o" for arch in ("x86_64", "aarch64")
                           for stem in ("gthulhu", "gthulhu-6.12", "gthulhu-6.17")}
        for name in objects:
            assert archive.read(name) == (REPO / name).read_bytes(), name


def test_install_service_from_the_wheel(venv: Path) -> None:
    root = venv.parent / "root"
    first = installed(venv, "install-service", "--root", str(root))
    assert first.returncode == 0, first.stderr
    unit = root / "etc" / "systemd" / "system" / "gthulhu-node.service"
    text = unit.read_text()
    assert f"ExecStart={venv / 'bin' / 'gthulhu-node'} run --config /etc/gthulhu-node/config.yaml\n" in text
    assert "Documentation=" not in text
    verify = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                            check=False)
    assert verify.returncode == 0 and verify.stderr == "", verify.stderr
    config = root / "etc" / "gthulhu-node" / "config.yaml"
    assert config.read_text() == (REPO / "gthulhu_node" / "share" / "config.yaml").read_text()
    assert (root / "etc" / "gthulhu-node" / "policies.d" / "vllm.yaml.example").is_file()
    # the default configuration is valid for the installed agent
    check = installed(venv, "run", "--check", "--config", str(config))
    assert check.returncode == 0 and "is valid (backend auto)" in check.stdout, check.stderr
    # an operator's edit survives a second run (an upgrade)
    config.write_text("log: {level: debug}\n")
    second = installed(venv, "install-service", "--root", str(root))
    assert second.returncode == 0 and "left as it is" in second.stdout
    assert config.read_text() == "log: {level: debug}\n"


def test_installed_agent_serves(venv: Path) -> None:
    base = short_dir()
    try:
        with agent_process(base, python=venv / "bin" / "python", installed=True) as agent:
            assert agent.stop() == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
