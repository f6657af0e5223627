"""Shared pytest fixtures: the sched_ext lab VM (tests/vm/lab.py).

The guests boot lazily, on the first test that asks for them, once per session; tests that do not use a
lab fixture never start qemu. `lab` and `lab_systemd` check before each test that the guest still answers
and boot a fresh one if a previous test killed it, so one crash fails one test, not every test after it.
Module- or session-scoped fixtures of other test files can depend on `lab_session` /
`lab_systemd_session` (the same guests, without the per-test check).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.vm.lab import Lab, close_all


@pytest.fixture(scope="session")
def lab_session() -> Iterator[Lab]:
    lab = Lab("plain")
    yield lab
    lab.close()


@pytest.fixture(scope="session")
def lab_systemd_session() -> Iterator[Lab]:
    lab = Lab("systemd")
    yield lab
    lab.close()


@pytest.fixture
def lab(lab_session: Lab) -> Lab:
    """The plain-init lab guest (booted once per session), alive at the start of the test."""
    lab_session.ensure_alive()
    return lab_session


@pytest.fixture
def lab_systemd(lab_systemd_session: Lab) -> Lab:
    """The lab guest with systemd as PID 1 (booted once per session), alive at the start of the test."""
    lab_systemd_session.ensure_alive()
    return lab_systemd_session


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_all()
