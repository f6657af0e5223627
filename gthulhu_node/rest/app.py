"""The routes, envelopes and status codes of upstream's Decision Maker API (docs/rest.md).

Envelopes: success `{"success": true, "data": {...}, "timestamp": RFC 3339}` (no `data` when there is
nothing to say), error `{"success": false, "error": "..."}`. The Manager reads `success`, `data.token`,
`data.expired_at`, `data.rootHash`, `error` and the status code; everything else we add (`accepted`,
`generation`, ...) is for people with curl and is ignored by it.

Every store call runs in a worker thread (`asyncio.to_thread`): a push of thousands of intents compiles
their patterns and fsyncs the state file, and `/health` must keep answering meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import structlog
from aiohttp import web

from gthulhu_node.intents.documents import DocumentError, load_json
from gthulhu_node.intents.model import Intent
from gthulhu_node.intents.parse import IntentValidationError
from gthulhu_node.intents.status import StatusSnapshot
from gthulhu_node.intents.store import IntentNotFoundError, IntentStore, StoreError
from gthulhu_node.rest.auth import CLIENT_ID_MAX, TokenAuthority, TokenError
from gthulhu_node.rest.merkle import EMPTY_ROOT, PodIntentRecord, records_root
from gthulhu_node.rest.translate import BodyError, node_policies, node_record, pod_intents

log = structlog.get_logger(__name__)

NODE_SOURCE = "manager"
POD_SOURCE = "manager-pods"
SERVICE_NAME = "gthulhu-node Decision Maker API"
TOKEN_PATH = "/api/v1/auth/token"
CLIENT_ID = web.RequestKey("client_id", str)  # who the bearer token was issued to, for log lines

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
StatusFn = Callable[[str], StatusSnapshot]


@dataclass(slots=True)
class RestStats:
    """Counters for metrics (metrics.py names them)."""

    insecure: bool = False
    requests: dict[str, int] = field(default_factory=dict)  # per status code
    tokens_issued: int = 0
    tokens_refused: int = 0
    auth_refused: int = 0
    pushes_accepted: int = 0
    pushes_refused: int = 0
    deletes: int = 0
    # the listener's (rest/listener.py), copied in by RestServer.stats()
    connections_refused: int = 0
    handshakes_failed: int = 0
    accept_errors: int = 0


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def success(data: dict[str, Any] | None = None, status: int = 200) -> web.Response:
    body: dict[str, Any] = {"success": True}
    if data is not None:
        body["data"] = data
    body["timestamp"] = now_rfc3339()
    return web.json_response(body, status=status)


def failure(status: int, message: str) -> web.Response:
    return web.json_response({"success": False, "error": message}, status=status)


def _peer(request: web.Request) -> dict[str, str]:
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


class DecisionMakerApi:
    """The handlers; one instance per server."""

    def __init__(
        self,
        store: IntentStore,
        authority: TokenAuthority,
        *,
        node_name: str,
        max_body_bytes: int,
        stats: RestStats,
        status: StatusFn | None = None,
        metrics_text: Callable[[], bytes] | None = None,
    ) -> None:
        self._store = store
        self._auth = authority
        self._node_name = node_name
        self._max_body = max_body_bytes
        self._stats = stats
        self._status = status
        self._metrics_text = metrics_text
        self._lock = threading.Lock()  # one push/delete at a time; guards _pod_records
        self._pod_records: list[PodIntentRecord] = []

    # -- application -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self._max_body, middlewares=[self._envelope_errors, self._require_token]
        )
        app.router.add_get("/health", self.health)
        if self._metrics_text is not None:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_post(TOKEN_PATH, self.token)
        app.router.add_post("/api/v1/node-intents", self.push_node_policies)
        app.router.add_delete("/api/v1/node-intents", self.delete_node_policies)
        app.router.add_get("/api/v1/node-intents/merkle", self.node_merkle)
        app.router.add_get("/api/v1/node-intents", self.list_node_policies)
        app.router.add_post("/api/v1/intents", self.push_pod_intents)
        app.router.add_delete("/api/v1/intents", self.delete_pod_intents)
        app.router.add_get("/api/v1/intents/merkle", self.pod_merkle)
        return app

    @web.middleware
    async def _envelope_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every answer, errors from aiohttp itself included (404, 405, 413), in upstream's envelope."""
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.reason
            if isinstance(exc, web.HTTPRequestEntityTooLarge):
                message = f"request body larger than {self._max_body} bytes"
            response = failure(exc.status, message)
        except Exception:
            log.exception("rest_handler_failed", method=request.method, path=request.path)
            response = failure(500, "Internal Server Error")
        key = str(response.status)
        self._stats.requests[key] = self._stats.requests.get(key, 0) + 1
        return response

    @web.middleware
    async def _require_token(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """A valid bearer token on every /api/v1 route but the token route; otherwise 401, nothing runs."""
        if not request.path.startswith("/api/v1/") or request.path == TOKEN_PATH:
            return await handler(request)
        header = request.headers.get("Authorization", "")
        if not header:
            return self._refuse(request, "Authorization header is required")
        if not header.startswith("Bearer "):
            return self._refuse(request, "Authorization header must start with 'Bearer '")
        try:
            claims = self._auth.verify(header[len("Bearer ") :].strip())
        except TokenError as exc:
            return self._refuse(request, f"Invalid or expired token: {exc}")
        request[CLIENT_ID] = str(claims.get("client_id", ""))
        return await handler(request)

    def _refuse(self, request: web.Request, message: str) -> web.Response:
        self._stats.auth_refused += 1
        log.warning("rest_auth_refused", method=request.method, path=request.path, reason=message,
                    **_peer(request))
        return failure(401, message)

    async def _json(self, request: web.Request) -> Any:
        blob = await request.read()
        if not blob:
            raise BodyError("Invalid request payload: empty body")
        try:
            return load_json(blob)  # nesting capped: deep bodies are a 400 naming the limit, not a 500
        except DocumentError as exc:
            raise BodyError(f"Invalid request payload: {exc}") from None

    # -- unauthenticated -------------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy", "timestamp": now_rfc3339(), "service": SERVICE_NAME})

    async def metrics(self, request: web.Request) -> web.Response:
        assert self._metrics_text is not None
        text = await asyncio.to_thread(self._metrics_text)
        return web.Response(body=text, content_type="text/plain", charset="utf-8")

    async def token(self, request: web.Request) -> web.Response:
        """A token for a client that shows our public key (upstream v1.3), or, when a trusted Manager key
        is configured, a client assertion signed by it (newer Managers)."""
        try:
            body = await self._json(request)
            if not isinstance(body, dict):
                raise BodyError("Invalid request payload: expected a JSON object")
            client_id, expired_at = body.get("client_id", ""), body.get("expired_at", 0)
            if not isinstance(client_id, str) or len(client_id) > CLIENT_ID_MAX:
                raise BodyError(f"client_id: expected a string of at most {CLIENT_ID_MAX} characters")
            if expired_at is None:
                expired_at = 0
            if isinstance(expired_at, bool) or not isinstance(expired_at, int):
                raise BodyError("expired_at: expected an integer (unix seconds)")
            proof_key = "client_assertion" if self._auth.wants_assertions else "public_key"
            proof = body.get(proof_key)
            if not isinstance(proof, str) or not proof:
                raise BodyError(f"{proof_key}: required")
        except BodyError as exc:
            return failure(400, str(exc))
        try:
            if self._auth.wants_assertions:
                self._auth.check_client_assertion(client_id, proof)
            elif not self._auth.public_key_matches(proof):
                raise TokenError("public key does not match")
        except TokenError as exc:
            self._stats.tokens_refused += 1
            log.warning("rest_token_refused", client_id=client_id, reason=str(exc), **_peer(request))
            return failure(401, f"Public key verification failed: {exc}")
        token, exp = self._auth.issue(client_id, expired_at)
        self._stats.tokens_issued += 1
        log.info("rest_token_issued", client_id=client_id, expires=exp, **_peer(request))
        return success({"token": token, "expired_at": exp})

    # -- node policies (source `manager`) --------------------------------------------------------

    async def push_node_policies(self, request: web.Request) -> web.Response:
        try:
            intents = node_policies(await self._json(request), self._store.max_intents_per_source)
        except BodyError as exc:
            return self._push_refused(request, str(exc))
        return await self._apply(request, NODE_SOURCE, lambda: (intents, None))

    async def delete_node_policies(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            policy_id, delete_all = _delete_args(body, "policyId")
        except BodyError as exc:
            return failure(400, str(exc))
        if delete_all:
            return await self._apply(request, NODE_SOURCE, lambda: ([], None), deleting=True)
        if not policy_id:
            return failure(400, "policyId is required when 'all' is false")

        def work() -> int:
            with self._lock:
                try:
                    self._store.delete(NODE_SOURCE, policy_id, allow_reserved=True)
                except IntentNotFoundError:
                    return 0  # already gone: deleting is idempotent, as upstream's is
                return 1

        try:
            deleted = await asyncio.to_thread(work)
        except (StoreError, OSError) as exc:
            return self._store_failure(exc)
        self._stats.deletes += 1
        log.info("rest_intents_deleted", source=NODE_SOURCE, intent_id=policy_id, deleted=deleted,
                 client_id=request.get(CLIENT_ID, ""))
        return success({"deleted": deleted})

    async def node_merkle(self, request: web.Request) -> web.Response:
        current = self._store.get(NODE_SOURCE)
        intents = current.intents if current is not None else ()
        return success({"rootHash": records_root(node_record(i) for i in intents)})

    async def list_node_policies(self, request: web.Request) -> web.Response:
        """Not upstream's: what this node holds from the Manager and what became of it."""
        current = self._store.get(NODE_SOURCE)
        intents = current.intents if current is not None else ()
        states: dict[str, Any] = {}
        if self._status is not None:
            snapshot = await asyncio.to_thread(self._status, NODE_SOURCE)
            states = {st.intent.id: st for st in snapshot.intents if st.source == NODE_SOURCE}
        rows = []
        for intent in intents:
            rec = node_record(intent)
            row: dict[str, Any] = {
                "policyID": rec.policy_id,
                "nodeID": rec.node_id,
                "commandRegex": rec.command_regex,
                "priority": rec.priority,
                "executionTime": rec.execution_time,
            }
            st = states.get(intent.id)
            if st is not None:
                row.update(state=str(st.state), reason=st.reason, matchedTasks=st.matched_tasks,
                           warnings=list(st.warnings))
            rows.append(row)
        return success({
            "generation": current.generation if current is not None else 0,
            "rootHash": records_root(node_record(i) for i in intents),
            "policies": rows,
        })

    # -- pod intents (source `manager-pods`) -----------------------------------------------------

    async def push_pod_intents(self, request: web.Request) -> web.Response:
        try:
            intents, records = pod_intents(await self._json(request))
        except BodyError as exc:
            return self._push_refused(request, str(exc))
        return await self._apply(request, POD_SOURCE, lambda: (intents, records))

    async def delete_pod_intents(self, request: web.Request) -> web.Response:
        try:
            body = await self._json(request)
            pod_id, delete_all = _delete_args(body, "podId")
        except BodyError as exc:
            return failure(400, str(exc))
        if delete_all:
            return await self._apply(request, POD_SOURCE, lambda: ([], []), deleting=True)
        if not pod_id:
            return failure(400, "podId is required when 'all' is false")

        def without_pod() -> tuple[list[Intent], list[PodIntentRecord]]:
            current = self._store.get(POD_SOURCE)
            held = current.intents if current is not None else ()
            kept = [i for i in held if i.pod_uid != pod_id.lower()]
            return kept, [r for r in self._pod_records if r.pod_id.lower() != pod_id.lower()]

        return await self._apply(request, POD_SOURCE, without_pod, deleting=True)

    async def pod_merkle(self, request: web.Request) -> web.Response:
        current = self._store.get(POD_SOURCE)
        if current is None or not current.intents:
            return success({"rootHash": EMPTY_ROOT})
        with self._lock:
            records = list(self._pod_records)
        return success({"rootHash": records_root(records)})

    # -- shared ----------------------------------------------------------------------------------

    async def _apply(
        self,
        request: web.Request,
        source: str,
        new_set: Callable[[], tuple[list[Intent], list[PodIntentRecord] | None]],
        *,
        deleting: bool = False,
    ) -> web.Response:
        """Replace `source`'s set in the store (generation 0: the same set again is a no-op).

        `new_set` runs under the lock, so a set derived from the current one (a delete) cannot lose a
        concurrent push; it returns the intents and, for pod intents, the records the merkle root uses.
        """

        def work() -> tuple[list[Intent], int, bool]:
            with self._lock:
                intents, pod_records = new_set()
                outcome = self._store.apply(source, 0, intents, allow_reserved=True)
                if pod_records is not None:
                    self._pod_records = pod_records
                return intents, outcome.generation, outcome.changed

        try:
            intents, generation, changed = await asyncio.to_thread(work)
        except IntentValidationError as exc:
            return self._push_refused(request, str(exc))
        except (StoreError, OSError) as exc:
            return self._store_failure(exc)
        other = sorted(i.id for i in intents if i.node_names and self._node_name not in i.node_names)
        if deleting:
            self._stats.deletes += 1
        else:
            self._stats.pushes_accepted += 1
        log.info(
            "rest_intents_replaced",
            source=source,
            intents=len(intents),
            generation=generation,
            changed=changed,
            client_id=request.get(CLIENT_ID, ""),
        )
        if other:
            log.warning(
                "rest_intents_for_other_node",
                source=source,
                node_name=self._node_name,
                intents=len(other),
                first=other[0],
                hint="set node.name to the Kubernetes node name the Manager uses",
            )
        data: dict[str, Any] = {"accepted": len(intents), "generation": generation, "changed": changed}
        if other:
            data["notForThisNode"] = other
        return success(data)

    def _push_refused(self, request: web.Request, message: str) -> web.Response:
        self._stats.pushes_refused += 1
        log.warning("rest_push_refused", path=request.path, error=message,
                    client_id=request.get(CLIENT_ID, ""))
        return failure(400, message)

    def _store_failure(self, exc: Exception) -> web.Response:
        if isinstance(exc, OSError):
            return failure(500, f"Failed to persist intents: {exc}")
        return failure(400, str(exc))


def _delete_args(body: Any, id_key: str) -> tuple[str, bool]:
    if not isinstance(body, dict):
        raise BodyError("Invalid request payload: expected a JSON object")
    ident = body.get(id_key) or ""
    delete_all = body.get("all") or False
    if not isinstance(ident, str):
        raise BodyError(f"{id_key}: expected a string")
    if not isinstance(delete_all, bool):
        raise BodyError("all: expected true or false")
    return ident, delete_all


