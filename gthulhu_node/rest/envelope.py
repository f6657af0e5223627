"""Upstream's envelopes (docs/rest.md), shared by every route: success
`{"success": true, "data": {...}, "timestamp": RFC 3339}` (no `data` when there is nothing to say), error
`{"success": false, "error": "..."}`; and the reading of a JSON body, whose faults are a 400 naming them."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from gthulhu_node.errors import GthulhuError, edge_of
from gthulhu_node.intents.documents import DocumentError, load_json
from gthulhu_node.rest.translate import BodyError


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def success(data: dict[str, Any] | None = None, status: int = 200) -> web.Response:
    body: dict[str, Any] = {"success": True}
    if data is not None:
        body["data"] = data
    body["timestamp"] = now_rfc3339()
    return web.json_response(body, status=status)


def http_status(exc: GthulhuError) -> int:
    """The REST edge's one mapping of our exceptions (gthulhu_node/errors.py, the `http` column)."""
    return edge_of(exc).http


def failure(status: int, message: str) -> web.Response:
    return web.json_response({"success": False, "error": message}, status=status)


def peer(request: web.Request) -> dict[str, str]:
    """Who is calling, for log lines: address and, under mTLS, the certificate's subject CN."""
    out = {"peer": str(request.remote or "")}
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    if cert:
        for rdn in cert.get("subject", ()):
            for key, value in rdn:
                if key == "commonName":
                    out["client_cert"] = value
    return out


async def read_json(request: web.Request) -> Any:
    blob = await request.read()
    if not blob:
        raise BodyError("Invalid request payload: empty body")
    try:
        return load_json(blob)  # nesting capped: deep bodies are a 400 naming the limit, not a 500
    except DocumentError as exc:
        raise BodyError(f"Invalid request payload: {exc}") from None


def message_doc(msg: Any) -> dict[str, Any]:
    """An RPC's answer in protobuf's JSON mapping, zero values included (uid 0 is root, not "unknown")."""
    doc: dict[str, Any] = MessageToDict(msg, always_print_fields_with_no_presence=True)
    return doc
