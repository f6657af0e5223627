"""Guest side of tests/vm/test_service.py, tests/vm/test_arm64.py and tests/vm/test_deb_lab.py: installs the
agent in the lab guest as a host gets it and reads back what a user (or an independent tool) would see.
Run in the guest with the repo's .venv python.

  guest_service.py install STAGE TAR    `make install`'s layout built on the host (tests/lab_install.py):
                                        STAGE/opt/gthulhu-node bound at /opt/gthulhu-node, /etc made
                                        writable from TAR (the guest root's /etc), then the installed
                                        `gthulhu-node install-service`: the shipped unit, no drop-in
  guest_service.py uninstall            all of that undone (the service stopped first)
  guest_service.py wait-applied KEY N   poll `gthulhu-node status -o json` until intent KEY is Applied with N
                                        matched tasks; print that intent's status (JSON)
  guest_service.py kernel-tids          the scheduler's TID map as the kernel holds it (bpftool), as JSON
                                        {tid: {"priority", "slice_ns"}}
  guest_service.py wait-tids FILE       wait for the workload's {comm: tid} file; print it
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.prom import sample_lines, scrape

REPO = Path(__file__).resolve().parents[2]
UNIT_DIR = Path("/etc/systemd/system")
CLI = Path("/opt/gthulhu-node/venv/bin/gthulhu-node")


INSTALLED = Path("/opt/gthulhu-node")
ETC_COPY = Path("/run/lab/etc")


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True)


def mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in Path("/proc/self/mounts").read_text().splitlines())


def writable_etc(tar: Path) -> None:
    """/etc as a tmpfs copy of the guest root's (overlayfs is a module the lab kernel lacks; a tar the host
    wrote extracts in seconds where a copy file by file through virtiofs takes minutes). The lab's own
    writable /etc/systemd/system (its agent unit, its masks) is carried over into the copy."""
    ETC_COPY.mkdir(parents=True, exist_ok=True)
    sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", str(ETC_COPY))
    sh("tar", "-xf", str(tar), "-C", str(ETC_COPY), "--strip-components=1", "etc")
    sh("mount", "--bind", "/etc/systemd/system", str(ETC_COPY / "systemd" / "system"))
    sh("mount", "--rbind", str(ETC_COPY), "/etc")


def install(stage: Path, tar: Path) -> int:
    if not mounted(INSTALLED):
        if not mounted(Path("/etc")):
            writable_etc(tar)
        # /opt is the root's, read-only: a tmpfs gives the mount point (nothing in the lab uses /opt)
        sh("mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/opt")
        INSTALLED.mkdir()
        sh("mount", "--bind", "-o", "ro", str(stage / "opt" / "gthulhu-node"), str(INSTALLED))
    # what `make install` runs after putting the environment in place (scripts/install)
    sh(str(CLI), "install-service", "--documentation", f"file://{INSTALLED}/README.md")
    return 0


def uninstall() -> int:
    subprocess.run(["systemctl", "stop", "gthulhu-node"], check=False)
    Path("/etc/systemd/system/gthulhu-node.service").unlink(missing_ok=True)
    for path in (INSTALLED, Path("/opt"), Path("/etc"), ETC_COPY):
        if mounted(path):
            sh("umount", "-l", str(path))
    sh("systemctl", "daemon-reload")
    return 0


def status_json() -> dict[str, Any]:
    out = subprocess.run([str(CLI), "status", "-o", "json"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return {}
    return dict(json.loads(out.stdout))


def wait_applied(key: str, tasks: int, timeout: float = 500.0) -> int:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        for intent in status_json().get("intents", []):
            if intent.get("key") == key:
                last = intent
                applied = intent.get("state") == "INTENT_STATE_APPLIED"
                if applied and int(intent.get("matchedTasks", 0)) == tasks:
                    print(json.dumps(intent))
                    return 0
        time.sleep(0.5)
    print(json.dumps(last))
    return 1


def kernel_tids() -> int:
    out = subprocess.run(["bpftool", "-j", "map", "dump", "name", "tid_map"], capture_output=True, text=True,
                         check=True)
    entries: dict[int, dict[str, int]] = {}
    for row in json.loads(out.stdout):
        formatted = row.get("formatted", row)
        value = formatted["value"]
        entries[int(formatted["key"])] = {"priority": int(value["priority"]),
                                          "slice_ns": int(value["slice_ns"])}
    print(json.dumps(entries))
    return 0


def wait_tids(path: Path, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.1)
    print(path.read_text())
    return 0


def wait_probe(timeout: float = 600.0) -> int:
    """Until the service's metrics say its continuous probe is up (BCC compiles in the agent: a minute
    under TCG), or its journal says why it is not (asked every 5 s: each journalctl costs the emulated
    guest more than a scrape). Prints the probe's metric lines and any `probe_unavailable` or
    `probe_failed` record."""
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    unavailable: list[str] = []
    next_journal = time.monotonic()
    while time.monotonic() < deadline:
        try:
            samples = scrape("127.0.0.1", 9812)
        except OSError:
            samples = {}
        lines = sample_lines(samples, "gthulhu_node_probe_", prefix=True)
        if "gthulhu_node_probe_up 1.0" in lines:
            break
        if time.monotonic() >= next_journal:
            next_journal = time.monotonic() + 5
            # two matches of one field: either event
            journal = subprocess.run(["journalctl", "-u", "gthulhu-node", "-o", "cat", "--no-pager",
                                      "EVENT=probe_unavailable", "EVENT=probe_failed"],
                                     capture_output=True, text=True, check=False)
            unavailable = [line for line in journal.stdout.splitlines() if line.strip()]
            if unavailable:
                break
        time.sleep(1)
    print(json.dumps({"metrics": lines, "unavailable": unavailable}))
    return 0


def main(argv: list[str]) -> int:
    cmd, *rest = argv
    if cmd == "install":
        return install(Path(rest[0]), Path(rest[1]))
    if cmd == "uninstall":
        return uninstall()
    if cmd == "wait-applied":
        return wait_applied(rest[0], int(rest[1]))
    if cmd == "kernel-tids":
        return kernel_tids()
    if cmd == "wait-tids":
        return wait_tids(Path(rest[0]))
    if cmd == "wait-probe":
        return wait_probe()
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
