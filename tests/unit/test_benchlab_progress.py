"""The benchmarks' progress files as a dead guest leaves them (tests/bench/benchlab.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench.benchlab import _progress_rows


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
