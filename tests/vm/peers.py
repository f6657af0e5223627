"""The kernel's own reference sched_ext schedulers, `scx_simple` and `scx_flatcg`, as benchmark peers.

They are built at test time from `tools/sched_ext` of Debian's `linux-source-7.3` (trixie-backports,
through the lab's private apt setup, tests/vm/kernel.py) against the lab kernel's BTF, and cached under
the lab cache: no code of theirs is kept in this repository. The guest's root is this machine's, so the
guest runs the cached binaries where they are. clang-16 (Debian 12 has it) builds them; `LLVM=-16` would
want ld.lld-16, which Debian 12 lacks. First build: about 2 minutes on a loaded 2-core machine.

    .venv/bin/python -m tests.vm.peers          # build (or find) them, print where
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.vm.kernel import CACHE, apt_base, apt_opts, apt_setup, cache_lock, lab_kernel

SOURCE_PACKAGE = "linux-source-7.3"
PEERS = ("scx_simple", "scx_flatcg")
# What `make -C tools/sched_ext` needs of the source tree (it builds its own libbpf and bpftool).
TREE_PARTS = ("tools", "scripts", "include", "Makefile", "arch/x86/include", "kernel/bpf")


def peers_dir(cache: Path = CACHE) -> Path:
    return cache / "peers" / SOURCE_PACKAGE


def binary(name: str, cache: Path = CACHE) -> Path:
    """Where a built peer lives (the guest sees the same path)."""
    return peers_dir(cache) / name


def _source_tree(cache: Path, work: Path) -> Path:
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    found = sorted(debs.glob(f"{SOURCE_PACKAGE}_*.deb"))
    if not found:
        # the apt folder is shared with the kernel fetches, which hold this lock while they use it
        with cache_lock(cache, "obtain-debian-kernel"):
            base = apt_base(cache)
            apt_setup(base)
            subprocess.run(["apt-get", *apt_opts(base), "download", SOURCE_PACKAGE], check=True, cwd=debs,
                           stdout=subprocess.DEVNULL)
        found = sorted(debs.glob(f"{SOURCE_PACKAGE}_*.deb"))
    unpacked = work / "deb"
    subprocess.run(["dpkg-deb", "-x", str(found[-1]), str(unpacked)], check=True)
    tarball = next(unpacked.glob("usr/src/linux-source-*.tar.xz"))
    top = tarball.name.removesuffix(".tar.xz")
    subprocess.run(["tar", "-xJf", str(tarball), "-C", str(work), *(f"{top}/{part}" for part in TREE_PARTS)],
                   check=True)
    return work / top


def obtain(cache: Path = CACHE) -> dict[str, Path]:
    """Both peers, built the first time (under the cache lock, so parallel lanes build once)."""
    out = {name: binary(name, cache) for name in PEERS}
    if all(p.is_file() for p in out.values()):
        return out
    with cache_lock(cache, "peers"):
        if all(p.is_file() for p in out.values()):
            return out
        work = cache / ".peers-build"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        tree = _source_tree(cache, work)
        build = work / "out"
        build.mkdir()
        vmlinux = lab_kernel().vmlinux
        r = subprocess.run(
            ["make", "-C", str(tree / "tools" / "sched_ext"), "CLANG=clang-16", f"VMLINUX_BTF={vmlinux}",
             f"O={build}", *PEERS],
            capture_output=True, text=True, check=False,
        )
        if r.returncode != 0:
            raise RuntimeError(f"building {', '.join(PEERS)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
        dest = peers_dir(cache)
        dest.mkdir(parents=True, exist_ok=True)
        for name in PEERS:
            shutil.copy2(build / "build" / "bin" / name, dest / name)
        shutil.rmtree(work, ignore_errors=True)
    return out


def stage(scratch_host: Path, scratch_guest: Path) -> Path:
    """Both peers copied into a lab guest's scratch folder (the guest has a tmpfs over the cache where
    they are built); their folder as the guest sees it."""
    (scratch_host / "peers").mkdir(exist_ok=True)
    for name, path in obtain().items():
        shutil.copy2(path, scratch_host / "peers" / name)
    return scratch_guest / "peers"


def main() -> int:
    for name, path in obtain().items():
        print(f"{name} {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
