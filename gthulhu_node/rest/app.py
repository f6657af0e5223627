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
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from google.protobuf.json_format import MessageToDict

from gthulhu_node import __version__
from gthulhu_node.api.convert import preview_to_pb, report_to_pb
from gthulhu_node.errors import GthulhuError, InvalidInput, edge_of
from gthulhu_node.explain import Report
from gthulhu_node.intents.documents import DocumentError, load_json
from gthulhu_node.intents.model import Intent, SenderEntry
from gthulhu_node.intents.status import IntentState, IntentStatus, StatusSnapshot
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.preview import Displaced, Preview
from gthulhu_node.rest.auth import CLIENT_ID_MAX, TokenAuthority, TokenError
from gthulhu_node.rest.merkle import EMPTY_ROOT, records_root
from gthulhu_node.rest.pods import pods_on_node
from gthulhu_node.rest.runtime_config import RuntimeConfig, RuntimeConfigState, parse_body
from gthulhu_node.rest.translate import (
    BodyError,
    Push,
    legacy_node_record,
    node_policies,
    node_record_of,
    pod_intents,
    pod_record_of,
)

log = structlog.get_logger(__name__)

NODE_SOURCE = "manager"
POD_SOURCE = "manager-pods"
SERVICE_NAME = "gthulhu-node Decision Maker API"
TOKEN_PATH = "/api/v1/auth/token"
ENDPOINTS = ("/health, /version, /metrics, POST_/api/v1/node-intents, POST_/api/v1/intents, "
             "GET_/api/v1/pods/pids, POST_/api/v1/runtime-config")
CLIENT_ID = web.RequestKey("client_id", str)  # who the bearer token was issued to, for log lines
CLIENTS_REMEMBERED = 1024  # client ids logged at info on their first token; more are logged at debug

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
ExplainFn = Callable[[int, int, str], list[Report]]  # (tid, pid, comm regex) -> one report per thread
PreviewFn = Callable[[str, Sequence[Intent]], tuple[Preview, list[Displaced]]]  # (source, intents)
PRIVATE_VIEW_REFUSAL = ("this route shows threads' comm, owner, cgroup and exe: it is served only on a "
                        "listener with mutual TLS")
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
    connections_evicted: int = 0
    connections_held: int = 0
    handshakes_failed: int = 0
    accept_errors: int = 0
    plain_http_refused: int = 0  # plain HTTP requests answered with a 400 on the TLS port
    node_name_mismatches: int = 0  # held Manager entries whose nodeID is not this node's name (now)
    entries_failed: int = 0  # pushed entries accepted but not honoured (failed), per changed push
    node_policies_expired: int = 0  # held node policies dropped (DecisionMakerApi._pod_contact)
    pod_intents_forgotten: int = 0  # pod intents of a state file without their pushed entries


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
        node_silence_s: float = 0.0,
        runtime_config: RuntimeConfig | None = None,
        proc_root: Path = Path("/proc"),
        backend_name: Callable[[], str] = lambda: "sched_ext",
        explain: ExplainFn | None = None,
        preview: PreviewFn | None = None,
        private_views: bool = False,
    ) -> None:
        """`explain`, `preview`: the agent's (gthulhu_node/explain.py, preview.py), served at
        GET /api/v1/explain and POST /api/v1/preview only when `private_views` (the listener runs mutual
        TLS): they show threads' comm, owner, cgroup and exe, which a plain-HTTP listener would hand to
        anyone on the path."""
        self._explain = explain
        self._preview = preview
        self._private_views = private_views
        self._store = store
        self._runtime = runtime_config if runtime_config is not None else RuntimeConfig(None, frozenset())
        self._proc_root = proc_root
        self._backend_name = backend_name
        self._auth = authority
        self._node_name = node_name
        self._max_body = max_body_bytes
        self._stats = stats
        self._status = status
        self._metrics_text = metrics_text
        self._lock = threading.Lock()  # one push/delete at a time; guards _silent_since
        self._token_clients: set[str] = set()  # client ids whose first token was logged at info
        self._node_silence_s = node_silence_s
        # monotonic time of the first pod-intent check since the Manager last looked at node policies
        self._silent_since: float | None = None

    def check_state(self) -> None:
        """Before serving: pod intents persisted by a version that did not keep the Manager's entries
        cannot be hashed as the Manager does, so the root would hide them. Forget them, as upstream's
        Decision Maker forgets all of them at start; the Manager's next check re-pushes them."""
        current = self._store.get(POD_SOURCE)
        if current is None or not current.intents or current.entries:
            return
        self._store.apply(POD_SOURCE, 0, [], allow_reserved=True)
        self._stats.pod_intents_forgotten += len(current.intents)
        log.warning("rest_pod_intents_forgotten", intents=len(current.intents),
                    reason="persisted without the Manager's entries; it re-pushes them at its next check")

    # -- application -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self._max_body, middlewares=[self._envelope_errors, self._require_token]
        )
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
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
        app.router.add_get("/api/v1/intents", self.list_pod_intents)
        app.router.add_get("/api/v1/pods/pids", self.pods_pids)
        app.router.add_post("/api/v1/runtime-config", self.apply_runtime_config)
        app.router.add_get("/api/v1/runtime-config", self.get_runtime_config)
        if self._explain is not None:
            app.router.add_get("/api/v1/explain", self.explain)
        if self._preview is not None:
            app.router.add_post("/api/v1/preview", self.preview)
        return app

    @web.middleware
    async def _envelope_errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every answer, errors from aiohttp itself included (404, 405, 413), in upstream's envelope."""
        try:
            response = await handler(request)
        except GthulhuError as exc:  # the REST edge's one mapping (gthulhu_node/errors.py, `http` column)
            response = failure(http_status(exc), str(exc))
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            message = exc.reason
            if isinstance(exc, web.HTTPRequestEntityTooLarge):
                message = f"request body larger than {self._max_body} bytes (rest.max_body_bytes)"
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

    async def version(self, request: web.Request) -> web.Response:
        """Upstream's shape, not enveloped (api/decisionmaker/rest/handler.go Version)."""
        return web.json_response({"message": SERVICE_NAME, "version": __version__, "endpoints": ENDPOINTS})

    async def metrics(self, request: web.Request) -> web.Response:
        assert self._metrics_text is not None
        text = await asyncio.to_thread(self._metrics_text)
        return web.Response(body=text, content_type="text/plain", charset="utf-8")

    async def token(self, request: web.Request) -> web.Response:
        """A token for a client that shows our public key (upstream v1.3), or, when a trusted Manager key
        is configured, a client assertion signed by it (newer Managers)."""
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
        # the Manager asks for a token before every call (3 per 30 s cycle): info once per client
        first = client_id not in self._token_clients and len(self._token_clients) < CLIENTS_REMEMBERED
        if first:
            self._token_clients.add(client_id)
        (log.info if first else log.debug)("rest_token_issued", client_id=client_id, expires=exp,
                                           **_peer(request))
        return success({"token": token, "expired_at": exp})

    # -- node policies (source `manager`) --------------------------------------------------------

    async def push_node_policies(self, request: web.Request) -> web.Response:
        self._node_contact()
        try:
            push = node_policies(await self._json(request), self._store.max_intents_per_source)
        except BodyError as exc:
            return self._push_refused(request, str(exc))
        return await self._apply(request, NODE_SOURCE, lambda: push)

    async def delete_node_policies(self, request: web.Request) -> web.Response:
        self._node_contact()
        policy_id, delete_all = _delete_args(await self._json(request), "policyId")
        if not delete_all and not policy_id:
            return failure(400, "policyId is required when 'all' is false")
        # upstream drops every cached entry with that policyID (duplicates included)
        return await self._apply(
            request, NODE_SOURCE,
            lambda: self._without(
                NODE_SOURCE, delete_all, lambda e: node_record_of(e).policy_id == policy_id
            ),
            deleting=True,
        )

    async def node_merkle(self, request: web.Request) -> web.Response:
        self._node_contact()
        return success({"rootHash": self._node_root()})

    def _node_root(self) -> str:
        current = self._store.get(NODE_SOURCE)
        if current is None:
            return EMPTY_ROOT
        if current.entries:
            return records_root(node_record_of(e) for e in current.entries)
        return records_root(legacy_node_record(i) for i in current.intents)

    async def list_node_policies(self, request: web.Request) -> web.Response:
        """Not upstream's: every entry the Manager pushed, and what became of it."""
        current = self._store.get(NODE_SOURCE)
        entries = current.entries if current is not None else ()
        if current is not None and not entries:  # state written before entries were kept
            entries = tuple(SenderEntry(record=legacy_node_record(i).as_doc(), key=i.id, intent_id=i.id)
                            for i in current.intents)
        rows = await self._entry_rows(NODE_SOURCE, entries)
        return success({
            "generation": current.generation if current is not None else 0,
            "rootHash": self._node_root(),
            "policies": rows,
        })

    def _node_contact(self) -> None:
        """The Manager looked at node policies: it has node intents somewhere (see _pod_contact)."""
        with self._lock:
            self._silent_since = None

    # -- pod intents (source `manager-pods`) -----------------------------------------------------

    async def push_pod_intents(self, request: web.Request) -> web.Response:
        try:
            push = pod_intents(await self._json(request), self._store.max_intents_per_source)
        except BodyError as exc:
            return self._push_refused(request, str(exc))
        return await self._apply(request, POD_SOURCE, lambda: push)

    async def delete_pod_intents(self, request: web.Request) -> web.Response:
        pod_id, delete_all = _delete_args(await self._json(request), "podId")
        if not delete_all and not pod_id:
            return failure(400, "podId is required when 'all' is false")
        return await self._apply(
            request, POD_SOURCE,
            lambda: self._without(POD_SOURCE, delete_all,
                                  lambda e: pod_record_of(e).pod_id.lower() == pod_id.lower()),
            deleting=True,
        )

    async def pod_merkle(self, request: web.Request) -> web.Response:
        root = self._pod_root()
        await self._pod_contact(request)
        return success({"rootHash": root})

    def _pod_root(self) -> str:
        current = self._store.get(POD_SOURCE)
        return records_root(pod_record_of(e) for e in (current.entries if current is not None else ()))

    async def list_pod_intents(self, request: web.Request) -> web.Response:
        """Not upstream's: every pod intent entry the Manager pushed, and what became of it."""
        current = self._store.get(POD_SOURCE)
        rows = await self._entry_rows(POD_SOURCE, current.entries if current is not None else ())
        return success({
            "generation": current.generation if current is not None else 0,
            "rootHash": self._pod_root(),
            "intents": rows,
        })

    async def _pod_contact(self, request: web.Request) -> None:
        """The Manager checks every node's pod-intent root on each reconcile cycle, and the node-policy
        root only when some node intent exists anywhere in the cluster (Gthulhu/Gthulhu@c969a96b,
        api/manager/service/cron_svc.go, resyncIntentsToDMs and resyncNodeIntentsToDMs; every 30 s,
        api/manager/app/rest_app.go). Pod checks for `node_silence_s` with no node contact mean it has
        none: node policies we still hold (persisted, a DELETE missed while we were down) are stale, and
        it would never tell us. They are dropped."""
        now = time.monotonic()
        with self._lock:
            if self._silent_since is None:
                self._silent_since = now
            stale = self._node_silence_s > 0 and now - self._silent_since >= self._node_silence_s
        current = self._store.get(NODE_SOURCE)
        if not stale or current is None or not (current.intents or current.entries):
            return
        log.warning(
            "rest_node_policies_expired",
            policies=len(current.entries) or len(current.intents),
            reason="the Manager checks pod intents but no longer node policies: it holds no node intent "
            "anywhere, so the ones held here were deleted while it could not tell us",
        )
        self._stats.node_policies_expired += 1
        await self._apply(request, NODE_SOURCE, lambda: Push([], []), deleting=True)

    # -- pods and runtime config ------------------------------------------------------------------

    async def pods_pids(self, request: web.Request) -> web.Response:
        """Every pod on this node and its processes, for the Manager's UI (upstream's field names)."""
        pods = await asyncio.to_thread(pods_on_node, self._proc_root)
        return success({
            "pods": [{"pod_uid": p.pod_uid, "processes": [
                {"pid": q.pid, "command": q.command, "ppid": q.ppid, "container_id": q.container_id}
                for q in p.processes]} for p in pods],
            "timestamp": now_rfc3339(),
            "node_name": self._node_name,
        })

    def _refuse_private(self) -> web.Response | None:
        """The answer to a route that shows who runs what, on a listener without mutual TLS."""
        if self._private_views:
            return None
        return failure(403, f"{PRIVATE_VIEW_REFUSAL} (rest.insecure_allow_plain_http is set)")

    async def explain(self, request: web.Request) -> web.Response:
        """Why threads are (not) governed, for the Manager's UI: `?tid=N`, `?pid=N` or `?comm=REGEX`
        (one of them); the same answer as the Explain RPC, in its JSON mapping."""
        refused = self._refuse_private()
        if refused is not None:
            return refused
        assert self._explain is not None
        query = request.query
        try:
            tid, pid = (int(query.get(name, "0")) for name in ("tid", "pid"))
        except ValueError:
            raise InvalidInput("tid and pid are numbers") from None
        reports = await asyncio.to_thread(self._explain, tid, pid, query.get("comm", ""))
        return success({"threads": [_message_doc(report_to_pb(r)) for r in reports]})

    async def preview(self, request: web.Request) -> web.Response:
        """What a node-intents push (the same body) would do on this node now, without applying it:
        the Preview RPC's answer for source `manager`, plus the entries that would fail."""
        refused = self._refuse_private()
        if refused is not None:
            return refused
        assert self._preview is not None
        push = node_policies(await self._json(request), self._store.max_intents_per_source)
        result, displaced = await asyncio.to_thread(self._preview, NODE_SOURCE, push.intents)
        data = _message_doc(preview_to_pb(result, displaced))
        data["failed"] = [{"key": e.key, "error": e.failed} for e in push.entries if e.failed]
        return success(data)

    async def apply_runtime_config(self, request: web.Request) -> web.Response:
        fields = parse_body(await self._json(request))
        try:
            state = await asyncio.to_thread(self._runtime.apply, fields, self._backend_name())
        except OSError as exc:
            return failure(500, f"Failed to persist the runtime config: {exc}")
        return success(self._runtime_view(state))

    async def get_runtime_config(self, request: web.Request) -> web.Response:
        return success(self._runtime_view(self._runtime.state))

    def node_name_mismatches(self) -> int:
        """Held entries of both Manager sources that name another node (applied all the same)."""
        held = (self._store.get(source) for source in (NODE_SOURCE, POD_SOURCE))
        return sum(1 for ss in held if ss is not None for e in ss.entries if e.other_node(self._node_name))

    def runtime_notes(self) -> list[str]:
        return self._runtime.state.notes()

    @staticmethod
    def _runtime_view(state: RuntimeConfigState) -> dict[str, Any]:
        """Upstream's status fields (configVersion, applied, appliedAt, configAvailable, restartCount,
        lastError, the values) plus ours: what is in effect, what waits for a scheduler reload, and why
        the rest is not. `applied`: the agent runs with everything of it that can apply here."""
        version = state.received.get("configVersion", "")
        return {
            **{k: v for k, v in state.received.items() if k != "configVersion"},
            "configVersion": version,
            "configAvailable": bool(state.received),
            "applied": state.in_effect,
            "restartCount": state.restart_count,
            "lastError": state.last_error,
            "appliedAt": datetime.fromtimestamp(state.applied_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            if state.applied_at else "",
            "inEffect": {k: v for k, v in state.applied.items() if k not in state.pending_reload},
            "pendingReload": list(state.pending_reload),
            "notApplicable": dict(state.not_applicable),
        }

    # -- shared ----------------------------------------------------------------------------------

    def _without(self, source: str, everything: bool, doomed: Callable[[SenderEntry], bool]) -> Push:
        """The source's push minus the entries `doomed` picks (all of them with `everything`)."""
        current = self._store.get(source)
        if everything or current is None:
            return Push([], [])
        kept = [e for e in current.entries if not doomed(e)]
        ids = {e.intent_id for e in kept}
        return Push([i for i in current.intents if i.id in ids], kept)

    async def _entry_rows(self, source: str, entries: Sequence[SenderEntry]) -> list[dict[str, Any]]:
        states: dict[str, IntentStatus] = {}
        if self._status is not None:
            snapshot = await asyncio.to_thread(self._status, source)
            states = {st.intent.id: st for st in snapshot.intents if st.source == source}
        rows = []
        for entry in entries:
            row: dict[str, Any] = dict(entry.record)
            st = states.get(entry.key)
            if st is not None:
                row.update(state=str(st.state), reason=st.reason, matchedTasks=st.matched_tasks,
                           warnings=list(st.warnings))
            elif entry.failed:
                row.update(state=str(IntentState.FAILED), reason=entry.failed, matchedTasks=0, warnings=[])
            rows.append(row)
        return rows

    async def _apply(
        self,
        request: web.Request,
        source: str,
        new_set: Callable[[], Push],
        *,
        deleting: bool = False,
    ) -> web.Response:
        """Replace `source`'s set in the store (generation 0: the same set again is a no-op).

        `new_set` runs under the lock, so a set derived from the current one (a delete) cannot lose a
        concurrent push.
        """

        def work() -> tuple[Push, int, bool]:
            with self._lock:
                push = new_set()
                outcome = self._store.apply(
                    source, 0, push.intents, allow_reserved=True, entries=push.entries
                )
                return push, outcome.generation, outcome.changed

        try:
            push, generation, changed = await asyncio.to_thread(work)
        except InvalidInput as exc:
            return self._push_refused(request, str(exc))
        except OSError as exc:
            return failure(500, f"Failed to persist intents: {exc}")
        intents, failed = push.intents, push.failed
        other = sorted({e.key for e in push.entries if e.other_node(self._node_name)})
        if deleting:
            self._stats.deletes += 1
        else:
            self._stats.pushes_accepted += 1
        log.info(
            "rest_intents_replaced",
            source=source,
            intents=len(intents),
            entries=len(push.entries),
            failed=len(failed),
            generation=generation,
            changed=changed,
            client_id=request.get(CLIENT_ID, ""),
        )
        if failed and changed:
            self._stats.entries_failed += len(failed)
            log.warning(
                "rest_entries_not_honoured",
                source=source,
                entries=len(failed),
                first=failed[0].key,
                reason=failed[0].failed,
                hint="accepted and counted in the merkle root as the Manager expects; see "
                "gthulhu-node status",
            )
        if other and changed:
            log.warning(
                "rest_node_name_mismatch",
                source=source,
                node_name=self._node_name,
                entries=len(other),
                first=other[0],
                effect="applied all the same: the Manager chose this node",
                hint="set node.name (or NODE_NAME) to the Kubernetes node name the Manager uses",
            )
        data: dict[str, Any] = {"accepted": len(intents), "generation": generation, "changed": changed}
        if failed:
            data["failed"] = [{"key": e.key, "reason": e.failed} for e in failed]
        if other:
            data["nodeNameMismatch"] = other
        return success(data)

    def _push_refused(self, request: web.Request, message: str) -> web.Response:
        self._stats.pushes_refused += 1
        log.warning("rest_push_refused", path=request.path, error=message,
                    client_id=request.get(CLIENT_ID, ""))
        return failure(400, message)



def _message_doc(msg: Any) -> dict[str, Any]:
    """An RPC's answer in protobuf's JSON mapping, zero values included (uid 0 is root, not "unknown")."""
    doc: dict[str, Any] = MessageToDict(msg, always_print_fields_with_no_presence=True)
    return doc


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


