"""Configuration sections: settings that moved keep working at their old place, with a warning."""

from __future__ import annotations

from gthulhu_node.agent import engine_for
from gthulhu_node.config import AgentConfig


def test_reload_backoff_lives_under_backend() -> None:
    """The backoff restarts any backend that stopped working, not only the sched_ext scheduler."""
    config = AgentConfig.model_validate(
        {"backend": {"reload_backoff_initial_s": 2, "reload_backoff_max_s": 9}}
    )
    assert (config.backend.reload_backoff_initial_s, config.backend.reload_backoff_max_s) == (2, 9)
    assert config.deprecations() == []
    defaults = AgentConfig()
    assert (defaults.backend.reload_backoff_initial_s, defaults.backend.reload_backoff_max_s) == (1.0, 60.0)


def test_the_old_scheduler_keys_still_work_and_are_reported() -> None:
    config = AgentConfig.model_validate({"scheduler": {"reload_backoff_initial_s": 0.5}})
    assert config.backend.reload_backoff_initial_s == 0.5
    assert config.backend.reload_backoff_max_s == 60.0
    (note,) = config.deprecations()
    assert "scheduler.reload_backoff_initial_s is deprecated" in note
    assert "backend.reload_backoff_initial_s" in note
    engine = engine_for(None, config)  # type: ignore[arg-type]  # only the settings are read
    try:
        assert engine.reload_backoff_initial_s == 0.5
    finally:
        engine.close()


def test_the_new_key_wins_over_the_old_one() -> None:
    config = AgentConfig.model_validate(
        {"scheduler": {"reload_backoff_max_s": 5}, "backend": {"reload_backoff_max_s": 7}}
    )
    assert config.backend.reload_backoff_max_s == 7
    (note,) = config.deprecations()
    assert "ignored" in note
