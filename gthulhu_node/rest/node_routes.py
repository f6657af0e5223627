"""What REST says about the node itself and what it lets the Manager set on it: GET /api/v1/pods/pids
(the pods on this node and their processes) and GET/POST /api/v1/runtime-config (rest/runtime_config.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from gthulhu_node.rest.envelope import failure, now_rfc3339, read_json, success
from gthulhu_node.rest.pods import pods_on_node
from gthulhu_node.rest.runtime_config import RuntimeConfig, RuntimeConfigState, parse_body


class NodeRoutes:
    """The pods and runtime-config handlers; one instance per server."""

    def __init__(
        self,
        *,
        node_name: str,
        runtime_config: RuntimeConfig,
        proc_root: Path,
        backend_name: Callable[[], str],
    ) -> None:
        self._node_name = node_name
        self._runtime = runtime_config
        self._proc_root = proc_root
        self._backend_name = backend_name

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

    async def apply_runtime_config(self, request: web.Request) -> web.Response:
        fields = parse_body(await read_json(request))
        try:
            state = await asyncio.to_thread(self._runtime.apply, fields, self._backend_name())
        except OSError as exc:
            return failure(500, f"Failed to persist the runtime config: {exc}")
        return success(runtime_view(state))

    async def get_runtime_config(self, request: web.Request) -> web.Response:
        return success(runtime_view(self._runtime.state))

    def runtime_notes(self) -> list[str]:
        return self._runtime.state.notes()


def runtime_view(state: RuntimeConfigState) -> dict[str, Any]:
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
