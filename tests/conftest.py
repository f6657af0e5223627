"""Shared pytest fixtures: the sched_ext lab VM (tests/vm/lab.py), for every kernel and shape of the matrix.

A lab guest is named by its init and a spec "KERNEL/SHAPE" (tests/vm/matrix.py: kernels 7.3 and 6.12,
shapes 2cpu and 8cpu-2numa). A test says which it needs by parametrizing the fixture:

    @pytest.mark.parametrize("lab", matrix.BOTH_KERNELS, indirect=True)
    def test_x(lab: Lab) -> None: ...

without that it gets the default guest (7.3/2cpu). Guests boot lazily, on the first test that asks for
them, once per session (per xdist worker); tests that use no lab fixture never start qemu. Tests are run
grouped by guest (collection order within a group is kept) and each guest is powered off after its last
test, so a pytest process runs one emulated guest at a time. `lab` and `lab_systemd` check before each test
that the guest still answers and boot a fresh one if a previous test killed it, so one crash fails one
test, not every test after it. Module- or session-scoped fixtures of other test files can depend on
`lab_session` / `lab_systemd_session` (the default guests, without the per-test check).

Two lanes (`make test` runs `pytest -n 2 --dist loadgroup`, pytest-xdist): a guest is single-threaded TCG,
so it uses one host core, and the machine has two. Every test of one guest gets the xdist group named
after the guest (`plain:7.3/2cpu`), the host tests share one group `host` (their agents match threads by
name across the whole host, so two at once would see each other's threads), and the unit tests have none
(they spread freely). Each group runs whole on one worker, which owns its guests and powers each off after
its last test there. The collection is ordered longest group first (an estimate from the tests' counts,
`_estimate`) and xdist keeps that order (`--no-loadscope-reorder` is set here), so an idle worker always
takes the longest group left: the 7.3/2cpu plain guest fills one lane, 6.12/2cpu, the host tests, the
systemd guest and the 8-vCPU guest the other (docs/lab.md has the times). `-n 0` or `-p no:xdist` runs
everything in one process, one guest at a time, as before.
"""

from __future__ import annotations

from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from tests import lanes
from tests.vm import matrix
from tests.vm.lab import Lab, close_all

GuestKey = tuple[str, str, str]  # init, spec, instance ("" unless the test file asks for its own guest)

_guests: dict[GuestKey, Lab] = {}
_last_item_of: dict[GuestKey, pytest.Item] = {}

_FIXTURE_INIT = {"lab": "plain", "lab_session": "plain", "lab_systemd": "systemd",
                 "lab_systemd_session": "systemd"}


def _guest(key: GuestKey) -> Lab:
    if key not in _guests:
        _guests[key] = matrix.make_lab(key[0], key[1])
    return _guests[key]


def _instance(node: pytest.Item | pytest.Collector) -> str:
    """The `lab_guest(name)` mark of a test or its file: its own guest of the same init and spec, so a
    long file can run in the other lane beside the rest of its guest's tests (docs/lab.md, "Two lanes")."""
    mark = node.get_closest_marker("lab_guest")
    return str(mark.args[0]) if mark is not None else ""


@pytest.fixture(scope="session")
def lab_session() -> Lab:
    return _guest(("plain", matrix.DEFAULT, ""))


@pytest.fixture(scope="session")
def lab_systemd_session() -> Lab:
    return _guest(("systemd", matrix.DEFAULT, ""))


@pytest.fixture
def lab(request: pytest.FixtureRequest) -> Lab:
    """A plain-init lab guest of the spec the test asks for (default 7.3/2cpu), alive at its start."""
    guest = _guest(("plain", getattr(request, "param", matrix.DEFAULT), _instance(request.node)))
    guest.ensure_alive()
    return guest


@pytest.fixture
def lab_systemd(request: pytest.FixtureRequest) -> Lab:
    """A lab guest with systemd as PID 1 (default 7.3/2cpu), alive at the start of the test."""
    guest = _guest(("systemd", getattr(request, "param", matrix.DEFAULT), _instance(request.node)))
    guest.ensure_alive()
    return guest


def _guest_key(item: pytest.Item) -> GuestKey | None:
    """The guest (init, spec) a test runs on, or None. Only this file's fixtures count: a test file may
    define a fixture of the same name for something else (test_manager_contract.py's `lab` is a node's
    state directory on the host), and grouping its tests with a guest would put host tests in a VM lane."""
    names = getattr(item, "fixturenames", ())
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    defs = fixtureinfo.name2fixturedefs if fixtureinfo is not None else {}
    callspec = getattr(item, "callspec", None)
    params = callspec.params if callspec is not None else {}
    for fixture, init in _FIXTURE_INIT.items():
        if fixture not in names:
            continue
        resolved = defs.get(fixture)
        if resolved and getattr(resolved[-1].func, "__module__", __name__) != __name__:
            continue
        # the session fixtures are the default guests, whatever the test's marks
        instance = "" if fixture.endswith("_session") else _instance(item)
        return init, str(params.get(fixture, matrix.DEFAULT)), instance
    return None


# What a test costs, to order the groups longest first; measured in make test's run of 2026-12-01
# (docs/lab.md): 7.3/2cpu plain 38 tests in 17 min, 6.12/2cpu 16 in 8.4, systemd 7 in 3.3 (with its
# 60 s boot), 8cpu-2numa 5 in 3.3; the host tests 133 in 160-340 s. Only the order matters, not the numbers.
_SECONDS_PER_VM_TEST = 30.0
_SECONDS_PER_WIDE_VM_TEST = 40.0  # 8 vCPUs on one host thread
_SECONDS_PER_HOST_TEST = 1.5
HOST_GROUP = "host"


def _group(item: pytest.Item) -> str | None:
    """The xdist group of a test: its guest's name, `host` for other tests that run on this machine's
    kernel (agents, processes, cgroups), None for the unit tests (pure, spread over both lanes)."""
    key = _guest_key(item)
    if key is not None:
        return f"{key[0]}:{key[1]}" + (f"#{key[2]}" if key[2] else "")
    if "unit" in item.path.parts:
        return None
    return HOST_GROUP


def _estimate(item: pytest.Item, group: str | None) -> float:
    """Seconds a test takes, roughly: its `lab_seconds(n)` mark (a test far longer than its guest's
    usual one), else the usual figure for where it runs (see _SECONDS_PER_VM_TEST)."""
    mark = item.get_closest_marker("lab_seconds")
    if mark is not None:
        return float(mark.args[0])
    if group is None or group == HOST_GROUP:
        return _SECONDS_PER_HOST_TEST
    spec = group.partition(":")[2].partition("#")[0]
    return _SECONDS_PER_WIDE_VM_TEST if matrix.parse(spec)[1].cpus > 2 else _SECONDS_PER_VM_TEST


_PLAN_FOLDER = pytest.StashKey[Path]()
_clock: list[lanes.LaneClock] = []  # the controller's, under xdist (logreport hooks get no config)


def pytest_configure(config: pytest.Config) -> None:
    """The xdist group marker exists without xdist too (-p no:xdist with --strict-markers). Under
    `-n N --dist loadgroup` the controller makes the folder the workers write their lane plan into
    (tests/lanes.py)."""
    config.addinivalue_line("markers", "xdist_group(name): the tests of one lane group (tests/conftest.py)")
    config.addinivalue_line("markers", "lab_guest(name): the file's own guest instance (tests/conftest.py)")
    config.addinivalue_line("markers", "lab_seconds(n): one test's cost, to order lanes (tests/conftest.py)")
    option = config.option
    distributed = getattr(option, "dist", "no") == "loadgroup" and bool(getattr(option, "tx", None))
    if distributed and not hasattr(config, "workerinput"):
        config.stash[_PLAN_FOLDER] = folder = lanes.new_plan_folder()
        _clock[:] = [lanes.LaneClock(folder)]


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = config.stash.get(_PLAN_FOLDER, None)
    if folder is not None:
        lanes.remove_plan_folder(folder)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist (controller): tell each worker where to write its lane plan."""
    folder = node.config.stash.get(_PLAN_FOLDER, None)
    if folder is not None:
        node.workerinput[lanes.PLAN_KEY] = str(folder)


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist (controller): under --dist loadgroup, our lanes (tests/lanes.py) instead of xdist's loadgroup,
    which does not group with pytest 9.2. tryfirst: xdist's own implementation would answer first."""
    folder = config.stash.get(_PLAN_FOLDER, None)
    return None if folder is None else lanes.make_scheduler(config, log, folder)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Order the tests by group, the longest group first (collection order kept within a group), give
    each grouped test its xdist group, and remember each guest's last test so it can be powered off after
    it. tryfirst: xdist's worker reads the marks in its own hook of this name."""
    groups = [_group(item) for item in items]
    seconds: dict[str | None, float] = {}
    first: dict[str | None, int] = {}
    for i, (item, group) in enumerate(zip(items, groups, strict=True)):
        seconds[group] = seconds.get(group, 0.0) + _estimate(item, group)
        first.setdefault(group, i)
    # Ungrouped (unit) tests go last whatever their count: each is its own small unit of work, filling
    # whichever lane ends first.
    rank = {g: (g is None, -total, first[g]) for g, total in seconds.items()}
    order = sorted(range(len(items)), key=lambda i: (rank[groups[i]], i))
    items[:] = [items[i] for i in order]
    groups = [groups[i] for i in order]
    _last_item_of.clear()
    for item, group in zip(items, groups, strict=True):
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))
        key = _guest_key(item)
        if key is not None:
            _last_item_of[key] = item


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """xdist (worker): write the lane plan before xdist reports the collection (tryfirst), so it is there
    when the controller schedules."""
    workerinput = getattr(session.config, "workerinput", {})
    if lanes.PLAN_KEY in workerinput:
        lanes.write_plan(Path(workerinput[lanes.PLAN_KEY]), str(workerinput["workerid"]), session.items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """Power a guest off after its last test. Under xdist a guest's group runs whole on one worker, so
    that worker runs its last test. Items are compared as objects: xdist's worker hook may append the
    group to node ids after ours (it does with pytest before 9.2)."""
    yield
    key = _guest_key(item)
    if key is not None and _last_item_of.get(key) is item and key in _guests:
        _guests.pop(key).close()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for clock in _clock:
        clock.add(report)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """Under xdist: each lane's time, per group (tests/lanes.py LaneClock)."""
    for clock in _clock:
        if clock.seconds:
            terminalreporter.write_sep("-", "lanes")
            for line in clock.lines():
                terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    close_all()
