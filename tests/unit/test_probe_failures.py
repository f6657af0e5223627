"""The probe's one-line failures, and its filter bookkeeping, without loading anything into the kernel.

BCC missing is simulated by making `import bcc` fail: what is under test is our message and exit code,
not BCC.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gthulhu_node import cli
from gthulhu_node.probe import preflight
from gthulhu_node.probe.histogram import WaitHistogram
from gthulhu_node.probe.session import Session
from gthulhu_node.probe.targets import Target


def test_bcc_missing_is_one_line_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "bcc", None)  # makes `import bcc` raise ImportError
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 0)
    rc = cli.main(["probe", "--regex", "x", "--duration", "1"])
    err = capsys.readouterr().err
    assert rc != 0
    assert err.count("\n") == 1
    assert "BCC is not installed" in err and "python3-bpfcc" in err


def test_not_root_comes_first(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 65534)
    rc = cli.main(["probe", "--regex", "x", "--duration", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "needs root" in err


def test_headers_missing_names_the_release_and_package(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 0)
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)
    monkeypatch.setattr(preflight, "KHEADERS", tmp_path / "no-kheaders")
    release = preflight.os.uname().release
    with pytest.raises(preflight.ProbeUnavailable) as info:
        preflight.check(modules_root=tmp_path)
    assert str(info.value).endswith(f"install linux-headers-{release}")
    (tmp_path / release / "build").mkdir(parents=True)
    preflight.check(modules_root=tmp_path)  # headers there: no complaint


def test_bad_duration(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["probe", "--regex", "x", "--duration", "0"]) == 2
    assert "--duration" in capsys.readouterr().err


class _MapOnlyProbe:
    """Stands in for RunqueueProbe's target map (a dict), with a capacity like the BPF hash map."""

    def __init__(self, capacity: int = 100) -> None:
        self.map: dict[int, int] = {}
        self.capacity = capacity
        self.map_full_errors = 0

    def add_target(self, tid: int, intent: int) -> bool:
        if len(self.map) >= self.capacity:
            self.map_full_errors += 1
            return False
        self.map[tid] = intent
        return True

    def remove_target(self, tid: int) -> None:
        self.map.pop(tid, None)

    def target_tids(self) -> dict[int, int]:
        return dict(self.map)

    def intent_histograms(self) -> dict[int, WaitHistogram]:
        return {}

    def thread_histograms(self) -> dict[int, WaitHistogram]:
        return {}


class _Script:
    def __init__(self, steps: list[dict[int, Target]]) -> None:
        self.steps = steps

    def poll(self) -> dict[int, Target]:
        return self.steps.pop(0)

    def close(self) -> None:
        pass


def _t(tid: int, intent: str, tgid: int | None = None) -> Target:
    return Target(tid, tgid or tid, f"t{tid}", intent)


def test_session_follows_the_source_into_the_map() -> None:
    a, b = "local/a", "local/b"
    steps = [
        {1: _t(1, a), 2: _t(2, a)},
        {1: _t(1, a), 2: _t(2, a), 3: _t(3, b)},  # a thread appears
        {1: _t(1, a), 3: _t(3, b)},  # one exits
        {1: _t(1, b), 3: _t(3, b)},  # one moves to another intent
    ]
    probe = _MapOnlyProbe()
    session = Session(probe, _Script(steps))  # type: ignore[arg-type]
    session.sync()
    assert probe.map == {1: 0, 2: 0}
    session.sync()
    assert probe.map == {1: 0, 2: 0, 3: 1}
    session.sync()
    assert probe.map == {1: 0, 3: 1}
    session.sync()
    assert probe.map == {1: 1, 3: 1}
    result = session.result()
    assert result.tids_at_end == [1, 3]
    assert (result.filter_added, result.filter_removed) == (4, 2)
    removed = [r.target.tid for r, _ in result.threads if r.removed_s is not None]
    assert sorted(removed) == [1, 2]


def test_session_counts_a_full_map() -> None:
    probe = _MapOnlyProbe(capacity=1)
    session = Session(probe, _Script([{1: _t(1, "x/a"), 2: _t(2, "x/a")}]))  # type: ignore[arg-type]
    session.sync()
    assert len(probe.map) == 1
    assert session.result().map_full_errors == 1


def test_a_headers_folder_that_cannot_be_read_is_a_clear_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Seen in the systemd lab with ProtectKernelModules=yes: Path.is_dir raised PermissionError on
    # /lib/modules/<release>/build, and the agent's probe thread logged a traceback as probe_failed.
    monkeypatch.setattr(preflight.os, "geteuid", lambda: 0)
    monkeypatch.delenv("BCC_KERNEL_SOURCE", raising=False)

    def refused(_: Path) -> bool:
        raise PermissionError(13, "Permission denied", "/lib/modules/x/build")

    monkeypatch.setattr(preflight.Path, "is_dir", refused)
    with pytest.raises(preflight.ProbeUnavailable) as info:
        preflight.check(modules_root=tmp_path)
    assert "Permission denied" in str(info.value) and "ProtectKernelModules" in str(info.value)
