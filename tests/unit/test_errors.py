"""One exception base, a few kinds, and one mapping per edge (gthulhu_node/errors.py): every exception the
package defines is answered by its kind, the same at the gRPC server, the REST app and the command line."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import grpc
import pytest

import gthulhu_node
from gthulhu_node import errors
from gthulhu_node.api.server import grpc_status
from gthulhu_node.backends.base import BackendUnavailable, MapFullError, SchedulerRefused
from gthulhu_node.cli import exit_code
from gthulhu_node.errors import EDGES, GthulhuError, kind_of
from gthulhu_node.intents.store_errors import (
    IntentNotFoundError,
    LimitError,
    StaleGenerationError,
    StateTooLargeError,
    StoreError,
)
from gthulhu_node.rest.envelope import http_status


def package_exceptions() -> list[type[BaseException]]:
    """Every exception class defined in gthulhu_node (generated gRPC code aside)."""
    found: dict[str, type[BaseException]] = {}
    for info in pkgutil.walk_packages(gthulhu_node.__path__, "gthulhu_node."):
        if ".gen" in info.name or info.name == "gthulhu_node.__main__":
            continue
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__.startswith("gthulhu_node."):
                found[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [found[k] for k in sorted(found)]


def test_the_walk_finds_the_package_exceptions() -> None:
    names = {c.__name__ for c in package_exceptions()}
    assert {"IntentValidationError", "SchedulerRefused", "TokenError", "ConfigError", "ProbeUnavailable",
            "ConnectError", "LibbpfError", "EngineStopped", "DropRefused"} <= names
    assert len(names) >= 30


# bases that only group classes of one module, never raised themselves: each subclass has its kind
GROUPS = {StoreError}


@pytest.mark.parametrize("cls", package_exceptions(), ids=lambda c: c.__qualname__)
def test_every_exception_derives_from_the_base_through_one_kind(cls: type[BaseException]) -> None:
    assert issubclass(cls, GthulhuError)
    if cls in GROUPS:
        assert all(kind_of(sub) is not None for sub in cls.__subclasses__())
    elif cls is not GthulhuError:
        assert kind_of(cls) is not None, f"{cls.__qualname__} has no kind: derive it from one in errors.py"


def test_every_kind_has_its_row_and_every_row_is_a_kind() -> None:
    kinds = {c for _, c in inspect.getmembers(errors, inspect.isclass)
             if issubclass(c, GthulhuError) and GthulhuError in c.__bases__}
    assert kinds == set(EDGES)


@pytest.mark.parametrize("kind", list(EDGES), ids=lambda c: c.__name__)
def test_each_edge_maps_each_kind_by_the_one_table(kind: type[GthulhuError]) -> None:
    exc = kind("x")
    assert grpc_status(exc) == grpc.StatusCode[EDGES[kind].grpc]
    assert http_status(exc) == EDGES[kind].http
    assert exit_code(exc) == EDGES[kind].exit


def test_what_clients_rely_on_keeps_its_answer() -> None:
    """The gRPC codes, REST statuses and exit codes the edges gave before the one table."""
    assert grpc_status(StaleGenerationError("x")) == grpc.StatusCode.FAILED_PRECONDITION
    assert grpc_status(IntentNotFoundError("x")) == grpc.StatusCode.NOT_FOUND
    assert grpc_status(LimitError("x")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert http_status(StateTooLargeError("x")) == 400  # any refused push is a 400 for the Manager
    assert isinstance(StateTooLargeError("x"), ValueError)
    assert grpc_status(SchedulerRefused("x")) == grpc.StatusCode.UNAVAILABLE  # not INTERNAL: a refusal
    assert issubclass(BackendUnavailable, errors.BackendError)
    assert grpc_status(MapFullError("x")) == grpc.StatusCode.INTERNAL
    from gthulhu_node.api.client import ConnectError
    from gthulhu_node.config import ConfigError
    from gthulhu_node.intents.localfiles import PolicyFileError
    from gthulhu_node.probe.preflight import ProbeUnavailable
    assert [exit_code(e) for e in (PolicyFileError("x"), ConfigError("x"), ConnectError("x"),
                                   ProbeUnavailable("x"))] == [2, 2, 3, 1]


def test_the_cli_answers_an_unhandled_error_by_its_kind(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from gthulhu_node import cli
    from gthulhu_node.commands import run

    def broken(args: object) -> int:
        raise errors.Unavailable("the thing is\n  gone")

    monkeypatch.setattr(run, "run", broken)
    assert cli.main(["run"]) == 3
    assert capsys.readouterr().err == "gthulhu-node: the thing is gone\n"
