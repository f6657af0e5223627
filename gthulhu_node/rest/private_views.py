"""GET /api/v1/explain and POST /api/v1/preview: the agent's answers about threads (gthulhu_node/explain.py,
preview.py), served only on a listener with mutual TLS. They show threads' comm, owner, cgroup and exe,
which a plain-HTTP listener would hand to anyone on the path: there they answer 403."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from aiohttp import web

from gthulhu_node.api.convert import preview_to_pb, report_to_pb
from gthulhu_node.errors import InvalidInput
from gthulhu_node.explain import Report
from gthulhu_node.intents.model import Intent
from gthulhu_node.preview import Displaced, Preview
from gthulhu_node.rest.envelope import failure, message_doc, read_json, success
from gthulhu_node.rest.translate import node_policies

ExplainFn = Callable[[int, int, str], list[Report]]  # (tid, pid, comm regex) -> one report per thread
PreviewFn = Callable[[str, Sequence[Intent]], tuple[Preview, list[Displaced]]]  # (source, intents)
PRIVATE_VIEW_REFUSAL = ("this route shows threads' comm, owner, cgroup and exe: it is served only on a "
                        "listener with mutual TLS")


class PrivateViews:
    """The explain and preview handlers; `private_views`: the listener runs mutual TLS."""

    def __init__(
        self,
        *,
        explain: ExplainFn | None,
        preview: PreviewFn | None,
        private_views: bool,
        node_source: str,
        max_intents: Callable[[], int],
    ) -> None:
        self.explain_fn = explain
        self.preview_fn = preview
        self._private_views = private_views
        self._node_source = node_source
        self._max_intents = max_intents

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
        assert self.explain_fn is not None
        query = request.query
        try:
            tid, pid = (int(query.get(name, "0")) for name in ("tid", "pid"))
        except ValueError:
            raise InvalidInput("tid and pid are numbers") from None
        reports = await asyncio.to_thread(self.explain_fn, tid, pid, query.get("comm", ""))
        return success({"threads": [message_doc(report_to_pb(r)) for r in reports]})

    async def preview(self, request: web.Request) -> web.Response:
        """What a node-intents push (the same body) would do on this node now, without applying it:
        the Preview RPC's answer for source `manager`, plus the entries that would fail."""
        refused = self._refuse_private()
        if refused is not None:
            return refused
        assert self.preview_fn is not None
        push = node_policies(await read_json(request), self._max_intents())
        result, displaced = await asyncio.to_thread(self.preview_fn, self._node_source, push.intents)
        data = message_doc(preview_to_pb(result, displaced))
        data["failed"] = [{"key": e.key, "error": e.failed} for e in push.entries if e.failed]
        return success(data)
