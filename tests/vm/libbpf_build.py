"""A newer libbpf for the lab, built from tools/lib/bpf of the kernel source the 6.12 lab kernel comes from.

The agent is tested with Debian 12's libbpf 1.1.2; hosts run newer ones (1.5 in Debian 13 and the 6.12
tree, 1.6+ elsewhere), which check struct_ops and kfuncs differently. The lab loads the scheduler with this
one too (`GTHULHU_LIBBPF=<path>`, read by gthulhu_node/scheduler/libbpf.py). Built once into the lab cache
from the linux-source-6.12 package kernel_build.py already downloaded (only tools/ is unpacked).

    python -m tests.vm.libbpf_build        # prints the path of libbpf.so
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.vm.kernel import CACHE, cache_lock
from tests.vm.kernel_build import source_tarball


def _cached(cache: Path) -> Path | None:
    meta = cache / "libbpf.json"
    if meta.exists():
        path = Path(json.loads(meta.read_text())["path"])
        if path.exists():
            return path
    return None


def obtain(cache: Path = CACHE) -> Path:
    """The newer libbpf.so, built the first time; a second caller waits for a build in progress (both
    lanes of make test may ask at once) instead of building into the same folders."""
    found = _cached(cache)
    if found is not None:
        return found
    with cache_lock(cache, "build-libbpf"):
        return _cached(cache) or _build(cache)


def _build(cache: Path) -> Path:
    meta = cache / "libbpf.json"
    tarball = source_tarball(cache)
    work = cache / "libbpf-build"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # one pass over the 140 MB archive: only what tools/lib/bpf's build reads
    subprocess.run(["tar", "-xJf", str(tarball), "-C", str(work), "--wildcards", "*/tools/*",
                    "*/include/uapi/*", "*/scripts/*"], check=True)
    top = next(p.name for p in work.iterdir() if p.is_dir())
    src = work / top / "tools/lib/bpf"
    out = cache / "libbpf"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    subprocess.run(["make", "-s", f"-j{os.cpu_count() or 2}", f"OUTPUT={out}/"], check=True,
                   cwd=src, stdout=subprocess.DEVNULL)
    path = next(p for p in sorted(out.glob("libbpf.so.*")) if not p.is_symlink())
    meta.write_text(json.dumps({"path": str(path), "from": top}))
    shutil.rmtree(work, ignore_errors=True)
    return path


if __name__ == "__main__":
    print(obtain())
    sys.exit(0)
