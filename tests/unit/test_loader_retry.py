"""A load the kernel ejects on its own verdict is tried again; a refusal is not.

The make test of 2026-12-07 lost a run to an RCU CPU stall the kernel reported while it enabled the
scheduler (the lab's console: khugepaged held a grace period 21 s); before this the loader raised at once,
and `backend: auto` would have fallen back to the eevdf backend for good."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.backends.base import SchedulerRefused
from gthulhu_node.scheduler import loader
from gthulhu_node.scheduler.loader import EjectedWhileLoading, LoadSettings


def _attempts(monkeypatch: pytest.MonkeyPatch, outcomes: list[Any]) -> list[int]:
    """`_load_once` gives the outcomes in turn (an exception is raised); returns the call log."""
    calls: list[int] = []

    def once(settings: LoadSettings, root: Path, lock_path: Path) -> Any:
        calls.append(len(calls) + 1)
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(loader, "_load_once", once)
    monkeypatch.setattr(loader, "LOAD_RETRY_PAUSE_S", 0.0)
    return calls


def _rcu_stall() -> EjectedWhileLoading:
    return EjectedWhileLoading("scheduler did not stay enabled (state disabled, ops ''): runtime error "
                               "RCU CPU stall on CPUs ()", 1024)


def test_an_ejection_while_loading_is_loaded_again(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = object()
    calls = _attempts(monkeypatch, [_rcu_stall(), loaded])
    assert loader.load(LoadSettings()) is loaded
    assert calls == [1, 2]


def test_ejections_on_every_attempt_end_in_the_ejection(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _attempts(monkeypatch, [_rcu_stall() for _ in range(loader.LOAD_ATTEMPTS + 1)])
    with pytest.raises(EjectedWhileLoading, match="RCU CPU stall"):
        loader.load(LoadSettings())
    assert len(calls) == loader.LOAD_ATTEMPTS
    # still a refusal for `backend: auto`, which falls back on SchedulerRefused only
    assert issubclass(EjectedWhileLoading, SchedulerRefused)


def test_a_refusal_is_not_tried_again(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _attempts(monkeypatch, [SchedulerRefused("the kernel refused the scheduler: verifier"), object()])
    with pytest.raises(SchedulerRefused, match="verifier"):
        loader.load(LoadSettings())
    assert calls == [1]


@pytest.mark.parametrize(("kind", "again"),
                         [(1024, True), (1026, True), (1025, False), (64, False), (0, False)])
def test_only_the_kernels_own_verdicts_count(kind: int, again: bool) -> None:
    """SCX_EXIT_ERROR and SCX_EXIT_ERROR_STALL are the kernel's; SCX_EXIT_ERROR_BPF is our own
    scx_bpf_error (the same on every attempt), SCX_EXIT_UNREG someone unregistering it."""
    assert (kind in loader.KERNEL_VERDICTS) is again
