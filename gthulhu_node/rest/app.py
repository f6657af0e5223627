"""The routes of upstream's Decision Maker API (docs/rest.md), put together from the parts that own them:
the token route and middlewares (access.py), the node-policy and pod-intent routes the Manager pushes and
checks (intent_routes.py), the node's pods and runtime config (node_routes.py), and explain and preview,
mTLS only (private_views.py). The envelopes and status codes: envelope.py.

The Manager reads `success`, `data.token`, `data.expired_at`, `data.rootHash`, `error` and the status code;
everything else we add (`accepted`, `generation`, ...) is for people with curl and is ignored by it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from gthulhu_node import __version__
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.rest.access import TOKEN_PATH, Access
from gthulhu_node.rest.auth import TokenAuthority
from gthulhu_node.rest.envelope import now_rfc3339
from gthulhu_node.rest.intent_routes import NODE_SOURCE, IntentRoutes, StatusFn
from gthulhu_node.rest.node_routes import NodeRoutes
from gthulhu_node.rest.private_views import ExplainFn, PreviewFn, PrivateViews
from gthulhu_node.rest.runtime_config import RuntimeConfig
from gthulhu_node.rest.stats import RestStats

__all__ = ["DecisionMakerApi"]

SERVICE_NAME = "gthulhu-node Decision Maker API"
ENDPOINTS = ("/health, /version, /metrics, POST_/api/v1/node-intents, POST_/api/v1/intents, "
             "GET_/api/v1/pods/pids, POST_/api/v1/runtime-config")


class DecisionMakerApi:
    """The application: its parts and their routes, and the unauthenticated ones; one instance per server."""

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
        self._max_body = max_body_bytes
        self._metrics_text = metrics_text
        self._access = Access(authority, max_body_bytes=max_body_bytes, stats=stats)
        self._intents = IntentRoutes(store, node_name=node_name, stats=stats, status=status,
                                     node_silence_s=node_silence_s)
        self._node = NodeRoutes(
            node_name=node_name,
            runtime_config=runtime_config if runtime_config is not None else RuntimeConfig(None, frozenset()),
            proc_root=proc_root,
            backend_name=backend_name,
        )
        self._views = PrivateViews(explain=explain, preview=preview, private_views=private_views,
                                   node_source=NODE_SOURCE, max_intents=lambda: store.max_intents_per_source)

    def check_state(self) -> None:
        """Before serving: forget pod intents a state file holds without their entries (IntentRoutes)."""
        self._intents.check_state()

    def node_name_mismatches(self) -> int:
        """Held entries of both Manager sources that name another node (applied all the same)."""
        return self._intents.node_name_mismatches()

    def runtime_notes(self) -> list[str]:
        return self._node.runtime_notes()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self._max_body, middlewares=self._access.middlewares())
        app.router.add_get("/health", self.health)
        app.router.add_get("/version", self.version)
        if self._metrics_text is not None:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_post(TOKEN_PATH, self._access.token)
        intents, node, views = self._intents, self._node, self._views
        app.router.add_post("/api/v1/node-intents", intents.push_node_policies)
        app.router.add_delete("/api/v1/node-intents", intents.delete_node_policies)
        app.router.add_get("/api/v1/node-intents/merkle", intents.node_merkle)
        app.router.add_get("/api/v1/node-intents", intents.list_node_policies)
        app.router.add_post("/api/v1/intents", intents.push_pod_intents)
        app.router.add_delete("/api/v1/intents", intents.delete_pod_intents)
        app.router.add_get("/api/v1/intents/merkle", intents.pod_merkle)
        app.router.add_get("/api/v1/intents", intents.list_pod_intents)
        app.router.add_get("/api/v1/pods/pids", node.pods_pids)
        app.router.add_post("/api/v1/runtime-config", node.apply_runtime_config)
        app.router.add_get("/api/v1/runtime-config", node.get_runtime_config)
        if views.explain_fn is not None:
            app.router.add_get("/api/v1/explain", views.explain)
        if views.preview_fn is not None:
            app.router.add_post("/api/v1/preview", views.preview)
        return app

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
