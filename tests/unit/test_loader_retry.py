"""A load the kernel ejects for a host-wide stall is tried again; a refusal is not.

The make test of 2026-12-07 lost a run to an RCU CPU stall the kernel reported while it enabled the
scheduler (the lab's console: khugepaged held a grace period 21 s); before this the loader raised at once,
and `backend: auto` would have fallen back to the eevdf backend for good."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.backends.base import BackendUnavailable, SchedulerRefused
from gthulhu_node.scheduler import loader
from gthulhu_node.scheduler.loader import EjectedWhileLoading, LoadSettings, not_enabled

RCU_7_3 = "RCU CPU stall on CPUs ()"  # the CI run's exit message (7.3.4)


def _attempts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, outcomes: list[Any]) -> list[bool]:
    """The real `load` and `_load_once` (lock, state check) around a `_load_locked` that gives the outcomes
    in turn (an exception is raised, as `_load_locked` does after detaching, which releases the lock).
    Returns, per attempt, whether the lock was held by it: another agent could not take it then."""
    held: list[bool] = []
    lock_path = tmp_path / "scheduler.lock"

    def load_locked(settings: LoadSettings, lock: Any, root: Path) -> Any:
        held.append(not loader._Lock(lock_path).try_acquire())
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            lock.release()
            raise outcome
        return outcome

    monkeypatch.setattr(loader, "check_support", lambda root: None)
    monkeypatch.setattr(loader, "sched_ext_state", lambda root: ("disabled", ""))
    monkeypatch.setattr(loader, "_load_locked", load_locked)
    monkeypatch.setattr(loader, "LOAD_RETRY_PAUSE_S", 0.0)
    return held


def _load(tmp_path: Path) -> Any:
    return loader.load(LoadSettings(), lock_path=tmp_path / "scheduler.lock")


def _rcu_stall() -> SchedulerRefused:
    return not_enabled("disabled", "", 1024, "runtime error", RCU_7_3)


def test_an_ejection_while_loading_is_loaded_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    loaded = object()
    held = _attempts(monkeypatch, tmp_path, [_rcu_stall(), loaded])
    assert _load(tmp_path) is loaded
    assert held == [True, True], "each attempt holds the lock again"


def test_ejections_on_every_attempt_end_in_the_ejection(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    held = _attempts(monkeypatch, tmp_path, [_rcu_stall() for _ in range(loader.LOAD_ATTEMPTS + 1)])
    with pytest.raises(EjectedWhileLoading, match="RCU CPU stall"):
        _load(tmp_path)
    assert len(held) == loader.LOAD_ATTEMPTS
    # still a refusal for `backend: auto`, which falls back on SchedulerRefused only
    assert issubclass(EjectedWhileLoading, SchedulerRefused)
    assert loader._Lock(tmp_path / "scheduler.lock").try_acquire(), "released after the last attempt"


def test_a_refusal_is_not_tried_again(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    held = _attempts(monkeypatch, tmp_path, [SchedulerRefused("the kernel refused the scheduler: verifier"),
                                             object()])
    with pytest.raises(SchedulerRefused, match="verifier") as caught:
        _load(tmp_path)
    assert not isinstance(caught.value, EjectedWhileLoading)
    assert held == [True]


def test_a_lock_another_agent_took_between_attempts_ends_the_load(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    _attempts(monkeypatch, tmp_path, [_rcu_stall(), object()])
    other = loader._Lock(tmp_path / "scheduler.lock")
    monkeypatch.setattr(loader.time, "sleep", lambda _s: other.try_acquire())
    with pytest.raises(BackendUnavailable, match="another gthulhu-node agent holds"):
        _load(tmp_path)


@pytest.mark.parametrize(("kind", "msg", "again"), [
    (1024, RCU_7_3, True),
    (1024, "RCU CPU stall detected!", True),  # before 7.x
    (1024, "soft lockup - CPU#1 stuck for 23s", True),
    (1024, "hard lockup - CPU 0", True),
    (1026, "gthulhu[12] failed to run for 30.1s", True),  # the watchdog: the emulator's stalls too
    (1024, "ops.init() failed (-12)", False),  # ours, the same on every attempt
    (1024, "invalid CPU 7 for SCX_DSQ_LOCAL_ON", False),
    (1025, "stuck task", False),  # SCX_EXIT_ERROR_BPF: our scx_bpf_error
    (64, "", False),  # SCX_EXIT_UNREG: someone unregistered it
    (0, "", False),  # no exit recorded
])
def test_only_host_wide_stalls_are_tried_again(kind: int, msg: str, again: bool) -> None:
    err = not_enabled("disabled", "", kind, "runtime error", msg)
    assert isinstance(err, EjectedWhileLoading) is again, err
    assert isinstance(err, SchedulerRefused)
    assert msg in str(err)
