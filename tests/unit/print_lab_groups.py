"""A pytest plugin for tests/unit/test_lab_groups.py: prints each collected test's xdist group. Loaded with
`-p tests.unit.print_lab_groups` in a separate pytest process, so the lab fixtures' state in tests/conftest.py
(which guest to power off after which test) is never touched by a nested session."""

from __future__ import annotations

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:
        mark = item.get_closest_marker("xdist_group")
        print(f"GROUP {item.nodeid} {mark.args[0] if mark else '-'}")
