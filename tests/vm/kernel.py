"""Obtain the lab kernel: a Debian cloud kernel built with sched_ext, with its headers and BTF.

The machine's own kernel has no sched_ext, so the lab boots Debian's trixie-backports cloud kernel under
qemu. The packages are only downloaded and unpacked into a private cache (never installed), through an apt
configuration that lives in the cache folder, so the machine's own apt sources stay untouched. The mirror
comes from the machine's existing Debian source entry at run time.

The same is done for arm64 (`--arch arm64`): the objects for arm64 hosts are built against that kernel's
BTF (bpf/Makefile). Those packages live beside the amd64 ones, with an apt setup of their own.
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
# Debian's names of the architectures the scheduler is built for; amd64 is the lab's own (it boots only it).
ARCHES = ("amd64", "arm64")
LAB_ARCH = "amd64"
_FLAVOUR_RE = re.compile(r"-cloud-(?:amd64|arm64)$")


def _binary_re(arch: str) -> re.Pattern[str]:
    return re.compile(rf"^linux-binary-unsigned-(\d+\.\d+\.\d+\+deb\d+)-cloud-{arch}$")


@dataclass(frozen=True)
class LabKernel:
    """Paths of one unpacked lab kernel."""

    version: str  # e.g. 7.3.4+deb13-cloud-amd64 (or -cloud-arm64)
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
        base = _FLAVOUR_RE.sub("", self.version)
        return self.root / "usr/src" / f"linux-headers-{base}-common"


def _mirror_uri() -> str:
    text = DEBIAN_SOURCES.read_text()
    for line in text.splitlines():
        if line.startswith("URIs:"):
            uri = line.split(":", 1)[1].strip().split()[0]
            if "security" not in uri:
                return uri
    raise RuntimeError(f"no Debian URIs: entry in {DEBIAN_SOURCES}")


def apt_base(cache: Path, arch: str = LAB_ARCH) -> Path:
    """The private apt folder for one architecture's packages (amd64's is the one the lab always had)."""
    return cache / "apt" if arch == LAB_ARCH else cache / f"apt-{arch}"


def apt_opts(base: Path, arch: str = LAB_ARCH) -> list[str]:
    """apt options that use only the private source list and package lists under `base`; for another
    architecture than the machine's, apt is told to want that one only."""
    foreign = [] if arch == LAB_ARCH else [
        "-o", f"APT::Architectures::={arch}", "-o", f"APT::Architecture={arch}"]
    return [*foreign,
        "-o", "Dir::Etc::SourceList=/dev/null",
        "-o", f"Dir::Etc::SourceParts={base / 'parts'}",
        "-o", f"Dir::State::Lists={base / 'lists'}",
        "-o", "Dir::Cache::pkgcache=",
        "-o", "Dir::Cache::srcpkgcache=",
        "-o", "Debug::NoLocking=1",
        "-o", "APT::Sandbox::User=root",
    ]


def apt_setup(base: Path, suite: str = SUITE, arch: str = LAB_ARCH) -> None:
    """A private apt configuration for one suite (and architecture) of the machine's own mirror, updated."""
    (base / "parts").mkdir(parents=True, exist_ok=True)
    (base / "lists" / "partial").mkdir(parents=True, exist_ok=True)
    (base / "parts" / "lab.sources").write_text(
        "Types: deb\n"
        f"URIs: {_mirror_uri()}\n"
        f"Suites: {suite}\n"
        + ("" if arch == LAB_ARCH else f"Architectures: {arch}\n")
        + "Components: main\n"
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg\n"
    )
    subprocess.run(["apt-get", *apt_opts(base, arch), "update"], check=True, stdout=subprocess.DEVNULL)


def _newest_cloud_kernel(base: Path, arch: str) -> str:
    out = subprocess.run(
        ["apt-cache", *apt_opts(base, arch), "pkgnames", "linux-binary-unsigned-"],
        check=True, capture_output=True, text=True,
    ).stdout
    pattern = _binary_re(arch)
    versions = [m.group(1) for name in out.split() if (m := pattern.match(name))]
    if not versions:
        raise RuntimeError(f"{SUITE} offers no linux-binary-unsigned-*-cloud-{arch} package")

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split("+")[0].split("."))

    return max(versions, key=key)


def check_config(config: Path) -> None:
    """Refuse a kernel that cannot run what the lab needs."""
    text = config.read_text()
    for opt in ("CONFIG_SCHED_CLASS_EXT=y", "CONFIG_DEBUG_INFO_BTF=y", "CONFIG_VIRTIO_FS=y"):
        if f"\n{opt}\n" not in f"\n{text}\n":
            raise RuntimeError(f"lab kernel config {config} lacks {opt}")


def _current(cache: Path, arch: str) -> LabKernel | None:
    return from_meta(cache / ("current.json" if arch == LAB_ARCH else f"current-{arch}.json"))


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


def _cached(cache: Path, version: str | None, arch: str) -> LabKernel | None:
    if version is not None:
        full = f"{version}-cloud-{arch}"
        pinned = LabKernel(version=full, root=cache / full)
        return pinned if pinned.vmlinuz.exists() and pinned.vmlinux.exists() else None
    found = _current(cache, arch)
    if found is not None:
        check_config(found.config)
    return found


def obtain(cache: Path = CACHE, version: str | None = None, arch: str = LAB_ARCH) -> LabKernel:
    """Return the cached lab kernel, downloading and unpacking it the first time (one caller at a time).

    `version` (e.g. "7.2.9+deb13") asks for one particular cloud kernel of the suite instead of the newest,
    to check the scheduler on a kernel between the lab's two. `arch` "arm64" gives that architecture's
    kernel (its BTF builds the arm64 objects; no lab VM boots it yet)."""
    if arch not in ARCHES:
        raise ValueError(f"unknown architecture {arch!r} (known: {', '.join(ARCHES)})")
    found = _cached(cache, version, arch)
    if found is not None:
        return found
    with cache_lock(cache, "obtain-debian-kernel"):
        return _cached(cache, version, arch) or _download(cache, version, arch)


def _download(cache: Path, version: str | None, arch: str) -> LabKernel:
    base = apt_base(cache, arch)
    apt_setup(base, arch=arch)
    ver = version or _newest_cloud_kernel(base, arch)
    full = f"{ver}-cloud-{arch}"
    pkgs = [
        f"linux-binary-unsigned-{full}",
        f"linux-headers-{full}",
        f"linux-headers-{ver}-common",
    ]
    dl = cache / "debs"
    dl.mkdir(parents=True, exist_ok=True)
    subprocess.run(["apt-get", *apt_opts(base, arch), "download", *pkgs], check=True, cwd=dl,
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
        meta = "current.json" if arch == LAB_ARCH else f"current-{arch}.json"
        (cache / meta).write_text(json.dumps({"version": full, "root": str(root)}))
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


def lab_kernel(name: str = DEFAULT_KERNEL, cache: Path = CACHE, arch: str = LAB_ARCH) -> LabKernel:
    """The lab kernel of that name, obtained (downloaded or built) the first time. Only the 7.3 kernel
    exists for arm64 (Debian's; the 6.12 build is amd64's)."""
    if name == "7.3":
        return obtain(cache, arch=arch)
    if arch != LAB_ARCH:
        raise ValueError(f"no {name} kernel for {arch}: only 7.3 (Debian's cloud kernel) is obtained for it")
    if name == "6.12":
        from tests.vm.kernel_build import build

        return build(cache)
    raise ValueError(f"unknown lab kernel {name!r} (known: {', '.join(KERNELS)})")


def other_btfs(cache: Path = CACHE, arch: str = LAB_ARCH) -> dict[str, Path]:
    """BTF of every cloud kernel of that architecture the suite offers (version -> an ELF with .BTF),
    fetched once.

    Only the headers package is needed (about 1.5 MB: its vmlinux carries just the BTF). The compatibility
    check of the scheduler object runs against each, covering kernels the lab does not boot.

    Under the cache's apt lock: pytest's workers each collect the tests parametrized by this list, so on an
    empty cache they all fetched at once, into the same folders, and one failed ("Different tests were
    collected"). `make lab-kernels` fetches them before pytest starts (`--other-btfs`)."""
    with cache_lock(cache, "obtain-debian-kernel"):
        return _other_btfs(cache, arch)


def _other_btfs(cache: Path, arch: str) -> dict[str, Path]:
    base = apt_base(cache, arch)
    if not (base / "parts" / "lab.sources").exists():
        apt_setup(base, arch=arch)
    out = subprocess.run(["apt-cache", *apt_opts(base, arch), "pkgnames", "linux-headers-"],
                         check=True, capture_output=True, text=True).stdout
    found: dict[str, Path] = {}
    for name in sorted(out.split()):
        m = re.match(rf"^linux-headers-(\d+\.\d+\.\d+\+deb\d+-cloud-{arch})$", name)
        if not m:
            continue
        full = m.group(1)
        target = cache / "btf" / f"{full}.vmlinux"
        if not target.exists():
            debs = cache / "btf" / ".debs"
            debs.mkdir(parents=True, exist_ok=True)
            subprocess.run(["apt-get", *apt_opts(base, arch), "download", name], check=True, cwd=debs,
                           stdout=subprocess.DEVNULL)
            deb = next(debs.glob(f"{name}_*.deb"))
            tmp = cache / "btf" / f".{full}.partial"
            shutil.rmtree(tmp, ignore_errors=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp)], check=True)
            shutil.move(str(tmp / "usr/src" / f"linux-headers-{full}" / "vmlinux"), target)
            shutil.rmtree(tmp, ignore_errors=True)
            deb.unlink()
        found[full] = target
    if not found:  # an empty list would parametrize no test at all: the checks would pass unseen
        raise RuntimeError(f"{SUITE} offers no linux-headers-*-cloud-{arch} package (apt lists in {base})")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", choices=["version", "vmlinuz", "vmlinux", "headers", "root"],
                        default="version")
    parser.add_argument("--kernel", choices=KERNELS, default=DEFAULT_KERNEL)
    parser.add_argument("--arch", choices=ARCHES, default=LAB_ARCH, help="Debian's name (default amd64)")
    parser.add_argument("--other-btfs", action="store_true",
                        help="fetch the BTF of every cloud kernel of --arch the suite offers; print them")
    args = parser.parse_args(argv)
    if args.other_btfs:
        for version, path in other_btfs(arch=args.arch).items():
            print(version, path)
        return 0
    kernel = lab_kernel(args.kernel, arch=args.arch)
    print(getattr(kernel, args.print))
    return 0


if __name__ == "__main__":
    sys.exit(main())
