"""cgroup cpu.max limits: counted against a fake cgroup tree, never "0" when the tree cannot be read, and
said plainly (status line, log event) while the sched_ext scheduler leaves them unenforced."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import structlog

from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.scheduler.loader import cpu_max_source
from gthulhu_node.tasks.cgroup_limits import CpuMaxScan, CpuMaxWatch, describe, parse_cpu_max, scan_cpu_max
from tests.fakecgroup import cgroup, tree


def test_counts_the_cgroups_with_a_quota(tmp_path: Path) -> None:
    scan = scan_cpu_max(tree(tmp_path))
    assert scan.limited == 2
    assert sorted(scan.examples) == ["docker/abc", "kubepods.slice/pod-a"]
    assert (scan.visited, scan.errors, scan.capped) == (6, 0, False)  # docker itself has no cpu.max


def test_parse_cpu_max() -> None:
    assert parse_cpu_max("20000 100000\n") is True
    assert parse_cpu_max("max 100000\n") is False
    for bad in ("", "max", "20000", "-1 100000", "max max", "1 2 3", "twenty 100000"):
        with pytest.raises(ValueError):
            parse_cpu_max(bad)


def test_malformed_cpu_max_is_a_counted_error_not_a_crash(tmp_path: Path) -> None:
    tree(tmp_path)
    cgroup(tmp_path, "weird", "garbage\n")
    scan = scan_cpu_max(tmp_path)
    assert scan.limited == 2
    assert scan.errors == 1
    assert "weird/cpu.max" in scan.first_error and "garbage" in scan.first_error


def test_unreadable_cpu_max_is_counted_not_read_as_unlimited(tmp_path: Path) -> None:
    tree(tmp_path)
    (cgroup(tmp_path, "locked", None) / "cpu.max").mkdir()  # reading it fails with EISDIR
    scan = scan_cpu_max(tmp_path)
    assert (scan.limited, scan.errors) == (2, 1)


@pytest.mark.parametrize("code", [errno.ENOENT, errno.ENODEV])
def test_a_cgroup_vanishing_mid_walk_is_normal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               code: int) -> None:
    tree(tmp_path)
    gone = tmp_path / "docker"
    real_scandir = os.scandir

    def scandir(path: str | Path) -> os._ScandirIterator[str]:
        if Path(path) == gone:
            raise OSError(code, os.strerror(code))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)
    scan = scan_cpu_max(tmp_path)
    assert (scan.limited, scan.errors) == (1, 0)  # docker/abc went with its parent


def test_an_unreadable_root_is_unknown_never_zero(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scan = scan_cpu_max(tmp_path / "missing")
    assert scan.limited is None
    assert "missing" in scan.error
    assert describe(scan, False, "sched_ext").startswith("unknown: the cgroup tree could not be read")
    tree(tmp_path)

    def refused(path: str | Path) -> os._ScandirIterator[str]:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "scandir", refused)
    scan = scan_cpu_max(tmp_path)
    assert (scan.limited, scan.error) == (None, f"{tmp_path}: Permission denied")


def test_a_cgroup_v1_tree_is_unknown_not_zero(tmp_path: Path) -> None:
    """A v1 (or hybrid) /sys/fs/cgroup has no cpu.max anywhere: "0 limited" would be a lie."""
    (tmp_path / "cpu" / "docker" / "abc").mkdir(parents=True)
    (tmp_path / "cpu" / "docker" / "abc" / "cpu.cfs_quota_us").write_text("20000\n")
    scan = scan_cpu_max(tmp_path)
    assert scan.limited is None
    assert "not a cgroup v2 hierarchy" in scan.error


def test_the_walk_stops_at_its_cap_and_says_so(tmp_path: Path) -> None:
    for i in range(10):
        cgroup(tmp_path, f"c{i}", "1000 100000")
    scan = scan_cpu_max(tmp_path, max_cgroups=4)
    assert (scan.limited, scan.visited, scan.capped) == (4, 4, True)
    assert describe(scan, False, "sched_ext").startswith("at least 4 cgroups limited; may NOT be enforced")


def test_status_line() -> None:
    scan = CpuMaxScan(12, 40)
    assert describe(scan, False, "sched_ext") == (
        "12 cgroups limited; may NOT be enforced while the sched_ext scheduler runs (cgroups_untracked > 0: "
        "the cgroup map was full or the kernel keeps no cpu.max where the scheduler reads it; "
        "docs/scheduler.md)")
    assert describe(scan, True, "sched_ext", by_scheduler=cpu_max_source(True)) == (
        "12 cgroups limited; enforced by the sched_ext scheduler (cpu.max passed by the kernel, 6.17 or "
        "later)")
    assert describe(scan, True, "sched_ext", by_scheduler=cpu_max_source(False)) == (
        "12 cgroups limited; enforced by the sched_ext scheduler (cpu.max read from the kernel's task_group "
        "every 10 ms, kernel before 6.17)")
    # ejected: the kernel's CFS holds the limit, not our scheduler (it once said ours)
    assert describe(scan, True, "sched_ext") == (
        "12 cgroups limited; enforced by the kernel while the sched_ext scheduler is not running")
    assert describe(scan, True, "eevdf") == "12 cgroups limited; enforced by the kernel (eevdf backend)"
    assert describe(None, True, "eevdf") == "not scanned yet"
    unreadable = CpuMaxScan(1, 2, errors=1, first_error="x: bad")
    assert "1 cgroups unreadable (first: x: bad)" in describe(unreadable, True, "eevdf")


def test_warns_at_start_and_when_limits_appear_while_not_enforced(tmp_path: Path) -> None:
    enforced = [False]
    (tmp_path / "cgroup.controllers").write_text("cpu\n")
    watch = CpuMaxWatch(tmp_path, 60, lambda: enforced[0])
    with structlog.testing.capture_logs() as logs:
        watch.scan()  # nothing limited: nothing to say
        cgroup(tmp_path, "a", "20000 100000")
        watch.scan()  # 0 -> 1: warned
        cgroup(tmp_path, "b", "20000 100000")
        watch.scan()  # 1 -> 2: already said
        for name in ("a", "b"):
            (tmp_path / name / "cpu.max").write_text("max 100000")
        watch.scan()  # back to 0
        (tmp_path / "b" / "cpu.max").write_text("50000 100000")
        watch.scan()  # 0 -> 1 again: warned again
    warned = [e for e in logs if e["event"] == "cgroup_cpu_max_not_enforced"]
    assert [(e["limited"], e["examples"]) for e in warned] == [(1, ["a"]), (1, ["b"])]
    assert warned[0]["log_level"] == "warning"
    stats = watch.stats()
    assert (stats.limited, stats.enforced, stats.scans, stats.errors) == (1, False, 5, 0)


def test_no_warning_while_the_kernel_enforces(tmp_path: Path) -> None:
    cgroup(tmp_path, "a", "20000 100000")
    watch = CpuMaxWatch(tmp_path, 60, lambda: True)
    with structlog.testing.capture_logs() as logs:
        watch.scan()
    assert [e for e in logs if e["event"] == "cgroup_cpu_max_not_enforced"] == []
    assert watch.stats().enforced is True


def test_unreadable_root_is_logged_and_counted(tmp_path: Path) -> None:
    watch = CpuMaxWatch(tmp_path / "missing", 60, lambda: False)
    with structlog.testing.capture_logs() as logs:
        watch.scan()
        watch.scan()
    assert [e["event"] for e in logs] == ["cgroup_scan_unreadable"]  # once, not every interval
    stats = watch.stats()
    assert (stats.limited, stats.errors) == (None, 2)
    assert watch.health().ok is False


def test_rescans_on_its_own_thread(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu\n")
    watch = CpuMaxWatch(tmp_path, 0.01, lambda: True)
    watch.start()
    try:
        assert watch.stats().scans >= 1  # the first scan is done by start()
        cgroup(tmp_path, "a", "20000 100000")
        for _ in range(500):
            if watch.stats().limited == 1:
                break
            time.sleep(0.01)
    finally:
        watch.stop()
    assert watch.stats().limited == 1


class SchedExtUntrackedStandIn(DryRunBackend):
    """The sched_ext backend whose scheduler counted a cgroup it could not track: the agent reads the
    counter from the engine's frame, as it does the real scheduler's."""

    name = "sched_ext"

    @property
    def cpu_max_source(self) -> str:
        return cpu_max_source(False)

    def counters(self) -> dict[str, int]:
        return {**super().counters(), "cgroups_untracked": 1}


class SchedExt617StandIn(DryRunBackend):
    """The sched_ext backend on 6.17+: its object enforces cpu.max as the kernel passes it."""

    name = "sched_ext"

    @property
    def cpu_max_source(self) -> str:
        return cpu_max_source(True)


@pytest.mark.parametrize("backend, line, enforced", [
    (DryRunBackend, "2 cgroups limited; enforced by the kernel (dry-run backend)", 1.0),
    (SchedExt617StandIn, "2 cgroups limited; enforced by the sched_ext scheduler (cpu.max passed by the "
     "kernel, 6.17 or later)", 1.0),
    (SchedExtUntrackedStandIn, "2 cgroups limited; may NOT be enforced while the sched_ext scheduler runs "
     "(cgroups_untracked > 0: the cgroup map was full or the kernel keeps no cpu.max where the scheduler "
     "reads it; docs/scheduler.md)", 0.0),
])
def test_status_metrics_and_log_of_a_real_agent(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                backend: type[DryRunBackend], line: str,
                                                enforced: float) -> None:
    """What an operator sees: the `gthulhu-node status` line, the two gauges, and (sched_ext before 6.17
    when it cannot track every cgroup only) one warning at start."""
    from gthulhu_node import cli
    from gthulhu_node.agent import Agent
    from gthulhu_node.config import AgentConfig
    from gthulhu_node.metrics import Metrics

    cfg = AgentConfig.model_validate({
        "state": {"directory": str(tmp_path / "state")},
        "policies": {"directory": str(tmp_path / "policies")},
        "api": {"socket": str(tmp_path / "api.sock")},
        "watch": {"cgroup_root": str(tree(tmp_path / "cgroup"))},
    })
    agent = Agent(cfg, backend=backend())
    with structlog.testing.capture_logs() as logs:
        agent.start()
    logging = structlog.get_config()
    try:
        assert cli.main(["status", "--socket", str(cfg.api.socket)]) == 0
        metrics = Metrics()
        metrics.attach(agent)
        samples = {s.name: s.value for f in metrics.registry.collect() for s in f.samples}
    finally:
        structlog.configure(**logging)  # the CLI quiets logging to errors for the process
        agent.stop()
    assert f"  cgroup cpu.max: {line}\n" in capsys.readouterr().out
    assert samples["gthulhu_node_cgroup_cpu_max_limited"] == 2
    assert samples["gthulhu_node_cgroup_cpu_max_enforced"] == enforced
    assert samples["gthulhu_node_cgroup_scan_errors_total"] == 0
    warned = [e for e in logs if e["event"] == "cgroup_cpu_max_not_enforced"]
    assert len(warned) == (0 if enforced else 1)
