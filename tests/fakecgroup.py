"""A fake cgroup v2 tree, so tests of the cpu.max count do not depend on the host's cgroup version."""

from __future__ import annotations

from pathlib import Path


def cgroup(root: Path, rel: str, cpu_max: str | None) -> Path:
    """One cgroup under `root` (a cgroup v2 root: it gets its cgroup.controllers), with `cpu.max` if given."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    path = root / rel
    path.mkdir(parents=True, exist_ok=True)
    if cpu_max is not None:
        (path / "cpu.max").write_text(cpu_max)
    return path


def tree(root: Path) -> Path:
    """Two limited cgroups (one nested), two unlimited, two without cpu.max (docker, system.slice)."""
    cgroup(root, "kubepods.slice", "max 100000\n")
    cgroup(root, "kubepods.slice/pod-a", "20000 100000\n")
    cgroup(root, "kubepods.slice/pod-a/ctr", "max 100000\n")
    cgroup(root, "docker/abc", "150000 100000\n")
    cgroup(root, "system.slice", None)
    return root
