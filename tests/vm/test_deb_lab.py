"""The Debian package as a user meets it, in the systemd lab guest (sched_ext kernel): `apt-get install`
of `make deb`'s package does not start the service; enable starts the scheduler; the vLLM example applied
with the packaged CLI puts the engine threads into the kernel's map; an upgrade to a newer version keeps
the intents and an edited configuration and restarts the running agent; remove stops it (the scheduler is
unloaded) and keeps the configuration; purge removes configuration and state.

The guest's root is the host's, read-only: tests/vm/guest_deb.sh gives it writable /opt, /etc, unit
folder and dpkg database first (tmpfs copies), and takes them away after; it also hides the machine's
policy-rc.d (a container image's, which forbids every service action: the first run of this test showed
the upgrade's try-restart doing nothing because of it, as deb-systemd-invoke should). The newer version is
the same build repacked with a higher version (what dpkg and the maintainer scripts see of an upgrade).
Its time under TCG is in docs/packaging.md.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deb_build import session_deb
from tests.vm.lab import Lab

pytestmark = pytest.mark.vm

REPO = Path(__file__).resolve().parents[2]
HELPER = ".venv/bin/python tests/vm/guest_service.py"
CLI = "/opt/gthulhu-node/venv/bin/gthulhu-node"
EXAMPLE = "/etc/gthulhu-node/policies.d/vllm.yaml.example"
WORKLOAD = "vllm-like-deb"


def run(lab: Lab, cmd: str, timeout: float = 600) -> str:
    """Generous timeouts: under TCG on a busy 2-core host a dpkg run with its byte compilation takes
    minutes. They are safety nets, not measurements."""
    r = lab.run(cmd, timeout=timeout)
    print(f"[guest {r.duration:6.1f} s] {cmd[:110]}", flush=True)
    return r.check(cmd).stdout


def build_packages() -> tuple[Path, Path]:
    """`make deb`'s package, and the same repacked as version -2 (in dist/, which the guest sees).
    GTHULHU_LAB_DEB names an already built package to use instead (reruns while developing)."""
    if os.environ.get("GTHULHU_LAB_DEB"):
        first = Path(os.environ["GTHULHU_LAB_DEB"]).resolve()
    else:
        first = session_deb()
    work = REPO / "dist" / "upgrade-tree"
    shutil.rmtree(work, ignore_errors=True)
    subprocess.run(["dpkg-deb", "-R", str(first), str(work)], check=True)
    control = work / "DEBIAN" / "control"
    fields = dict(line.split(": ", 1) for line in control.read_text().splitlines() if ": " in line)
    version = fields["Version"]
    newer = version.rsplit("-", 1)[0] + "-" + str(int(version.rsplit("-", 1)[1]) + 1)
    control.write_text(control.read_text().replace(f"Version: {version}\n", f"Version: {newer}\n"))
    second = first.with_name(first.name.replace(version, newer))
    subprocess.run(["dpkg-deb", "--root-owner-group", "-Zgzip", "-b", str(work), str(second)], check=True,
                   capture_output=True)
    shutil.rmtree(work)
    return first, second


@pytest.fixture(scope="module")
def guest(lab_systemd_session: Lab) -> Iterator[Lab]:
    lab = lab_systemd_session
    lab.ensure_alive()
    # what guest_deb.sh makes writable, as the host has it (the guest's root is the host's)
    base = "deb-base.tar"
    subprocess.run(["tar", "-C", "/", "-cf", str(lab.scratch_host / base), "etc", "usr/lib/systemd/system",
                    "var/lib/dpkg"], check=True)
    run(lab, "systemctl stop gthulhu-node vllm-like 2>/dev/null; "
             f"bash tests/vm/guest_deb.sh writable {lab.scratch_guest / base}", timeout=900)
    yield lab
    lab.run(f"systemctl stop {WORKLOAD} gthulhu-node; apt-get purge -y gthulhu-node; "
            "bash tests/vm/guest_deb.sh restore", timeout=900)


def engine_in_the_kernel(lab: Lab, tids: dict[str, int]) -> None:
    status = json.loads(run(lab, f"{HELPER} wait-applied cli/vllm 2", timeout=900))
    assert status["state"] == "INTENT_STATE_APPLIED", status
    held = {int(k): v for k, v in json.loads(run(lab, f"{HELPER} kernel-tids")).items()}
    engine = {tids["EngineCore_DP0"], tids["EngineCore_DP1"]}
    assert set(held) == engine, (held, tids)
    assert all(v == {"priority": 5, "slice_ns": 2_000_000} for v in held.values()), held


def scheduler(lab: Lab) -> str:
    return run(lab, "cat /sys/kernel/sched_ext/state").strip()


@pytest.mark.timeout(5400)
@pytest.mark.lab_seconds(600)  # 9 min measured, with the package build (docs/packaging.md)
def test_install_enable_upgrade_remove_purge(guest: Lab) -> None:
    lab = guest
    first, second = build_packages()
    apt = "DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends"

    # install: files in place, the unit known to systemd, nothing started
    run(lab, f"{apt} {first}", timeout=1800)
    assert run(lab, "systemctl is-enabled gthulhu-node || true").strip() == "disabled"
    assert run(lab, "systemctl is-active gthulhu-node || true").strip() == "inactive"
    assert scheduler(lab) == "disabled"
    assert run(lab, f"{CLI} --version").startswith("gthulhu-node ")

    # enable: the scheduler runs; the vLLM example, applied with the packaged CLI, reaches the kernel
    run(lab, "systemctl enable --now gthulhu-node", timeout=900)
    assert scheduler(lab) == "enabled"
    assert run(lab, "cat /sys/kernel/sched_ext/root/ops").strip() == "gthulhu"
    run(lab, f"{CLI} apply -f {EXAMPLE}", timeout=300)
    run(lab, f"systemd-run --unit {WORKLOAD} --working-directory={lab.repo} "
             f"{lab.repo}/.venv/bin/python tests/vm/vllm_engine.py --idle --tids /run/{WORKLOAD}.json")
    tids = json.loads(run(lab, f"{HELPER} wait-tids /run/{WORKLOAD}.json"))
    engine_in_the_kernel(lab, tids)
    pid_before = run(lab, "systemctl show -p MainPID --value gthulhu-node").strip()
    run(lab, "echo '# edited by the operator' >> /etc/gthulhu-node/config.yaml")

    # upgrade: the running agent is restarted on the new version; intents and the edit are kept
    run(lab, f"{apt} {second}", timeout=1800)
    assert run(lab, "dpkg-query -W -f '${Version}' gthulhu-node") == second.name.split("_")[1]
    assert run(lab, "systemctl is-active gthulhu-node").strip() == "active"
    assert run(lab, "systemctl show -p MainPID --value gthulhu-node").strip() != pid_before
    assert "# edited by the operator" in run(lab, "cat /etc/gthulhu-node/config.yaml")
    engine_in_the_kernel(lab, tids)

    # remove: stopped, the scheduler unloaded, the configuration and saved intents kept
    run(lab, "DEBIAN_FRONTEND=noninteractive apt-get remove -y gthulhu-node", timeout=900)
    assert run(lab, "systemctl is-active gthulhu-node || true").strip() in ("inactive", "unknown")
    assert scheduler(lab) == "disabled"
    assert run(lab, "ls /etc/gthulhu-node/config.yaml /var/lib/gthulhu-node/intents.json").split() == [
        "/etc/gthulhu-node/config.yaml", "/var/lib/gthulhu-node/intents.json"]
    assert run(lab, "test -e /opt/gthulhu-node/venv && echo left || echo gone").strip() == "gone"

    # purge: configuration and state gone
    run(lab, "DEBIAN_FRONTEND=noninteractive apt-get purge -y gthulhu-node", timeout=900)
    assert run(lab, "ls /etc/gthulhu-node /var/lib/gthulhu-node 2>&1 || true").count("No such file") == 2
    assert run(lab, "dpkg-query -W -f '${Status}' gthulhu-node 2>&1 || true").strip() in (
        "", "unknown ok not-installed", "dpkg-query: no packages found matching gthulhu-node")
