"""Running one guest-side scenario script in the lab and reading the JSON object it prints last."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

T = TypeVar("T")
_once: dict[tuple[str, str], Any] = {}


def run(lab: Any, script: str, name: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    result = lab.run([".venv/bin/python", script, name, *args], timeout=timeout)
    assert result.returncode == 0, f"{name} failed:\n{result.stderr[-4000:]}"
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert lines, f"{name} printed no result:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    data: dict[str, Any] = json.loads(lines[-1])
    return data


def once_per_guest(request: pytest.FixtureRequest, name: str, compute: Callable[[], T]) -> T:
    """`compute` once per kernel and shape for every test that reads the same guest run (keyed by the
    guest's spec: a closed guest's object id can be the next one's). A failure is kept too and raised
    again for the next test: computing it afresh would be one more rerun, which could pass where the
    first test's run failed."""
    key = (name, str(request.node.callspec.params["lab"]))
    if key not in _once:
        try:
            _once[key] = compute()
        except Exception as failure:
            _once[key] = _Failed(failure)
            raise
    cached = _once[key]
    if isinstance(cached, _Failed):
        raise cached.failure
    result: T = cached
    return result


class _Failed:
    """A `once_per_guest` computation that raised."""

    def __init__(self, failure: Exception) -> None:
        self.failure = failure


class LabRerun(UserWarning):
    """A lab bound that failed once and held when its scenario ran again: pytest's warnings summary lists
    each one, so a rerun is never silent."""


def once_more_on_failure(run: Callable[[], T], bounds: Callable[[T], None], what: str) -> T:
    """Run the scenario (`run`: its own assertions, the scheduler still loaded and healthy, fail the test
    at once) and check its `bounds`; if a bound fails, print it, report a LabRerun warning, run the
    scenario once more and check again, whose failure fails the test.

    Only for bounds on shares and counts that a TCG guest misses now and then when the host's other core
    runs the other lane's guest (each a few points past its bound, in code the run did not change: the
    lanes in docs/lab.md), never for an ejection or a crash. A defect that misses every run still fails;
    the warning keeps the rate visible."""
    out = run()
    try:
        bounds(out)
    except AssertionError as first:
        print(f"[rerun] {what}: the first run missed: {first}", flush=True)
        # the tail of an assertion pytest rewrote is the comparison that failed
        warnings.warn(LabRerun(f"{what} held only when run again; first run: ...{str(first)[-300:]}"),
                      stacklevel=2)
        out = run()
        bounds(out)
    return out
