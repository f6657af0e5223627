"""The benchmarks' progress files as a dead guest leaves them, and how a benchmark goes on after a guest death
(tests/bench/benchlab.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench import benchlab
from tests.bench.benchlab import _progress_rows
from tests.vm.lab import LabBootError, LabDied


def _row(case: str, rate: float) -> str:
    return json.dumps({"case": case, "result": {"steps_per_s": rate}})


def test_a_torn_last_line_is_left_out_and_the_rest_kept(tmp_path: Path) -> None:
    progress = tmp_path / "p.jsonl"
    progress.write_text(_row("EEVDF", 100.0) + "\n" + _row("ours", 130.0) + "\n" + '{"case": "ours no po')
    assert [r["case"] for r in _progress_rows(progress)] == ["EEVDF", "ours"]


def test_a_torn_line_before_the_last_is_an_error(tmp_path: Path) -> None:
    progress = tmp_path / "p.jsonl"
    progress.write_text(_row("EEVDF", 100.0) + "\n" + '{"case": "ou\n' + _row("ours", 130.0) + "\n")
    with pytest.raises(json.JSONDecodeError):
        _progress_rows(progress)


def test_no_file_means_no_runs_yet(tmp_path: Path) -> None:
    assert _progress_rows(tmp_path / "missing.jsonl") == []


class _Lab:
    """Stands in for the lab: its boots fail `hangs` times, then succeed."""

    def __init__(self, hangs: int) -> None:
        self.hangs = hangs
        self.boots = 0

    def ensure_alive(self) -> None:
        self.boots += 1
        if self.boots <= self.hangs:
            raise LabBootError("guest did not start its agent within 180 s", "SeaBIOS\nBooting from ROM...")


def test_a_boot_that_hangs_after_a_death_is_a_death_too_and_booted_again() -> None:
    """Before, survive's own boot raised LabBootError to the benchmark, which lost the run (2026-12-05)."""
    lab, deaths = _Lab(hangs=1), ["an earlier death"]
    benchlab.survive(lab, deaths, LabDied("kernel panic", "Oops: int3"), "during the run")  # type: ignore[arg-type]
    assert lab.boots == 2 and deaths == ["an earlier death", "kernel panic",
                                         "guest did not start its agent within 180 s"]


def test_past_the_allowance_the_last_death_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(benchlab, "DEATHS_ALLOWED", 2)
    lab, deaths = _Lab(hangs=5), []
    with pytest.raises(LabBootError):
        benchlab.survive(lab, deaths, LabDied("kernel panic", "Oops"), "during the run")  # type: ignore[arg-type]
    assert len(deaths) == 3 and lab.boots == 2


def test_a_death_prints_the_oops_lines_not_only_the_panics_tail(capsys: pytest.CaptureFixture[str]) -> None:
    """The console's last three lines were the panic's boilerplate ("Kernel panic - not syncing: Fatal
    exception in interrupt", the kernel offset): which death it was, the emulator's int3 or another, was
    in the oops above them and not printed (three deaths on 2026-12-07 read alike)."""
    console = "\n".join([
        "[ 1.0] boot", "[ 655.9] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI",
        "[ 655.9] RIP: 0010:enqueue_task_scx+0x1/0x2", *(f"[ 656.{i}] regs" for i in range(9)),
        "[ 656.9] PKRU: 55555554", "[ 656.9] Kernel panic - not syncing: Fatal exception in interrupt",
        "[ 656.9] Kernel Offset: 0x1da00000"])
    benchlab.survive(_Lab(hangs=0), [], LabDied("kernel panic", console), "after 23 runs")  # type: ignore[arg-type]
    printed = capsys.readouterr().out
    assert "Oops: int3" in printed and "RIP: 0010:enqueue_task_scx" in printed and "Kernel Offset" in printed
