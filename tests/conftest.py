"""Shared pytest fixtures: the sched_ext lab VM (tests/vm/lab.py), for every kernel and shape of the matrix.

A lab guest is named by its init and a spec "KERNEL/SHAPE" (tests/vm/matrix.py: kernels 7.3 and 6.12,
shapes 2cpu and 8cpu-2numa). A test says which it needs by parametrizing the fixture:

    @pytest.mark.parametrize("lab", matrix.BOTH_KERNELS, indirect=True)
    def test_x(lab: Lab) -> None: ...

without that it gets the default guest (7.3/2cpu). Guests boot lazily, on the first test that asks for
them, once per session; tests that use no lab fixture never start qemu. Tests are run grouped by guest
(collection order within a group is kept) and each guest is powered off after its last test, so only one
emulated guest runs at a time: the machine has two cores. `lab` and `lab_systemd` check before each test
that the guest still answers and boot a fresh one if a previous test killed it, so one crash fails one
test, not every test after it. Module- or session-scoped fixtures of other test files can depend on
`lab_session` / `lab_systemd_session` (the default guests, without the per-test check).
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from tests.vm import matrix
from tests.vm.lab import Lab, close_all

_guests: dict[tuple[str, str], Lab] = {}
_last_item_of: dict[tuple[str, str], str] = {}

_FIXTURE_INIT = {"lab": "plain", "lab_session": "plain", "lab_systemd": "systemd",
                 "lab_systemd_session": "systemd"}


def _guest(init: str, spec: str) -> Lab:
    key = (init, spec)
    if key not in _guests:
        _guests[key] = matrix.make_lab(init, spec)
    return _guests[key]


@pytest.fixture(scope="session")
def lab_session() -> Lab:
    return _guest("plain", matrix.DEFAULT)


@pytest.fixture(scope="session")
def lab_systemd_session() -> Lab:
    return _guest("systemd", matrix.DEFAULT)


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> Lab:
    """A plain-init lab guest of the spec the test asks for (default 7.3/2cpu), alive at its start."""
    guest = _guest("plain", getattr(request, "param", matrix.DEFAULT))
    guest.ensure_alive()
    return guest


@pytest.fixture
def lab_systemd(request: pytest.FixtureRequest) -> Lab:
    """A lab guest with systemd as PID 1 (default 7.3/2cpu), alive at the start of the test."""
    guest = _guest("systemd", getattr(request, "param", matrix.DEFAULT))
    guest.ensure_alive()
    return guest


def _guest_key(item: pytest.Item) -> tuple[str, str] | None:
    names = getattr(item, "fixturenames", ())
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    for fixture, init in _FIXTURE_INIT.items():
        if fixture in names:
            return init, str(params.get(fixture, matrix.DEFAULT))
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the tests grouped by the guest they need (no-guest tests first, then each guest in the order
    it is first asked for), and remember each guest's last test so it can be powered off after it."""
    order: dict[tuple[str, str] | None, int] = {None: 0}
    for item in items:
        order.setdefault(_guest_key(item), len(order))
    items.sort(key=lambda item: order[_guest_key(item)])
    _last_item_of.clear()
    for item in items:
        key = _guest_key(item)
        if key is not None:
            _last_item_of[key] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    yield
    key = _guest_key(item)
    if key is not None and _last_item_of.get(key) == item.nodeid and key in _guests:
        _guests.pop(key).close()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_all()
