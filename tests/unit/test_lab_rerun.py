"""The lab's one rerun (tests/vm/scenarios.py): a missed bound reruns the scenario once and is always
reported, a defect that misses every run still fails the test, a scenario's own failure (an ejection, a
crash) is never retried, and a run within its bounds runs once."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.vm.scenarios import LabRerun, once_more_on_failure, once_per_guest


def scenario(outcomes: list[bool]) -> tuple[list[int], Callable[[], int], Callable[[int], None]]:
    runs: list[int] = []

    def run() -> int:
        runs.append(1)
        return len(runs)

    def bounds(n: int) -> None:
        assert outcomes[n - 1], f"run {n} under its bound"

    return runs, run, bounds


def test_a_bound_missed_once_reruns_the_scenario_and_is_reported() -> None:
    runs, run, bounds = scenario([False, True])
    with pytest.warns(LabRerun, match="run 1 under its bound"):
        assert once_more_on_failure(run, bounds, "the shares") == 2
    assert len(runs) == 2


def test_a_bound_missed_every_run_fails_the_test() -> None:
    runs, run, bounds = scenario([False, False, True])
    with pytest.warns(LabRerun), pytest.raises(AssertionError, match="run 2 under its bound"):
        once_more_on_failure(run, bounds, "the shares")
    assert len(runs) == 2


def test_the_scenarios_own_failure_is_never_retried(recwarn: pytest.WarningsRecorder) -> None:
    runs: list[int] = []

    def ejected() -> int:
        runs.append(1)
        raise AssertionError("the scheduler was ejected")

    with pytest.raises(AssertionError, match="ejected"):
        once_more_on_failure(ejected, lambda n: None, "the shares")
    assert len(runs) == 1 and not recwarn.list


def test_a_run_within_its_bounds_runs_once_and_says_nothing(recwarn: pytest.WarningsRecorder) -> None:
    runs, run, bounds = scenario([True])
    assert once_more_on_failure(run, bounds, "the shares") == 1
    assert len(runs) == 1 and not recwarn.list


class _Request:
    """What once_per_guest reads of pytest's request: the guest's spec among the test's parameters."""

    def __init__(self, lab: str) -> None:
        self.node = type("Node", (), {"callspec": type("Spec", (), {"params": {"lab": lab}})()})()


def test_a_guest_run_read_by_two_tests_runs_once() -> None:
    runs: list[int] = []

    def run() -> int:
        runs.append(1)
        return len(runs)

    for _ in range(2):
        assert once_per_guest(_Request("7.3/2cpu"), "shared-ok", run) == 1  # type: ignore[arg-type]
    assert len(runs) == 1


def test_a_failed_guest_run_fails_the_next_test_without_running_again() -> None:
    """The second test that reads a failed run gets the same failure: running it afresh would be one more
    rerun past the one the bound allows (before, each test ran the scenario again)."""
    runs: list[int] = []

    def failing() -> int:
        runs.append(1)
        raise AssertionError(f"run {len(runs)} missed")

    for _ in range(2):
        with pytest.raises(AssertionError, match="run 1 missed"):
            once_per_guest(_Request("6.12/2cpu"), "shared-failing", failing)  # type: ignore[arg-type]
    assert len(runs) == 1
