"""Who may call what: the token route, the bearer token every other /api/v1 route requires, and the
middleware that puts every answer (aiohttp's own errors included) in upstream's envelope and counts it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

from gthulhu_node.errors import GthulhuError
from gthulhu_node.rest.auth import CLIENT_ID_MAX, TokenAuthority, TokenError
from gthulhu_node.rest.envelope import failure, http_status, peer, read_json, success
from gthulhu_node.rest.stats import RestStats
from gthulhu_node.rest.translate import BodyError

log = structlog.get_logger(__name__)

TOKEN_PATH = "/api/v1/auth/token"
CLIENT_ID = web.RequestKey("client_id", str)  # who the bearer token was issued to, for log lines
CLIENTS_REMEMBERED = 1024  # client ids logged at info on their first token; more are logged at debug

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Access:
    """The middlewares and the token route; one instance per server."""

    def __init__(self, authority: TokenAuthority, *, max_body_bytes: int, stats: RestStats) -> None:
        self._auth = authority
        self._max_body = max_body_bytes
        self._stats = stats
        self._token_clients: set[str] = set()  # client ids whose first token was logged at info

    def middlewares(self) -> list[Middleware]:
        return [self._envelope_errors, self._require_token]

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
                    **peer(request))
        return failure(401, message)

    async def token(self, request: web.Request) -> web.Response:
        """A token for a client that shows our public key (upstream v1.3), or, when a trusted Manager key
        is configured, a client assertion signed by it (newer Managers)."""
        body = await read_json(request)
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
            log.warning("rest_token_refused", client_id=client_id, reason=str(exc), **peer(request))
            return failure(401, f"Public key verification failed: {exc}")
        token, exp = self._auth.issue(client_id, expired_at)
        self._stats.tokens_issued += 1
        # the Manager asks for a token before every call (3 per 30 s cycle): info once per client
        first = client_id not in self._token_clients and len(self._token_clients) < CLIENTS_REMEMBERED
        if first:
            self._token_clients.add(client_id)
        (log.info if first else log.debug)("rest_token_issued", client_id=client_id, expires=exp,
                                           **peer(request))
        return success({"token": token, "expired_at": exp})
