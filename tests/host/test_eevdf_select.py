"""Backend choice on this machine's kernel (6.18, no sched_ext): `auto` must pick the EEVDF backend, say
why, and fall back to the dry run with the probe's reason when the probe fails. Nothing is started here,
and the one test that starts the selected backend touches only a thread it created."""

from __future__ import annotations

from pathlib import Path

import pytest

from gthulhu_node.backends import sched_attr
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.backends.eevdf import JOURNAL_NAME, EevdfBackend
from gthulhu_node.backends.eevdf_journal import read_journal
from gthulhu_node.backends.select import select_backend
from gthulhu_node.config import AgentConfig
from tests.host.eevdf_threads import Worker

pytestmark = pytest.mark.host


def test_auto_picks_eevdf_without_sched_ext_and_says_why(tmp_path: Path) -> None:
    backend, reason = select_backend(AgentConfig(), sysfs=tmp_path / "no-sched-ext")
    assert isinstance(backend, EevdfBackend) and backend.name == "eevdf"
    assert "no sched_ext" in reason and "eevdf" in reason and "honours slice requests" in reason


def test_eevdf_can_be_forced() -> None:
    backend, reason = select_backend(AgentConfig.model_validate({"backend": {"kind": "eevdf"}}))
    assert isinstance(backend, EevdfBackend) and "forced" in reason


def test_auto_falls_back_to_dry_run_with_the_probe_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sched_attr, "probe", lambda: sched_attr.Probe(False, "kernel 6.6 ignores slices"))
    backend, reason = select_backend(AgentConfig(), sysfs=tmp_path / "no-sched-ext")
    assert isinstance(backend, DryRunBackend)
    assert "eevdf is unavailable (kernel 6.6 ignores slices)" in reason


def test_selected_backend_keeps_its_journal_in_the_state_directory(tmp_path: Path) -> None:
    config = AgentConfig.model_validate({"backend": {"kind": "eevdf"}, "state": {"directory": str(tmp_path)}})
    backend, _ = select_backend(config)
    worker = Worker()
    backend.start()
    try:
        backend.apply({worker.key(): worker.entry(20, 0)}, [])
        assert [r.tid for r in read_journal(tmp_path / JOURNAL_NAME)] == [worker.tid]
    finally:
        backend.stop()
        worker.stop()
    assert read_journal(tmp_path / JOURNAL_NAME) == []
