"""The arm64 guest's cached root (tests/vm/rootfs.py): named by its recipe, so a new package or pin builds a
new one; the guest's PID 1 copied in at each boot (the kernel runs it before any share is mounted);
mount points made for shares outside the guest's tmpfs folders; old roots pruned, the newest kept."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.vm import rootfs


def test_the_name_follows_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    before = rootfs.key()
    monkeypatch.setattr(rootfs, "PACKAGES", (*rootfs.PACKAGES, "strace"))
    more_packages = rootfs.key()
    assert more_packages != before
    monkeypatch.setattr(rootfs, "requirements", lambda: ["pydantic==1.0"])
    assert rootfs.key() not in (before, more_packages)


def test_the_guest_gets_exactly_the_agents_pinned_dependencies() -> None:
    reqs = rootfs.requirements()
    assert reqs and all("==" in r for r in reqs)
    assert any(r.startswith("google-re2==") for r in reqs)


def test_init_is_copied_in_by_content_and_never_overwritten(tmp_path: Path) -> None:
    script = tmp_path / "guest_init.py"
    script.write_text("one")
    root = tmp_path / "root"
    first = rootfs.install_init(root, script)
    assert first.parent == Path("/usr/local/lib/gthulhu-lab") and first.name.startswith("guest_init-")
    installed = root / first.relative_to("/")
    assert installed.read_text() == "one" and os.access(installed, os.X_OK)
    assert rootfs.install_init(root, script) == first  # the same content: the same file
    script.write_text("two")  # another checkout's version
    second = rootfs.install_init(root, script)
    assert second != first and (root / second.relative_to("/")).read_text() == "two"
    assert installed.read_text() == "one"  # a guest booting the first one still finds it


def test_mount_points_are_made_only_outside_the_guests_tmpfs(tmp_path: Path) -> None:
    rootfs.mountpoint_for(tmp_path, Path("/work/main"))
    rootfs.mountpoint_for(tmp_path, Path("/tmp/ci1"))
    rootfs.mountpoint_for(tmp_path, Path("/var/tmp/gthulhu-node-lab/run-1/scratch"))
    assert (tmp_path / "work/main").is_dir()
    assert not (tmp_path / "tmp").exists() and not (tmp_path / "var").exists()


def test_pruning_keeps_the_newest_roots(tmp_path: Path) -> None:
    made = []
    for i in range(5):
        r = tmp_path / f"rootfs-arm64-{i}"
        r.mkdir()
        (r / rootfs.STAMP).write_text(json.dumps({"key": str(i)}))
        os.utime(r / rootfs.STAMP, (time.time() - 100 + i, time.time() - 100 + i))
        made.append(r)
    rootfs._prune(made[0])  # the one just built is kept whatever its age
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["rootfs-arm64-0", "rootfs-arm64-3", "rootfs-arm64-4"]
