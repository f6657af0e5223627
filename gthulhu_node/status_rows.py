"""The per-intent status rows: what each stored intent is (applied, pending, failed, not for this node)
and the warnings a person should see, from the engine's last figures, the store and the policy in effect.

Why apart from the thread that publishes them (gthulhu_node/agent_status.py): this is the rules of
status, a pure function of its inputs, read by anyone changing what a state or a warning means; the
thread, its wakes and the board are plumbing around it.
"""

from __future__ import annotations

from collections.abc import Mapping

from gthulhu_node.backends.base import BackendState
from gthulhu_node.intents.model import Intent, SenderEntry, intent_key, pattern_warnings
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.intents.status import (
    MAP_FULL_WARNING,
    NO_MATCH_WARNING,
    NOOP_WARNING,
    NOT_FOR_THIS_NODE_REASON,
    IntentState,
    IntentStatus,
)
from gthulhu_node.matching import resolve_users
from gthulhu_node.outbox import FailureReason
from gthulhu_node.policy_builder import Effect
from gthulhu_node.status_projection import IntentStats

EXECUTABLE_WARNING = (
    "executableRegex is not a security boundary (anyone can run the same executable): use users or "
    "cgroupRegex to restrict who is boosted"
)
NODE_MISMATCH_WARNING = (
    "the Manager sent this for node {target!r}, and this node calls itself {node!r}: applied all the same "
    "(the Manager chose this node); set node.name (or NODE_NAME) to the Kubernetes node name"
)


def intent_rows(
    sources: dict[str, SourceSet], stats: Mapping[str, IntentStats] | None, effect: Effect,
    backend: tuple[str, str], node_name: str, node_labels: dict[str, str],
) -> list[IntentStatus]:
    """One row per stored intent (and per pushed entry that became no intent). `stats`: the engine's last
    published figures (None while it does not run); `backend`: its state and the reason when not running."""
    backend_state, backend_reason = backend
    out: list[IntentStatus] = []
    for name, ss in sources.items():
        out.extend(_failed_entries(name, ss, node_name))
        sender_warnings = {e.intent_id: e.warnings + _mismatch_warning(e, node_name)
                           for e in ss.entries if e.intent_id}
        for intent in ss.intents:
            key = intent_key(name, intent.id)
            warnings: list[str] = list(sender_warnings.get(intent.id, ()))
            if intent.is_noop:
                warnings.append(NOOP_WARNING)
            warnings.extend(pattern_warnings(intent.command_regex))
            warnings.extend(_owner_warnings(intent))
            base = (name, intent)
            if not intent.selects_node(node_name, node_labels):
                reason = NOT_FOR_THIS_NODE_REASON.format(node=_describe_node(node_name, node_labels))
                out.append(
                    IntentStatus(*base, IntentState.NOT_FOR_THIS_NODE, reason, 0, 0.0, (), ss.generation)
                )
                continue
            st = stats.get(key) if stats is not None else None
            if effect.intents.get(key) != intent or st is None:
                out.append(
                    IntentStatus(*base, IntentState.PENDING, "", 0, 0.0, tuple(warnings), ss.generation)
                )
                continue
            state, reason = IntentState.APPLIED, ""
            if effect.error:
                state, reason = IntentState.FAILED, f"policy could not be built: {effect.error}"
            elif backend_state != BackendState.RUNNING.value:
                state, reason = IntentState.FAILED, f"backend is {backend_state}: {backend_reason}"
            elif st.pending_failures:
                state = IntentState.FAILED
                why = st.last_error or "write failed"
                reason = f"{st.pending_failures} task entries not written: {why}"
                if st.pending_reasons.get(FailureReason.MAP_FULL):
                    warnings.append(MAP_FULL_WARNING)
            elif st.unwritten:
                state, reason = IntentState.PENDING, f"{st.unwritten} task entries being written"
            if st.matched_tasks == 0:
                warnings.append(NO_MATCH_WARNING)
            elif st.applied_tasks == 0:
                warnings.append(f"matches {st.matched_tasks} tasks, but other intents win all of them")
            for winner, n in sorted(st.overlaps.items()):
                warnings.append(f"overlaps with {winner} on {n} tasks: {winner} wins")
            out.append(
                IntentStatus(*base, state, reason, st.applied_tasks, 0.0, tuple(warnings), ss.generation)
            )
    return out


def _owner_warnings(intent: Intent) -> list[str]:
    """What a person should know about who this intent can boost (docs/security.md)."""
    unknown = resolve_users(intent.users)[1] if intent.users else ()  # asked for every intent every second
    out = [f"users entry {name!r} is no user on this node: it matches nothing" for name in unknown]
    if intent.executable_regex is not None and not intent.names_owner:
        out.append(EXECUTABLE_WARNING)
    return out


def _mismatch_warning(entry: SenderEntry, node_name: str) -> tuple[str, ...]:
    """A Manager entry naming another node is applied all the same (the Manager chose this node to send it
    to; docs/rest.md), with this warning, so a misconfigured node name is seen rather than silent."""
    target = entry.other_node(node_name)
    return (NODE_MISMATCH_WARNING.format(target=target, node=node_name),) if target else ()


def _failed_entries(source: str, ss: SourceSet, node_name: str) -> list[IntentStatus]:
    """Status rows for pushed entries that became no intent (a lenient sender's, docs/rest.md).

    Their `intent` carries the sender's values unvalidated (model_construct), for display only: it is
    never stored as an intent nor handed to the reconciler.
    """
    out: list[IntentStatus] = []
    for entry in ss.entries:
        if not entry.failed:
            continue
        shown = Intent.model_construct(
            id=entry.key,
            command_regex=_record_text(entry.record.get("commandRegex")),
            priority=_record_int(entry.record.get("priority")),
            execution_time=_record_int(entry.record.get("executionTime")),
            node_names=(target,) if (target := _record_text(entry.record.get("nodeID"))) else (),
        )
        out.append(IntentStatus(source, shown, IntentState.FAILED, entry.failed, 0, 0.0,
                                _mismatch_warning(entry, node_name), ss.generation))
    return out


def _record_text(value: object) -> str:
    return value if isinstance(value, str) else ""


def _record_int(value: object) -> int:
    return value if isinstance(value, int) else 0


def _describe_node(name: str, labels: dict[str, str]) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"node {name!r}" + (f" (labels {shown})" if shown else " (no labels)")
