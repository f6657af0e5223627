"""The arm64 guest's device tree with per-CPU capacities: an emulated big.LITTLE host.

qemu's virt machine builds its device tree from its own options; `-machine dumpdtb=FILE` writes that tree
and exits. Each CPU node then gets `capacity-dmips-mhz` (fdtput, from Debian's device-tree-compiler), the
property a real big.LITTLE SoC's tree carries, and `-dtb FILE` boots the guest with it. The guest kernel
normalizes the values (the largest becomes 1024) into /sys/devices/system/cpu/cpu*/cpu_capacity, which
is what the agent reads (docs/arm64.md). The tree must come from the same machine options as the boot, or
its memory, NUMA and PCI nodes would not match: it is dumped from the boot's own argv.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


def with_capacities(qemu_argv: Sequence[str], capacities: Sequence[int], run_dir: Path) -> Path:
    """Dump the tree `qemu_argv` would boot with, give CPU n `capacities[n]`, return the file."""
    if any(c < 1 for c in capacities):
        raise ValueError(f"capacities must be positive: {list(capacities)}")
    dtb = run_dir / "capacities.dtb"
    argv = list(qemu_argv)
    where = argv.index("-machine") + 1
    argv[where] = f"{argv[where]},dumpdtb={dtb}"
    # Nothing may wait on the sockets of the real boot: drop the chardevs and their devices' backends.
    done = subprocess.run(_without_sockets(argv), capture_output=True, text=True, timeout=120, check=False)
    if not dtb.exists():
        raise RuntimeError(f"qemu wrote no device tree ({done.returncode}): {done.stderr.strip()[-2000:]}")
    for cpu, capacity in enumerate(capacities):
        subprocess.run(["fdtput", "-t", "u", str(dtb), f"/cpus/cpu@{cpu}", "capacity-dmips-mhz",
                        str(capacity)], check=True, capture_output=True, text=True)
    return dtb


def _without_sockets(argv: list[str]) -> list[str]:
    """The argv minus every -chardev and -device (virtio-serial, vhost-user-fs): the dump needs none of
    them, and vhost-user devices would try to connect to virtiofsd."""
    out: list[str] = []
    skip = False
    for word in argv:
        if skip:
            skip = False
            continue
        if word in ("-chardev", "-device"):
            skip = True
            continue
        out.append(word)
    return out
