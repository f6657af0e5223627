"""Requests that do not decode get INVALID_ARGUMENT, like any other bad input, not INTERNAL.

gRPC runs the request deserializer before any handler code; when it raises (protobuf's DecodeError, e.g.
a string field with invalid UTF-8) the client gets INTERNAL "Exception deserializing request!", which
reads as a bug in the agent and is counted nowhere. Here each method's deserializer hands back the error
instead, and the handler refuses it through the service's own refusal path (log line, error counter).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

Refuse = Callable[[str, grpc.ServicerContext, str], None]


class Undecodable:
    """What a request that protobuf could not parse becomes."""

    def __init__(self, error: str) -> None:
        self.error = error


def _deserializer(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Undecodable(str(exc))
        except Exception as exc:  # the decoding boundary: nothing a parser raises escapes to gRPC
            return Undecodable(type(exc).__name__)

    return deserialize


def _guarded(method: str, behavior: Callable[..., Any], refuse: Refuse) -> Callable[..., Any]:
    def run(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, Undecodable):
            refuse(method, context, f"the request is not a valid message: {request.error}")
        return behavior(request, context)

    return run


class _Capture:
    """Stands in for the server while the generated code registers its handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, Any] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add: Callable[[Any, Any], None], servicer: Any, server: grpc.Server, refuse: Refuse) -> None:
    """`add(servicer, server)` (a generated add_*_to_server), with every request decoded leniently."""
    capture = _Capture()
    add(servicer, capture)
    handlers: dict[str, Any] = {}
    for name, h in capture.handlers.items():
        kind = "unary_unary" if h.unary_unary is not None else "unary_stream"
        handlers[name] = h._replace(
            request_deserializer=_deserializer(h.request_deserializer),
            **{kind: _guarded(name, getattr(h, kind), refuse)},
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(capture.service, handlers),))
    server.add_registered_method_handlers(capture.service, handlers)  # type: ignore[attr-defined]
