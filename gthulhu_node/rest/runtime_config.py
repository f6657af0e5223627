"""`POST/GET /api/v1/runtime-config`: the Manager's per-node scheduler settings, and what we make of them.

Newer Managers push a node's runtime config on every reconcile cycle (Gthulhu/Gthulhu@c969a96b,
api/manager/service/cron_svc.go resyncRuntimeConfigsToDMs; fields from
api/decisionmaker/rest/runtime_config_handler.go) and show a failed push as an apply error. Most of
its fields describe upstream's own scheduler process (mode, scx binary, kernel mode, ...) and mean
nothing here. The node's owner decides which fields the Manager may set (`rest.runtime_config_allow`,
empty by default: a central service should not retune a node's scheduler unless the node says so);
every other field is accepted and reported as not applicable, in the answer, in GET and in status.

An allowed field is applied only when its value changes and is persisted under the state directory.
`sliceNsDefault` is a load-time setting of our scheduler: it takes effect when the scheduler is next
loaded (agent start), which is announced (log line, status note) because policies lapse while the
scheduler reloads. Nothing here reloads the scheduler by itself.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gthulhu_node.intents.documents import STATE_LIMITS, load_json
from gthulhu_node.intents.model import SLICE_MAX_NS, SLICE_MIN_NS
from gthulhu_node.intents.store import atomic_write
from gthulhu_node.rest.translate import BodyError

log = structlog.get_logger(__name__)

STATE_FILE = "runtime-config.json"
STRING_FIELDS = ("configVersion", "mode", "schedulerName")
UINT_FIELDS = ("sliceNsDefault", "sliceNsMin")
BOOL_FIELDS = ("kernelMode", "maxTimeWatchdog", "earlyProcessing", "builtinIdle", "schedulerEnabled",
               "monitoringEnabled")
# the fields a node may let the Manager set, and the setting each one is
APPLICABLE = {"sliceNsDefault": "scheduler.default_slice_ns"}
NEEDS_RELOAD = frozenset({"sliceNsDefault"})
NOT_HERE = "not applicable on gthulhu-node: it describes upstream's scheduler process"
NOT_ALLOWED = "not applied: rest.runtime_config_allow does not list it"
RELOAD_NOTE = ("takes effect when the scheduler is next loaded (agent restart); scheduling policies lapse "
               "while it reloads")

Value = str | int | bool


def parse_body(body: Any) -> dict[str, Value]:
    """The fields the Manager sent, typed as its Go struct types them. Raises BodyError naming the field."""
    if not isinstance(body, Mapping):
        raise BodyError("Invalid request payload: expected a JSON object")
    out: dict[str, Value] = {}
    for key, value in body.items():
        if value is None:
            continue
        if key in STRING_FIELDS:
            if not isinstance(value, str) or len(value) > 253:
                raise BodyError(f"{key}: expected a string of at most 253 characters")
        elif key in UINT_FIELDS:
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
                raise BodyError(f"{key}: expected an unsigned 64-bit integer")
        elif key in BOOL_FIELDS:
            if not isinstance(value, bool):
                raise BodyError(f"{key}: expected true or false")
        else:
            continue  # a field a newer Manager adds: ignored, as Go's decoder ignores unknown fields
        out[key] = value
    return out


@dataclass(slots=True)
class RuntimeConfigState:
    """What was received last, what of it is in effect or waits for a reload, and why the rest is not."""

    received: dict[str, Value] = field(default_factory=dict)
    applied: dict[str, Value] = field(default_factory=dict)  # allowed values, persisted
    pending_reload: list[str] = field(default_factory=list)
    not_applicable: dict[str, str] = field(default_factory=dict)
    applied_at: float = 0.0

    def notes(self) -> list[str]:
        """Lines for `gthulhu-node status` (the `manager` source's notes)."""
        out = [f"runtime-config {k}={self.applied[k]}: {RELOAD_NOTE}" for k in self.pending_reload]
        out += [f"runtime-config {k}: {why}" for k, why in sorted(self.not_applicable.items())]
        return out


class RuntimeConfig:
    """The runtime config route's state, persisted in `<state dir>/runtime-config.json`."""

    def __init__(self, state_dir: Path | None, allowed: frozenset[str]) -> None:
        self._path = state_dir / STATE_FILE if state_dir is not None else None
        self._allowed = allowed
        self.state = RuntimeConfigState(applied=load_applied(state_dir, allowed))

    def apply(self, fields: Mapping[str, Value]) -> RuntimeConfigState:
        """Record a push: allowed, valid, changed values are persisted; everything else is reported."""
        state = RuntimeConfigState(received=dict(fields), applied=dict(self.state.applied),
                                   pending_reload=list(self.state.pending_reload),
                                   applied_at=self.state.applied_at)
        changed: dict[str, Value] = {}
        for key, value in fields.items():
            if key == "configVersion":
                continue
            if key not in APPLICABLE:
                state.not_applicable[key] = NOT_HERE
            elif key not in self._allowed:
                state.not_applicable[key] = NOT_ALLOWED
            elif isinstance(value, int) and not SLICE_MIN_NS <= value <= SLICE_MAX_NS:
                state.not_applicable[key] = f"{value} ns is outside {SLICE_MIN_NS}-{SLICE_MAX_NS} ns"
            elif state.applied.get(key) != value:
                changed[key] = value
        if changed:
            state.applied.update(changed)
            state.applied_at = time.time()
            if self._path is not None:
                atomic_write(self._path, json.dumps({"applied": state.applied}, indent=1).encode() + b"\n")
            for key in sorted(changed):
                if key in NEEDS_RELOAD and key not in state.pending_reload:
                    state.pending_reload.append(key)
                log.warning("rest_runtime_config_changed", field=key, value=changed[key],
                            setting=APPLICABLE[key], effect=RELOAD_NOTE if key in NEEDS_RELOAD else "now")
        if state.not_applicable:
            log.info("rest_runtime_config_not_applicable", fields=sorted(state.not_applicable))
        self.state = state
        return state


def load_applied(state_dir: Path | None, allowed: frozenset[str]) -> dict[str, Value]:
    """The persisted values that are still allowed (a field removed from the allowlist stops applying)."""
    if state_dir is None:
        return {}
    try:
        doc = load_json((state_dir / STATE_FILE).read_bytes(), STATE_LIMITS)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.error("rest_runtime_config_unreadable", path=str(state_dir / STATE_FILE), error=str(exc))
        return {}
    applied = doc.get("applied") if isinstance(doc, dict) else None
    if not isinstance(applied, dict):
        return {}
    return {k: v for k, v in applied.items()
            if k in allowed and k in APPLICABLE and isinstance(v, int) and not isinstance(v, bool)
            and SLICE_MIN_NS <= v <= SLICE_MAX_NS}
