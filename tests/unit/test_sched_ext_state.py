"""How the loader reads sched_ext's sysfs state (a folder laid out as /sys/kernel/sched_ext)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gthulhu_node.scheduler.loader import wait_gone


def sysfs(root: Path, state: str, ops: str) -> Path:
    (root / "root").mkdir(parents=True, exist_ok=True)
    (root / "state").write_text(state + "\n")
    (root / "root" / "ops").write_text(ops + "\n")
    return root


@pytest.mark.timeout(60)
def test_detaching_ours_does_not_wait_for_disabled_once_another_scheduler_holds_it(tmp_path: Path) -> None:
    """After an ejection another scheduler may take the slot; the agent's reload stopped ours by waiting
    for "disabled" for 30 s (measured in the lab VM, 2026-12-02) before each refused start. A hang here is
    the old behaviour; the test's timeout ends it."""
    assert wait_gone(3600, sysfs(tmp_path, "enabled", "intruder")) == ("enabled", "intruder")
    assert wait_gone(3600, sysfs(tmp_path, "disabled", "")) == ("disabled", "")


@pytest.mark.timeout(60)
def test_detaching_ours_waits_while_ours_is_still_there(tmp_path: Path) -> None:
    root = sysfs(tmp_path, "disabling", "gthulhu")
    done = threading.Timer(0.3, lambda: sysfs(root, "disabled", ""))
    done.start()
    try:
        assert wait_gone(3600, root) == ("disabled", "")
    finally:
        done.cancel()
    # the timeout still ends the wait
    assert wait_gone(0, sysfs(root, "enabled", "gthulhu")) == ("enabled", "gthulhu")
