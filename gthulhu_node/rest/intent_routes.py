"""The routes of upstream's Decision Maker contract that the Manager pushes and checks: node policies
(POST/DELETE/GET /api/v1/node-intents, GET .../merkle; source `manager`) and pod intents (the same under
/api/v1/intents; source `manager-pods`), with the merkle roots the Manager compares, and the expiry of node
policies it stopped checking.

Every store call runs in a worker thread (`asyncio.to_thread`): a push of thousands of intents compiles
their patterns and fsyncs the state file, and `/health` must keep answering meanwhile. Nothing on the event
loop's thread waits for a lock a push holds: pushes queue on `_push_lock` in their worker threads, and the
Manager's contact times have a lock of their own, held for a few assignments.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import structlog
from aiohttp import web

from gthulhu_node.errors import InvalidInput
from gthulhu_node.intents.model import SenderEntry
from gthulhu_node.intents.status import IntentState, IntentStatus, StatusSnapshot
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.rest.access import CLIENT_ID
from gthulhu_node.rest.envelope import failure, read_json, success
from gthulhu_node.rest.merkle import EMPTY_ROOT, records_root
from gthulhu_node.rest.stats import RestStats
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
StatusFn = Callable[[str], StatusSnapshot]


class IntentRoutes:
    """The node-policy and pod-intent handlers; one instance per server."""

    def __init__(
        self,
        store: IntentStore,
        *,
        node_name: str,
        stats: RestStats,
        status: StatusFn | None,
        node_silence_s: float,
    ) -> None:
        self._store = store
        self._node_name = node_name
        self._stats = stats
        self._status = status
        self._push_lock = threading.Lock()  # one push/delete at a time, taken in a worker thread only
        self._contact_lock = threading.Lock()  # guards _silent_since; taken on the event loop, held briefly
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

    # -- node policies (source `manager`) --------------------------------------------------------

    async def push_node_policies(self, request: web.Request) -> web.Response:
        self._node_contact()
        try:
            push = node_policies(await read_json(request), self._store.max_intents_per_source)
        except BodyError as exc:
            return self._push_refused(request, str(exc))
        return await self._apply(request, NODE_SOURCE, lambda: push)

    async def delete_node_policies(self, request: web.Request) -> web.Response:
        self._node_contact()
        policy_id, delete_all = _delete_args(await read_json(request), "policyId")
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
        return success({"rootHash": await asyncio.to_thread(self._node_root)})

    def _node_root(self) -> str:
        current = self._store.get(NODE_SOURCE)
        if current is None:
            return EMPTY_ROOT
        if current.entries:
            return records_root(node_record_of(e) for e in current.entries)
        return records_root(legacy_node_record(i) for i in current.intents)

    async def list_node_policies(self, request: web.Request) -> web.Response:
        """Not upstream's: every entry the Manager pushed, and what became of it."""
        current, root = await asyncio.to_thread(lambda: (self._store.get(NODE_SOURCE), self._node_root()))
        entries = current.entries if current is not None else ()
        if current is not None and not entries:  # state written before entries were kept
            entries = tuple(SenderEntry(record=legacy_node_record(i).as_doc(), key=i.id, intent_id=i.id)
                            for i in current.intents)
        rows = await self._entry_rows(NODE_SOURCE, entries)
        return success({
            "generation": current.generation if current is not None else 0,
            "rootHash": root,
            "policies": rows,
        })

    def _node_contact(self) -> None:
        """The Manager looked at node policies: it has node intents somewhere (see _pod_contact)."""
        with self._contact_lock:
            self._silent_since = None

    # -- pod intents (source `manager-pods`) -----------------------------------------------------

    async def push_pod_intents(self, request: web.Request) -> web.Response:
        try:
            push = pod_intents(await read_json(request), self._store.max_intents_per_source)
        except BodyError as exc:
            return self._push_refused(request, str(exc))
        return await self._apply(request, POD_SOURCE, lambda: push)

    async def delete_pod_intents(self, request: web.Request) -> web.Response:
        pod_id, delete_all = _delete_args(await read_json(request), "podId")
        if not delete_all and not pod_id:
            return failure(400, "podId is required when 'all' is false")
        return await self._apply(
            request, POD_SOURCE,
            lambda: self._without(POD_SOURCE, delete_all,
                                  lambda e: pod_record_of(e).pod_id.lower() == pod_id.lower()),
            deleting=True,
        )

    async def pod_merkle(self, request: web.Request) -> web.Response:
        root = await asyncio.to_thread(self._pod_root)
        await self._pod_contact(request)
        return success({"rootHash": root})

    def _pod_root(self) -> str:
        current = self._store.get(POD_SOURCE)
        return records_root(pod_record_of(e) for e in (current.entries if current is not None else ()))

    async def list_pod_intents(self, request: web.Request) -> web.Response:
        """Not upstream's: every pod intent entry the Manager pushed, and what became of it."""
        current, root = await asyncio.to_thread(lambda: (self._store.get(POD_SOURCE), self._pod_root()))
        rows = await self._entry_rows(POD_SOURCE, current.entries if current is not None else ())
        return success({
            "generation": current.generation if current is not None else 0,
            "rootHash": root,
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
        with self._contact_lock:
            if self._silent_since is None:
                self._silent_since = now
            stale = self._node_silence_s > 0 and now - self._silent_since >= self._node_silence_s
        current = await asyncio.to_thread(self._store.get, NODE_SOURCE) if stale else None
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

    def node_name_mismatches(self) -> int:
        """Held entries of both Manager sources that name another node (applied all the same)."""
        held = (self._store.get(source) for source in (NODE_SOURCE, POD_SOURCE))
        return sum(1 for ss in held if ss is not None for e in ss.entries if e.other_node(self._node_name))

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
            with self._push_lock:
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


