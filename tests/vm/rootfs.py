"""The arm64 lab guest's root filesystem: Debian 12 for arm64, made once and cached.

The x86 guest runs this machine's own userland; an arm64 guest cannot, so it gets a root of its own:
`debootstrap --arch arm64` from the machine's Debian mirror (its second stage runs arm64 binaries through
qemu-user-static, registered with binfmt_misc), the Debian packages the agent and the smoke suite use, and
the agent's Python dependencies as aarch64 wheels, installed by this machine's pip with `--platform` into
the guest's /usr/local (so no Python runs emulated while building). The result lives in the lab cache under
a name derived from everything that went into it: a new package list or a new pin builds a new root, an
unchanged one is found in a second.

    python -m tests.vm.rootfs            # build (or find) it, print its path
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from tests.vm.kernel import CACHE, _mirror_uri, cache_lock

REPO = Path(__file__).resolve().parents[2]
GUEST_SUITE = "bookworm"  # the guest's Python is then 3.11, the version the x86 venv runs too
GUEST_PYTHON = "3.11"
# What the guest runs: the agent (python3, libbpf1), the smoke suite's reading of the kernel's maps
# (bpftool), systemd for the service check, procps for ps/pgrep, the engine benchmark's load and
# latency probe (stress-ng, rt-tests' cyclictest).
PACKAGES = ("python3", "libbpf1", "libelf1", "bpftool", "systemd", "systemd-sysv", "procps", "iproute2",
            "stress-ng", "rt-tests")
BINFMT = Path("/proc/sys/fs/binfmt_misc")
BINFMT_CONF = Path("/usr/lib/binfmt.d/qemu-aarch64.conf")
PLATFORMS = ("manylinux_2_17_aarch64", "manylinux2014_aarch64", "manylinux_2_28_aarch64",
             "manylinux_2_34_aarch64", "linux_aarch64")
STAMP = "gthulhu-lab-rootfs.json"
KEEP = 3  # roots kept in the cache, the newest included



def requirements() -> list[str]:
    """The agent's runtime dependencies, pinned in pyproject.toml: the guest gets exactly those."""
    with open(REPO / "pyproject.toml", "rb") as f:
        return list(tomllib.load(f)["project"]["dependencies"])


def key() -> str:
    recipe = {"suite": GUEST_SUITE, "packages": PACKAGES, "python": GUEST_PYTHON, "wheels": requirements(),
              "platforms": PLATFORMS, "layout": 1}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def path(cache: Path = CACHE) -> Path:
    return cache / f"rootfs-arm64-{key()}"


def obtain_rootfs(cache: Path = CACHE) -> Path:
    """The cached arm64 root, built the first time (one builder at a time; others wait and find it)."""
    root = path(cache)
    if (root / STAMP).exists():
        return root
    with cache_lock(cache, "rootfs-arm64"):
        if not (root / STAMP).exists():
            _build(root)
    return root


def _binfmt() -> None:
    """qemu-user-static's aarch64 entry in binfmt_misc, for debootstrap's second stage in the chroot.
    The 'F' flag in Debian's entry opens the interpreter now, so it works inside the chroot too."""
    if not (BINFMT / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)], check=True)
    if not (BINFMT / "qemu-aarch64").exists():
        if not BINFMT_CONF.exists():
            raise RuntimeError(f"{BINFMT_CONF} is missing: install qemu-user-static (scripts/install-deps)")
        (BINFMT / "register").write_text(BINFMT_CONF.read_text().strip())
    elif (BINFMT / "qemu-aarch64").read_text().splitlines()[0] != "enabled":
        (BINFMT / "qemu-aarch64").write_text("1")


def _build(root: Path) -> None:
    started = time.monotonic()
    work = root.with_name(root.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    _binfmt()
    print(f"rootfs: debootstrap --arch arm64 {GUEST_SUITE} into {work} (the first time: minutes)",
          file=sys.stderr, flush=True)
    log = root.with_name(root.name + ".log")
    with open(log, "w") as out:
        done = subprocess.run(
            ["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={','.join(PACKAGES)}",
             GUEST_SUITE, str(work), _mirror_uri()], stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"debootstrap failed ({done.returncode}); {log} ends:\n{tail}")
    site = work / "usr/local/lib" / f"python{GUEST_PYTHON}" / "dist-packages"
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile",
         "--only-binary=:all:", *platforms, "--implementation", "cp", "--python-version", GUEST_PYTHON,
         "--abi", f"cp{GUEST_PYTHON.replace('.', '')}", "--target", str(site), *requirements()],
        check=True)
    _tidy(work)
    (work / STAMP).write_text(json.dumps({"key": key(), "suite": GUEST_SUITE, "packages": PACKAGES,
                                          "seconds": round(time.monotonic() - started, 1)}) + "\n")
    work.rename(root)
    print(f"rootfs: ready in {time.monotonic() - started:.0f} s: {root}", file=sys.stderr, flush=True)
    _prune(root)


def _prune(keep: Path, count: int = KEEP) -> None:
    """Drop the oldest roots beyond `count` (about 500 MB each). Not only the current one is kept: another
    checkout of an older recipe may be booting its own root right now."""
    roots = sorted((r for r in keep.parent.glob("rootfs-arm64-*") if (r / STAMP).exists() and r != keep),
                   key=lambda r: (r / STAMP).stat().st_mtime, reverse=True)
    for old in roots[count - 1:]:
        shutil.rmtree(old, ignore_errors=True)
        old.with_name(old.name + ".log").unlink(missing_ok=True)


def _tidy(root: Path) -> None:
    """What the guest needs that debootstrap leaves out: a hostname, an empty machine-id (systemd makes
    one in /run at each boot), no apt caches (about 100 MB of .debs)."""
    (root / "etc/hostname").write_text("gthulhu-lab-arm64\n")
    (root / "etc/machine-id").write_text("")
    for leftover in (root / "var/cache/apt/archives").glob("*.deb"):
        leftover.unlink()


def mountpoint_for(root: Path, guest_path: Path) -> None:
    """Make `guest_path` exist in the read-only root the guest mounts, so a share can be mounted at the same
    path as on the host (the repository may live anywhere; /tmp and /var/tmp are tmpfs in the guest)."""
    if guest_path.parts[1:2] in (("tmp",),) or guest_path.parts[1:3] == ("var", "tmp"):
        return
    target = root / guest_path.relative_to("/")
    if not target.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        os.chmod(target, 0o755)


def install_init(root: Path, script: Path) -> Path:
    """The guest's PID 1 (tests/vm/guest_init.py) as the guest sees it: the kernel runs init before anything
    is mounted, so it must be in the root itself, not in the repository share. Named by its content and
    never overwritten: two checkouts sharing the cached root, or two lanes booting at once, each boot the
    script of their own checkout (written under a temporary name, then renamed)."""
    data = script.read_bytes()
    digest = hashlib.sha256(data).hexdigest()[:12]
    target = root / "usr/local/lib/gthulhu-lab" / f"{script.stem}-{digest}{script.suffix}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fresh = target.with_name(f".{target.name}.{os.getpid()}")
        fresh.write_bytes(data)
        fresh.chmod(0o755)
        fresh.rename(target)
    return Path("/") / target.relative_to(root)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    print(obtain_rootfs())
    return 0


if __name__ == "__main__":
    sys.exit(main())
