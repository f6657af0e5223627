"""Obtain the lab kernel: a Debian cloud kernel built with sched_ext, with its headers and BTF.

The machine's own kernel has no sched_ext, so the lab boots Debian's trixie-backports cloud kernel under
qemu. The packages are only downloaded and unpacked into a private cache (never installed), through an apt
configuration that lives in the cache folder, so the machine's own apt sources stay untouched. The mirror
comes from the machine's existing Debian source entry at run time.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("GTHULHU_LAB_CACHE", "/var/cache/gthulhu-node-lab"))
SUITE = "trixie-backports"
DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
_BINARY_RE = re.compile(r"^linux-binary-unsigned-(\d+\.\d+\.\d+\+deb\d+)-cloud-amd64$")


@dataclass(frozen=True)
class LabKernel:
    """Paths of one unpacked lab kernel."""

    version: str  # e.g. 7.3.4+deb13-cloud-amd64
    root: Path

    @property
    def vmlinuz(self) -> Path:
        return self.root / "usr/lib/modules" / self.version / "vmlinuz.unsigned"

    @property
    def config(self) -> Path:
        """The build configuration (the headers package carries it as .config)."""
        return self.headers / ".config"

    @property
    def headers(self) -> Path:
        """The kernel build tree with its headers (what BCC compiles against)."""
        return self.root / "usr/src" / f"linux-headers-{self.version}"

    @property
    def vmlinux(self) -> Path:
        """An ELF carrying the kernel's BTF (source of vmlinux.h)."""
        return self.headers / "vmlinux"

    @property
    def common_headers(self) -> Path:
        base = self.version.removesuffix("-cloud-amd64")
        return self.root / "usr/src" / f"linux-headers-{base}-common"


def _mirror_uri() -> str:
    text = DEBIAN_SOURCES.read_text()
    for line in text.splitlines():
        if line.startswith("URIs:"):
            uri = line.split(":", 1)[1].strip().split()[0]
            if "security" not in uri:
                return uri
    raise RuntimeError(f"no Debian URIs: entry in {DEBIAN_SOURCES}")


def apt_opts(base: Path) -> list[str]:
    """apt options that use only the private source list and package lists under `base`."""
    return [
        "-o", "Dir::Etc::SourceList=/dev/null",
        "-o", f"Dir::Etc::SourceParts={base / 'parts'}",
        "-o", f"Dir::State::Lists={base / 'lists'}",
        "-o", "Dir::Cache::pkgcache=",
        "-o", "Dir::Cache::srcpkgcache=",
        "-o", "Debug::NoLocking=1",
        "-o", "APT::Sandbox::User=root",
    ]


def apt_setup(base: Path, suite: str = SUITE) -> None:
    """A private apt configuration for one suite of the machine's own mirror, updated."""
    (base / "parts").mkdir(parents=True, exist_ok=True)
    (base / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (base / "parts" / "lab.sources").write_text(
        "Types: deb\n"
        f"URIs: {_mirror_uri()}\n"
        f"Suites: {suite}\n"
        "Components: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    subprocess.run(["apt-get", *apt_opts(base), "update"], check=True, stdout=subprocess.DEVNULL)


def _newest_cloud_kernel(base: Path) -> str:
    out = subprocess.run(
        ["apt-cache", *apt_opts(base), "pkgnames", "linux-binary-unsigned-"],
        check=True, capture_output=True, text=True,
    ).stdout
    versions = [m.group(1) for name in out.split() if (m := _BINARY_RE.match(name))]
    if not versions:
        raise RuntimeError(f"{SUITE} offers no linux-binary-unsigned-*-cloud-amd64 package")

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("+")[0].split("."))

    return max(versions, key=key)


def check_config(config: Path) -> None:
    """Refuse a kernel that cannot run what the lab needs."""
    text = config.read_text()
    for opt in ("CONFIG_SCHED_CLASS_EXT=y", "CONFIG_DEBUG_INFO_BTF=y", "CONFIG_VIRTIO_FS=y"):
        if f"\n{opt}\n" not in f"\n{text}\n":
            raise RuntimeError(f"lab kernel config {config} lacks {opt}")


def _current(cache: Path) -> LabKernel | None:
    return from_meta(cache / "current.json")


def from_meta(meta: Path) -> LabKernel | None:
    """The kernel a cache record ({"version", "root"}) names, if all of it is still there."""
    if not meta.exists():
        return None
    data = json.loads(meta.read_text())
    kernel = LabKernel(version=data["version"], root=Path(data["root"]))
    if kernel.vmlinuz.exists() and kernel.vmlinux.exists() and kernel.config.exists():
        return kernel
    return None


@contextlib.contextmanager
def cache_lock(cache: Path, name: str) -> Iterator[None]:
    """Hold an exclusive flock named `name` in the cache. Two callers that find the same thing missing at
    once (the two lanes of make test, or two people) would otherwise download or build into the same
    folders over each other; the second waits, then finds the first one's result."""
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cached(cache: Path, version: str | None) -> LabKernel | None:
    if version is not None:
        full = f"{version}-cloud-amd64"
        pinned = LabKernel(version=full, root=cache / full)
        return pinned if pinned.vmlinuz.exists() and pinned.vmlinux.exists() else None
    found = _current(cache)
    if found is not None:
        check_config(found.config)
    return found


def obtain(cache: Path = CACHE, version: str | None = None) -> LabKernel:
    """Return the cached lab kernel, downloading and unpacking it the first time (one caller at a time).

    `version` (e.g. "7.2.9+deb13") asks for one particular cloud kernel of the suite instead of the newest,
    to check the scheduler on a kernel between the lab's two."""
    found = _cached(cache, version)
    if found is not None:
        return found
    with cache_lock(cache, "obtain-debian-kernel"):
        return _cached(cache, version) or _download(cache, version)


def _download(cache: Path, version: str | None) -> LabKernel:
    apt_base = cache / "apt"
    apt_setup(apt_base)
    ver = version or _newest_cloud_kernel(apt_base)
    full = f"{ver}-cloud-amd64"
    pkgs = [
        f"linux-binary-unsigned-{full}",
        f"linux-headers-{full}",
        f"linux-headers-{ver}-common",
    ]
    dl = cache / "debs"
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", *apt_opts(apt_base), "download", *pkgs], check=True, cwd=dl,
                   stdout=subprocess.DEVNULL)
    root = cache / full
    tmp = cache / f".{full}.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for deb in sorted(dl.glob("*.deb")):
        if any(deb.name.startswith(p + "_") for p in pkgs):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
    shutil.rmtree(root, ignore_errors=True)
    tmp.rename(root)
    kernel = LabKernel(version=full, root=root)
    check_config(kernel.config)
    _fix_header_links(kernel)
    if version is None:
        (cache / "current.json").write_text(json.dumps({"version": full, "root": str(root)}))
    return kernel


def _fix_header_links(kernel: LabKernel) -> None:
    """Debian's per-flavour header tree links to the common tree by absolute /usr/src paths; point them
    into the cache so the tree is usable where it was unpacked."""
    for path in kernel.headers.rglob("*"):
        if path.is_symlink():
            target = os.readlink(path)
            if target.startswith("/usr/src/"):
                path.unlink()
                path.symlink_to(kernel.root / target.lstrip("/"))


# The lab's kernel matrix: the name a test asks for -> how to get it. "7.3" is Debian's newest
# trixie-backports cloud kernel (7.3.4 on 2026-12-01), "6.12" the LTS built from Debian's source.
KERNELS = ("7.3", "6.12")
DEFAULT_KERNEL = "7.3"


def lab_kernel(name: str = DEFAULT_KERNEL, cache: Path = CACHE) -> LabKernel:
    """The lab kernel of that name, obtained (downloaded or built) the first time."""
    if name == "7.3":
        return obtain(cache)
    if name == "6.12":
        from tests.vm.kernel_build import build

        return build(cache)
    raise ValueError(f"unknown lab kernel {name!r} (known: {', '.join(KERNELS)})")


def other_btfs(cache: Path = CACHE) -> dict[str, Path]:
    """BTF of every other amd64 cloud kernel the suite offers (version -> an ELF with .BTF), fetched once.

    Only the headers package is needed (about 1.5 MB: its vmlinux carries just the BTF). The compatibility
    check of the scheduler object runs against each, covering kernels the lab does not boot."""
    apt_base = cache / "apt"
    if not (apt_base / "parts" / "lab.sources").exists():
        apt_setup(apt_base)
    out = subprocess.run(["apt-cache", *apt_opts(apt_base), "pkgnames", "linux-headers-"],
                         check=True, capture_output=True, text=True).stdout
    found: dict[str, Path] = {}
    for name in sorted(out.split()):
        m = re.match(r"^linux-headers-(\d+\.\d+\.\d+\+deb\d+-cloud-amd64)$", name)
        if not m:
            continue
        full = m.group(1)
        target = cache / "btf" / f"{full}.vmlinux"
        if not target.exists():
            debs = cache / "btf" / ".debs"
            debs.mkdir(parents=True, exist_ok=True)
            subprocess.run(["apt-get", *apt_opts(apt_base), "download", name], check=True, cwd=debs,
                           stdout=subprocess.DEVNULL)
            deb = next(debs.glob(f"{name}_*.deb"))
            tmp = cache / "btf" / f".{full}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
            shutil.move(str(tmp / "usr/src" / f"linux-headers-{full}" / "vmlinux"), target)
            shutil.rmtree(tmp, ignore_errors=True)
            deb.unlink()
        found[full] = target
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", choices=["version", "vmlinuz", "vmlinux", "headers", "root"],
                        default="version")
    parser.add_argument("--kernel", choices=KERNELS, default=DEFAULT_KERNEL)
    args = parser.parse_args(argv)
    kernel = lab_kernel(args.kernel)
    print(getattr(kernel, args.print))
    return 0


if __name__ == "__main__":
    sys.exit(main())
