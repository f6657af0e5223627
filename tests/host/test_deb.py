"""The Debian package (`make deb`), built and inspected on this machine: control fields and runtime
dependencies (no compiler), the file list (prebuilt scheduler objects, the unit, a private environment
without pip or byte code), conffiles, maintainer scripts that never start the service on install, lintian
with no tag left but the justified overrides, and the packaged environment itself running the agent.

Installing, upgrading, removing and purging it under systemd needs a machine whose /opt and /etc may
change: tests/vm/test_deb_lab.py does that in the lab guest; this file checks everything that does not."""

from __future__ import annotations

import gzip
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deb_build import session_deb
from tests.host.agent_support import REPO, agent_process, short_dir

pytestmark = pytest.mark.host

VENV = "opt/gthulhu-node/venv"
PYVER = f"{sys.version_info[0]}.{sys.version_info[1]}"
MACHINE = platform.machine()  # the architecture whose scheduler objects a package for this machine carries
STEMS = ("gthulhu", "gthulhu-6.12", "gthulhu-6.17")  # the objects of each architecture


@pytest.fixture(scope="module")
def deb() -> Path:
    return session_deb()


@pytest.fixture(scope="module")
def unpacked(deb: Path) -> Iterator[Path]:
    """The package's files and control area, as dpkg would put them (under a scratch root)."""
    root = short_dir()
    subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
    subprocess.run(["dpkg-deb", "-e", str(deb), str(root / "DEBIAN")], check=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def control(deb: Path) -> dict[str, str]:
    text = subprocess.run(["dpkg-deb", "-f", str(deb)], capture_output=True, text=True, check=True).stdout
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith(" ") and ":" in line:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


def test_control_fields_and_dependencies(deb: Path) -> None:
    fields = control(deb)
    assert fields["Package"] == "gthulhu-node"
    assert deb.name == f"gthulhu-node_{fields['Version']}_{fields['Architecture']}.deb"
    assert fields["Architecture"] == subprocess.run(["dpkg", "--print-architecture"], capture_output=True,
                                                    text=True, check=True).stdout.strip()
    depends = [d.strip() for d in fields["Depends"].split(",")]
    # the interpreter the private environment was made from, and no other minor version
    assert f"python{PYVER}" in depends
    assert f"python3 (>= {PYVER}~)" in depends
    assert any(d.startswith("python3 (<< ") for d in depends)
    assert "libbpf1" in depends
    assert any(re.fullmatch(r"libc6 \(>= 2\.\d+\)", d) for d in depends)
    for tool in ("clang", "llvm", "gcc", "libbpf-dev", "bpftool", "python3-dev", "python3-pip"):
        assert not any(d.split()[0].startswith(tool) for d in depends), fields["Depends"]
    assert fields["Recommends"] == "python3-bpfcc"
    assert "systemctl enable --now gthulhu-node" in subprocess.run(
        ["dpkg-deb", "-f", str(deb), "Description"], capture_output=True, text=True, check=True).stdout


def test_file_list(unpacked: Path) -> None:
    files = {str(p.relative_to(unpacked)) for p in unpacked.rglob("*") if not p.is_dir()}
    site = f"{VENV}/lib/python{PYVER}/site-packages"
    for expected in (
        "lib/systemd/system/gthulhu-node.service",
        "etc/gthulhu-node/config.yaml",
        "etc/gthulhu-node/policies.d/vllm.yaml.example",
        f"{VENV}/bin/gthulhu-node",
        f"{site}/gthulhu_node/data/gthulhu.{MACHINE}.bpf.o",
        f"{site}/gthulhu_node/data/gthulhu-6.12.{MACHINE}.bpf.o",
        f"{site}/gthulhu_node/data/gthulhu-6.17.{MACHINE}.bpf.o",
        "opt/gthulhu-node/remote-api.conf",
        "usr/share/doc/gthulhu-node/copyright",
        "usr/share/doc/gthulhu-node/changelog.Debian.gz",
        "usr/share/doc/gthulhu-node/NEWS.Debian.gz",
        "usr/share/lintian/overrides/gthulhu-node",
    ):
        assert expected in files, expected
    # the scale's turn (issue 39), where apt-listchanges shows it to an admin on upgrade
    news = gzip.decompress((unpacked / "usr/share/doc/gthulhu-node/NEWS.Debian.gz").read_bytes()).decode()
    assert news.startswith("gthulhu-node (0.2.0-") and "the lower the number the stronger" in news
    # the package is for one architecture: no other architecture's scheduler objects, and its record of
    # installed files (RECORD) names only what is there
    assert {f for f in files if f.endswith(".bpf.o")} == {
        f"{site}/gthulhu_node/data/{stem}.{MACHINE}.bpf.o" for stem in STEMS}
    [record] = [f for f in files if f.startswith(f"{site}/gthulhu_node-") and f.endswith("/RECORD")]
    listed = {line.split(",")[0] for line in (unpacked / record).read_text().splitlines()}
    assert {n for n in listed if n.endswith(".bpf.o")} == {
        f"gthulhu_node/data/{stem}.{MACHINE}.bpf.o" for stem in STEMS}
    # no pip in a dpkg-owned tree, nothing naming the build machine
    assert not any("/pip/" in f for f in files)
    # byte code built with the package: hash-checked (valid whatever mtimes dpkg sets), no staging path
    tag = f"cpython-{PYVER.replace('.', '')}"
    pyc = unpacked / site / "gthulhu_node" / "__pycache__" / f"agent.{tag}.pyc"
    head = pyc.read_bytes()
    assert int.from_bytes(head[4:8], "little") == 0b11, "not a checked-hash .pyc"
    assert b"/tmp" not in head and f"/{site}/gthulhu_node/agent.py".encode() in head
    assert sum(f.endswith(".pyc") for f in files) > 500
    assert not any(f.startswith(f"{site}/gthulhu_node-") and f.endswith("direct_url.json") for f in files)
    assert (unpacked / VENV / "bin" / "python").readlink() == Path(f"python{PYVER}")
    assert (unpacked / VENV / "bin" / f"python{PYVER}").readlink() == Path(f"/usr/bin/python{PYVER}")
    shebang = (unpacked / VENV / "bin" / "gthulhu-node").read_text().splitlines()[0]
    assert shebang == "#!/opt/gthulhu-node/venv/bin/python"
    assert "/tmp" not in (unpacked / VENV / "pyvenv.cfg").read_text()
    unit = (unpacked / "lib/systemd/system/gthulhu-node.service").read_text()
    exec_start = ("ExecStart="
                  "/opt/gthulhu-node/venv/bin/gthulhu-node run --config /etc/gthulhu-node/config.yaml")
    assert exec_start + "\n" in unit
    assert unit.count("[Install]") == 1
    assert (unpacked / "etc/gthulhu-node/config.yaml").read_text() == (
        REPO / "gthulhu_node/share/config.yaml").read_text()


def test_conffiles(unpacked: Path) -> None:
    conffiles = (unpacked / "DEBIAN" / "conffiles").read_text().split()
    assert conffiles == ["/etc/gthulhu-node/config.yaml", "/etc/gthulhu-node/policies.d/vllm.yaml.example"]


def test_maintainer_scripts_never_start_on_install(unpacked: Path) -> None:
    scripts = {name: (unpacked / "DEBIAN" / name).read_text() for name in ("postinst", "prerm", "postrm")}
    for name, text in scripts.items():
        assert os.access(unpacked / "DEBIAN" / name, os.X_OK), name
        check = subprocess.run(["sh", "-n", str(unpacked / "DEBIAN" / name)], capture_output=True, text=True,
                               check=False)
        assert check.returncode == 0, check.stderr
        code = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
        starts = re.compile(r"(systemctl|deb-systemd-invoke|deb-systemd-helper)\s+(\S+\s+)*"
                            r"(enable|start|restart|reload-or-restart)\b")
        assert not any(starts.search(line) for line in code), f"{name} starts or enables the service"
    postinst = scripts["postinst"]
    assert "daemon-reload" in postinst
    # only an upgrade ("configure" with the old version in $2) touches a running agent, and only try-restart
    assert 'if [ -n "$2" ]; then\n            deb-systemd-invoke try-restart gthulhu-node.service' in postinst
    assert "deb-systemd-invoke stop gthulhu-node.service" in scripts["prerm"]
    assert "rm -rf /var/lib/gthulhu-node" in scripts["postrm"].split("purge)")[1]


def test_lintian_clean_but_for_the_justified_overrides(deb: Path) -> None:
    out = subprocess.run(["lintian", "--fail-on", "none", str(deb)], capture_output=True, text=True,
                         check=False, timeout=900)
    tags = [line for line in out.stdout.splitlines() if re.match(r"[EWIX]: ", line)]
    assert tags == [], "\n".join(tags)
    docs = (REPO / "docs" / "packaging.md").read_text()
    overrides = (REPO / "packaging" / "debian" / "lintian-overrides").read_text()
    for tag in re.findall(r"^gthulhu-node: (\S+)", overrides, re.M):
        assert f"`{tag}`" in docs, f"docs/packaging.md does not justify the override {tag}"


def test_the_packaged_environment_runs_the_agent(unpacked: Path) -> None:
    """A venv finds its site-packages next to its pyvenv.cfg, so the unpacked environment runs from the
    scratch root: every dependency the agent imports at start is in the package."""
    python = unpacked / VENV / "bin" / "python"
    check = subprocess.run([str(python), "-m", "gthulhu_node", "run", "--check", "--config",
                            str(unpacked / "etc/gthulhu-node/config.yaml")],
                           capture_output=True, text=True, check=False, cwd="/")
    assert check.returncode == 0 and "is valid" in check.stdout, check.stderr
    base = short_dir()
    try:
        with agent_process(base, python=python, installed=True) as agent:
            assert agent.stop() == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
