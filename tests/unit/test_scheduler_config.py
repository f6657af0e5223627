"""Scheduler settings the kernel or the guard cannot honour are refused when the config is loaded, with
the valid range, not at load time by the kernel (or silently, as boost_share_percent 100 was)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gthulhu_node import config


def load(tmp_path: Path, body: str) -> config.AgentConfig:
    path = tmp_path / "config.yaml"
    path.write_text(body)
    return config.load(path)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("scheduler: {watchdog_timeout_ms: 60000}", "30000"),
        ("scheduler: {watchdog_timeout_ms: 500}", "outside 1000-30000"),
        ("scheduler: {boost_window_ns: 500000000, watchdog_timeout_ms: 2000}", "outside 5000-30000"),
        ("scheduler: {boost_share_percent: 100}", "less than or equal to 95"),
        ("scheduler: {boost_share_percent: 0}", "greater than or equal to 1"),
        ("scheduler: {ejection_limit: 0}", "greater than or equal to 1"),
    ],
)
def test_values_the_scheduler_cannot_honour_are_refused_with_the_range(
    tmp_path: Path, body: str, needle: str
) -> None:
    with pytest.raises(config.ConfigError) as err:
        load(tmp_path, body + "\n")
    assert needle in str(err.value)


def test_values_in_range_load(tmp_path: Path) -> None:
    body = "scheduler: {watchdog_timeout_ms: 2000, boost_share_percent: 95, ejection_limit: 5}\n"
    cfg = load(tmp_path, body)
    assert cfg.scheduler.watchdog_timeout_ms == 2000 and cfg.scheduler.boost_share_percent == 95
    assert load(tmp_path, "scheduler: {watchdog_timeout_ms: 0}\n").scheduler.watchdog_timeout_ms == 0
