"""`POST/GET /api/v1/runtime-config`: the Manager's per-node scheduler settings, and what we make of them.

Newer Managers push a node's runtime config on every reconcile cycle (Gthulhu/Gthulhu@c969a96b,
api/manager/service/cron_svc.go resyncRuntimeConfigsToDMs; fields from
api/decisionmaker/rest/runtime_config_handler.go) and show a failed push as an apply error. Most of
its fields describe upstream's own scheduler process (mode, scx binary, kernel mode, ...) and mean
nothing here. The node's owner decides which fields the Manager may set (`rest.runtime_config_allow`,
empty by default: a central service should not retune a node's scheduler unless the node says so);
every other field is accepted and reported as not applicable, in the answer, in GET and in status.

The state is the truth about what the agent runs with, and it is kept across restarts
(`runtime-config.json` under the state directory): what was received (so `configAvailable` stays true
after a restart and the Manager sees no drift), the allowed values accepted, which of them still wait for
a scheduler load, how many agent restarts brought such values into effect (`restartCount`) and the last
error (`lastError`: a value refused, the state not persisted). `applied` is true when everything of the
last push that can apply here is in effect. An allowed field applies at once unless it is a load-time
setting: `sliceNsDefault` is a constant of our BPF scheduler's program, so it takes effect when the
scheduler is next loaded (agent start), which is announced (log line, status note) because policies lapse
while the scheduler reloads. Nothing here reloads the scheduler by itself.
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
from gthulhu_node.intents.state_file import atomic_write
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
# the backends that load gthulhu's scheduler (dry-run stands in for it); with another (eevdf) a load-time
# setting of that scheduler configures nothing
SCHEDULER_BACKENDS = frozenset({"sched_ext", "dry-run"})
NO_SCHEDULER = ("no effect with the {backend} backend: the kernel's own slice applies (it sets gthulhu's "
                "sched_ext scheduler, not loaded here)")
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
    restart_count: int = 0  # agent restarts that brought a pending value into effect
    last_error: str = ""

    @property
    def in_effect(self) -> bool:
        """Whether the agent runs with everything of the last push that can apply here."""
        return bool(self.received) and not self.pending_reload and not self.last_error

    def document(self) -> dict[str, Any]:
        return {"received": self.received, "applied": self.applied, "appliedAt": self.applied_at,
                "pendingReload": self.pending_reload, "notApplicable": self.not_applicable,
                "restartCount": self.restart_count, "lastError": self.last_error}

    def notes(self) -> list[str]:
        """Lines for `gthulhu-node status` (the `manager` source's notes)."""
        out = [f"runtime-config {k}={self.applied[k]}: {RELOAD_NOTE}" for k in self.pending_reload]
        out += [f"runtime-config {k}: {why}" for k, why in sorted(self.not_applicable.items())]
        if self.last_error:
            out.append(f"runtime-config lastError: {self.last_error}")
        return out


class RuntimeConfig:
    """The runtime config route's state, persisted in `<state dir>/runtime-config.json`."""

    def __init__(self, state_dir: Path | None, allowed: frozenset[str]) -> None:
        self._path = state_dir / STATE_FILE if state_dir is not None else None
        self._allowed = allowed
        self.state = load_state(state_dir, allowed)

    def apply(self, fields: Mapping[str, Value], backend: str = "sched_ext") -> RuntimeConfigState:
        """Record a push: allowed, valid, changed values are persisted; everything else is reported.
        `backend`: the one running now (a scheduler setting means nothing to eevdf). Raises OSError when
        the state could not be persisted (then it is `lastError`, nothing changed)."""
        state = RuntimeConfigState(received=dict(fields), applied=dict(self.state.applied),
                                   pending_reload=list(self.state.pending_reload),
                                   applied_at=self.state.applied_at, restart_count=self.state.restart_count)
        changed: dict[str, Value] = {}
        refused: list[str] = []
        for key, value in fields.items():
            if key == "configVersion":
                continue
            if key not in APPLICABLE:
                state.not_applicable[key] = NOT_HERE
            elif key not in self._allowed:
                state.not_applicable[key] = NOT_ALLOWED
            elif key in NEEDS_RELOAD and backend not in SCHEDULER_BACKENDS:
                state.not_applicable[key] = NO_SCHEDULER.format(backend=backend or "current")
            elif isinstance(value, int) and not SLICE_MIN_NS <= value <= SLICE_MAX_NS:
                state.not_applicable[key] = f"{value} ns is outside {SLICE_MIN_NS}-{SLICE_MAX_NS} ns"
                refused.append(f"{key}: {state.not_applicable[key]}")
            elif state.applied.get(key) != value:
                changed[key] = value
        state.last_error = "; ".join(refused)
        if changed:
            state.applied.update(changed)
            state.applied_at = time.time()
            for key in sorted(changed):
                if key in NEEDS_RELOAD and key not in state.pending_reload:
                    state.pending_reload.append(key)
        if state.document() != self.state.document() and self._path is not None:
            try:
                atomic_write(self._path, json.dumps(state.document(), indent=1).encode() + b"\n")
            except OSError as exc:
                self.state.last_error = f"the runtime config could not be persisted: {exc}"
                raise
        if changed:
            for key in sorted(changed):
                log.warning("rest_runtime_config_changed", field=key, value=changed[key],
                            setting=APPLICABLE[key], effect=RELOAD_NOTE if key in NEEDS_RELOAD else "now")
        if state.not_applicable:
            log.info("rest_runtime_config_not_applicable", fields=sorted(state.not_applicable))
        self.state = state
        return state


def _read(state_dir: Path | None) -> dict[str, Any]:
    if state_dir is None:
        return {}
    try:
        doc = load_json((state_dir / STATE_FILE).read_bytes(), STATE_LIMITS)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.error("rest_runtime_config_unreadable", path=str(state_dir / STATE_FILE), error=str(exc))
        return {}
    return doc if isinstance(doc, dict) else {}


def load_state(state_dir: Path | None, allowed: frozenset[str]) -> RuntimeConfigState:
    """The persisted state (a file of an earlier version holds only `applied`). A value taken off the
    allowlist stops applying; what waited for a load is in effect, as the agent loaded it at start."""
    doc = _read(state_dir)
    received = doc.get("received")
    try:
        fields = parse_body(received) if isinstance(received, dict) else {}
    except BodyError:
        fields = {}
    not_applicable = doc.get("notApplicable")
    count = doc.get("restartCount")
    stamp = doc.get("appliedAt")
    error = doc.get("lastError")
    return RuntimeConfigState(
        received=fields,
        applied=_allowed_values(doc, allowed),
        not_applicable={k: v for k, v in not_applicable.items() if isinstance(v, str)}
        if isinstance(not_applicable, dict) else {},
        applied_at=float(stamp) if isinstance(stamp, int | float) and not isinstance(stamp, bool) else 0.0,
        restart_count=count if isinstance(count, int) and not isinstance(count, bool) else 0,
        last_error=error if isinstance(error, str) else "",
    )


def _allowed_values(doc: Mapping[str, Any], allowed: frozenset[str]) -> dict[str, Value]:
    applied = doc.get("applied")
    if not isinstance(applied, dict):
        return {}
    return {k: v for k, v in applied.items()
            if k in allowed and k in APPLICABLE and isinstance(v, int) and not isinstance(v, bool)
            and SLICE_MIN_NS <= v <= SLICE_MAX_NS}


def load_applied(state_dir: Path | None, allowed: frozenset[str]) -> dict[str, Value]:
    """The persisted values that are still allowed (a field removed from the allowlist stops applying)."""
    return _allowed_values(_read(state_dir), allowed)


def take_into_effect(state_dir: Path | None, allowed: frozenset[str]) -> dict[str, Value]:
    """At agent start, before the scheduler is loaded: the allowed values to load it with. Values that
    waited for this load are in effect from now on; that restart is counted (`restartCount`)."""
    doc = _read(state_dir)
    pending = doc.get("pendingReload")
    if state_dir is not None and isinstance(pending, list) and pending:
        count = doc.get("restartCount")
        doc["restartCount"] = (count if isinstance(count, int) and not isinstance(count, bool) else 0) + 1
        doc["pendingReload"] = []
        try:
            atomic_write(state_dir / STATE_FILE, json.dumps(doc, indent=1).encode() + b"\n")
        except OSError as exc:
            log.error("rest_runtime_config_unwritable", path=str(state_dir / STATE_FILE), error=str(exc))
    return _allowed_values(doc, allowed)


def default_slice_at_start(state_dir: Path | None, allowed: frozenset[str], configured: int) -> int:
    """The scheduler's default slice to load with: the Manager's sliceNsDefault when it set one through
    runtime-config (only if allowed), else `configured`. Called once, before the scheduler is loaded: this
    is when a changed sliceNsDefault takes effect."""
    slice_ns = take_into_effect(state_dir, allowed).get("sliceNsDefault")
    if not isinstance(slice_ns, int) or slice_ns == configured:
        return configured
    log.warning("runtime_config_applied", setting="scheduler.default_slice_ns", value=slice_ns,
                configured=configured, source="the Manager's runtime-config")
    return slice_ns
