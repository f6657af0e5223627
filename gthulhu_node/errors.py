"""One exception base for the whole agent, a few kinds under it, and what each kind means at each edge.

Every exception the package raises derives from `GthulhuError` through exactly one of the kinds below
(`tests/unit/test_errors.py` checks every class). The edges — the gRPC server (`api/server.py`), the REST
envelope (`rest/access.py`) and the command line (`commands/`) — do not list our exception classes one by one:
each asks `edge_of(exc)` and uses its own column of `EDGES`. A new exception class picks its kind and is
then answered the same way everywhere; a new kind is one new row here.

Kinds that also subclass a builtin (`ValueError`, `OSError`, `RuntimeError`) keep the builtin so that
callers that catch the builtin keep working. This module imports nothing of ours (layer 1).
"""

from __future__ import annotations

from dataclasses import dataclass


class GthulhuError(Exception):
    """The base of every exception gthulhu-node raises."""


class InvalidInput(GthulhuError, ValueError):
    """What was given is wrong (an intent, a document, a request body, a setting): fix it and retry."""


class NotFound(GthulhuError):
    """The thing named does not exist (an intent id, a task)."""


class Conflict(GthulhuError):
    """Valid, but refused by the current state (a stale generation, state written by a newer agent)."""


class LimitExceeded(GthulhuError):
    """Valid, but over a configured limit (intents per source, sources, watchers, state size)."""


class Unauthenticated(GthulhuError):
    """The caller did not prove who it is (a missing, forged or expired token)."""


class Unavailable(GthulhuError):
    """Something needed is not there now (the agent, the proc connector, a backend); may work later."""


class Unsupported(GthulhuError):
    """This host cannot do it (no BCC, a kernel that refuses a capability drop); retrying will not help."""


class BackendError(GthulhuError):
    """A backend failed to carry out an operation (gthulhu_node/backends/base.py has the subclasses)."""


@dataclass(frozen=True, slots=True)
class Edge:
    """What one kind is at each edge: a gRPC status code name, an HTTP status, a CLI exit code."""

    grpc: str
    http: int
    exit: int


# The mapping, once. CLI exit codes are the documented ones (docs/intents.md, docs/probe.md): 1 refused
# or failed, 2 bad input, 3 the agent cannot be reached. The REST column keeps the Decision Maker's
# answers: over a limit is a 400 there, as any refused push.
EDGES: dict[type[GthulhuError], Edge] = {
    InvalidInput: Edge("INVALID_ARGUMENT", 400, 2),
    NotFound: Edge("NOT_FOUND", 404, 1),
    Conflict: Edge("FAILED_PRECONDITION", 409, 1),
    LimitExceeded: Edge("RESOURCE_EXHAUSTED", 400, 1),
    Unauthenticated: Edge("UNAUTHENTICATED", 401, 1),
    Unavailable: Edge("UNAVAILABLE", 503, 3),
    Unsupported: Edge("FAILED_PRECONDITION", 501, 1),
    BackendError: Edge("INTERNAL", 500, 1),
}
UNKNOWN = Edge("INTERNAL", 500, 1)  # GthulhuError itself, or an exception that is not ours


def kind_of(exc: BaseException | type[BaseException]) -> type[GthulhuError] | None:
    """The first kind in the exception's method resolution order (None when it is not ours)."""
    cls = exc if isinstance(exc, type) else type(exc)
    return next((c for c in cls.__mro__ if c in EDGES), None)


def edge_of(exc: BaseException) -> Edge:
    kind = kind_of(exc)
    return EDGES[kind] if kind is not None else UNKNOWN
