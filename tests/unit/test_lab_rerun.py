"""The lab's one rerun (tests/vm/scenarios.py): a failure is retried once and always reported, a defect
that fails every run still fails the test, and a passing check runs once."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.vm.scenarios import LabRerun, once_more_on_failure


def checks(outcomes: list[bool]) -> tuple[list[int], Callable[[], None]]:
    runs: list[int] = []

    def check() -> None:
        runs.append(1)
        assert outcomes[len(runs) - 1], f"run {len(runs)} under its bound"

    return runs, check


def test_a_check_that_fails_once_is_run_again_and_reported() -> None:
    runs, check = checks([False, True])
    with pytest.warns(LabRerun, match="run 1 under its bound"):
        once_more_on_failure(check, "the shares")
    assert len(runs) == 2


def test_a_check_that_fails_every_run_fails_the_test() -> None:
    runs, check = checks([False, False, True])
    with pytest.warns(LabRerun), pytest.raises(AssertionError, match="run 2 under its bound"):
        once_more_on_failure(check, "the shares")
    assert len(runs) == 2


def test_a_passing_check_runs_once_and_says_nothing(recwarn: pytest.WarningsRecorder) -> None:
    runs, check = checks([True])
    once_more_on_failure(check, "the shares")
    assert len(runs) == 1 and not recwarn.list
