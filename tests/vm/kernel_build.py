"""Build the 6.12 LTS lab kernel from Debian's `linux-source-6.12` (no Debian 6.12 kernel has sched_ext).

Debian ships 6.12 with `CONFIG_SCHED_CLASS_EXT` unset, while RHEL 10 and its rebuilds run sched_ext on 6.12:
the lab needs one to prove the scheduler loads there. The source package is downloaded (never installed),
configured small for the lab (virtio, virtiofs, BPF + BTF, sched_ext, proc connector, schedstats, cgroups,
NUMA, hotplug, kprobes and in-kernel headers for BCC; no modules) and built once; the result is laid out
like an unpacked Debian kernel (`LabKernel`) in the lab cache, so the harness boots it unchanged.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.vm.kernel import LabKernel, check_config, from_meta

SOURCE_PACKAGE = "linux-source-6.12"
LOCALVERSION = "-gthulhu-lab"

# What the lab needs on top of `defconfig` + `kvm_guest.config`. Each is checked after olddefconfig: a
# symbol the kernel drops silently (a dependency missing) fails the build instead of a later test.
ENABLE = (
    "BPF", "BPF_SYSCALL", "BPF_JIT", "BPF_JIT_ALWAYS_ON", "DEBUG_INFO", "DEBUG_INFO_DWARF_TOOLCHAIN_DEFAULT",
    "DEBUG_INFO_BTF", "SCHED_CLASS_EXT", "EXT_GROUP_SCHED", "FUSE_FS", "VIRTIO_FS", "CONNECTOR",
    "PROC_EVENTS", "SCHEDSTATS", "SCHED_DEBUG", "CGROUPS", "CGROUP_SCHED", "FAIR_GROUP_SCHED",
    "CFS_BANDWIDTH", "CPUSETS", "NUMA", "HOTPLUG_CPU", "VIRTIO_CONSOLE", "KPROBES", "KPROBE_EVENTS",
    "BPF_EVENTS", "FTRACE", "FUNCTION_TRACER", "IKHEADERS", "IKCONFIG", "IKCONFIG_PROC", "SCHED_AUTOGROUP",
    "MAGIC_SYSRQ", "CGROUP_BPF", "TASKSTATS", "SCHED_MC", "SMP",
)
# defconfig's hardware the guest never has (graphics, sound, USB, wireless, disks, NICs: it boots from
# virtiofs and talks over virtio-serial): without them the build takes about half the time.
DISABLE = ("MODULES", "DEBUG_INFO_REDUCED", "DEBUG_INFO_SPLIT", "WERROR",
           "DRM", "FB", "SOUND", "USB_SUPPORT", "WLAN", "WIRELESS", "CFG80211", "MEDIA_SUPPORT", "ETHERNET",
           "AGP", "HID", "INPUT_JOYSTICK", "INPUT_TABLET", "INPUT_TOUCHSCREEN", "INPUT_MOUSE", "PCCARD",
           "ATA", "SCSI", "MD", "NETFILTER", "WATCHDOG", "HWMON", "THERMAL", "I2C", "EXT4_FS", "NFS_FS",
           "AUTOFS_FS")
# `make olddefconfig` keeps these only as y; the check below reads the final .config.
REQUIRED = ("SCHED_CLASS_EXT", "DEBUG_INFO_BTF", "VIRTIO_FS", "PROC_EVENTS", "EXT_GROUP_SCHED",
            "CFS_BANDWIDTH", "NUMA", "HOTPLUG_CPU", "IKHEADERS", "KPROBES", "SCHEDSTATS")
BUILD_DEBS = ("build-essential", "bc", "bison", "flex", "libelf-dev", "libssl-dev", "dwarves", "cpio",
              "xz-utils", "python3")


def _log(msg: str) -> None:
    print(f"kernel-build: {msg}", file=sys.stderr, flush=True)


def _meta(cache: Path) -> Path:
    return cache / "kernel-6.12.json"


def cached(cache: Path) -> LabKernel | None:
    """The built 6.12 kernel if a complete build is in the cache."""
    return from_meta(_meta(cache))


def _install_build_deps() -> None:
    missing = [p for p in BUILD_DEBS if subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", p], capture_output=True, text=True).stdout
        != "install ok installed"]
    if missing:
        _log(f"installing build packages: {' '.join(missing)}")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing],
                       check=True, env=env, stdout=subprocess.DEVNULL)


def source_tarball(cache: Path) -> Path:
    """linux-source-6.12's tarball, downloaded and unpacked from its package the first time."""
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{SOURCE_PACKAGE}_*.deb"))
    if not found:
        _log(f"downloading {SOURCE_PACKAGE} (about 150 MB)")
        subprocess.run(["apt-get", "download", SOURCE_PACKAGE], check=True, cwd=debs,
                       stdout=subprocess.DEVNULL)
        found = sorted(debs.glob(f"{SOURCE_PACKAGE}_*.deb"))
    unpacked = cache / "src-6.12"
    tarball = next(unpacked.glob("usr/src/linux-source-*.tar.xz"), None)
    if tarball is None:
        shutil.rmtree(unpacked, ignore_errors=True)
        subprocess.run(["dpkg-deb", "-x", str(found[-1]), str(unpacked)], check=True)
        tarball = next(unpacked.glob("usr/src/linux-source-*.tar.xz"))
    return tarball


def _configure(tree: Path) -> None:
    def make(*targets: str) -> None:
        subprocess.run(["make", "-s", *targets], check=True, cwd=tree, stdout=subprocess.DEVNULL)

    make("defconfig")
    make("kvm_guest.config")
    args: list[str] = []
    for sym in ENABLE:
        args += ["--enable", sym]
    for sym in DISABLE:
        args += ["--disable", sym]
    args += ["--set-str", "LOCALVERSION", LOCALVERSION, "--disable", "LOCALVERSION_AUTO"]
    subprocess.run(["scripts/config", *args], check=True, cwd=tree)
    make("olddefconfig")
    text = "\n" + (tree / ".config").read_text()
    lost = [s for s in REQUIRED if f"\nCONFIG_{s}=y\n" not in text]
    if lost:
        raise RuntimeError(f"6.12 lab kernel config lost {', '.join(lost)} after olddefconfig")


def build(cache: Path, jobs: int | None = None) -> LabKernel:
    """Return the 6.12 lab kernel, building it the first time (about 13 minutes on 2 cores). A second
    caller waits for a build in progress (an flock) instead of starting over in the same folder."""
    found = cached(cache)
    if found is not None:
        return found
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / "build-6.12.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return cached(cache) or _build(cache, jobs)


def _build(cache: Path, jobs: int | None) -> LabKernel:
    started = time.monotonic()
    _install_build_deps()
    tarball = source_tarball(cache)
    work = cache / "build-6.12"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    _log(f"unpacking {tarball.name}")
    subprocess.run(["tar", "-xJf", str(tarball), "-C", str(work)], check=True)
    tree = next(p for p in work.iterdir() if p.is_dir())
    _configure(tree)
    n = jobs or os.cpu_count() or 2
    _log(f"building bzImage with -j{n} (log: {work / 'build.log'})")
    with open(work / "build.log", "w") as log:
        subprocess.run(["make", f"-j{n}", "bzImage"], check=True, cwd=tree, stdout=log,
                       stderr=subprocess.STDOUT)
    return install(cache, tree, started, n)


def install(cache: Path, tree: Path, started: float, jobs: int) -> LabKernel:
    """Lay a built tree out like an unpacked Debian kernel, record it, and delete the build folder."""
    work = tree.parent
    release = subprocess.run(["make", "-s", "kernelrelease"], check=True, cwd=tree,
                             capture_output=True, text=True).stdout.strip()
    root = cache / release
    tmp = cache / f".{release}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    kernel = LabKernel(version=release, root=tmp)
    kernel.vmlinuz.parent.mkdir(parents=True)
    kernel.headers.mkdir(parents=True)
    shutil.copy2(tree / "arch/x86/boot/bzImage", kernel.vmlinuz)
    shutil.copy2(tree / ".config", kernel.config)
    shutil.copy2(tree / "vmlinux", kernel.vmlinux)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    kernel = LabKernel(version=release, root=root)
    check_config(kernel.config)
    minutes = (time.monotonic() - started) / 60
    _meta(cache).write_text(json.dumps({"version": release, "root": str(root),
                                        "build_minutes": round(minutes, 1), "jobs": jobs}))
    shutil.rmtree(work, ignore_errors=True)
    _log(f"built {release} in {minutes:.1f} min")
    return kernel
