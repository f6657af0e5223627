"""Between the Manager's JSON and the intent contract, as leniently as upstream's Decision Maker.

Upstream's Decision Maker accepts every push whose JSON decodes into its request struct (Go
`encoding/json`) and skips, at match time, what it cannot use (Gthulhu/Gthulhu@c969a96b,
api/decisionmaker/rest/node_policy_hdl.go, intent_handler.go, service/node_policy_svc.go). The Manager
never validates and never stops re-pushing a refused set, so refusing one entry would wedge every later
policy of the node. Hence two levels here:
- the body itself: not a JSON object, a field of the wrong JSON type, a number that does not fit Go's
  int64: BodyError (400 naming the field), as Go's decoder would refuse it. One bound of ours too:
  more entries than ENTRIES_HELD_FACTOR times the per-source limit cannot be held in bounded memory;
- each entry: kept as the Manager wrote it (a SenderEntry, so the merkle root is the Manager's) and
  turned into an intent when we can honour it; otherwise it is a failed entry with the reason, shown in
  status. Values out of our bounds follow upstream where it has a behaviour (a node policy without a
  pattern is skipped; a priority above 20 cannot be stored by upstream's scheduler either: both fail
  here, loudly) and are clamped with a warning where it has none (executionTime, a negative priority).
  Too long a name, a pattern RE2 refuses (no size limit of ours: upstream has none; RE2's memory bound
  keeps matching linear), entries beyond the per-source limit: failed entries too.

Entries are judged in the Manager's merkle order, never in the push's order, so a re-push of the same set
in another order is the same outcome (the same entry wins a duplicate policyID, the same ones are over
the limit) and a failed entry's key is made of its content, not its position.

Node policies become intents of the source `manager`: id = `policyID`. `nodeID` is kept in the entry but
does not select nodes: the Manager chose this node (status warns when the name is not ours).
Pod intents become intents of `manager-pods` with `podUID` set; an empty `commandRegex` there selects every
task of the pod but its pause container, as upstream's does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gthulhu_node.errors import InvalidInput
from gthulhu_node.intents.model import (
    ID_RE,
    PRIORITY_MAX,
    SLICE_MAX_NS,
    SLICE_MIN_NS,
    Intent,
    RecordValue,
    SenderEntry,
)
from gthulhu_node.intents.parse import IntentValidationError, parse_intent
from gthulhu_node.rest.merkle import NodePolicyRecord, PodIntentRecord, sha256_hex

NAME_MAX = 253
# Entries held per push, as a multiple of the per-source intent limit: those beyond the limit are kept
# (hashed, shown as failed) up to this many; a body with more is refused (memory, not meaning).
ENTRIES_HELD_FACTOR = 4
GO_INT64_MIN, GO_INT64_MAX = -(2**63), 2**63 - 1
# Upstream reads 0 two ways: its user-space mode (and this agent) as "no boost, custom slice", its kernel
# mode (the Helm default) as its strongest level. A Manager user may expect the latter: say so (issue 39).
PRIORITY_ZERO_NOTE = ("priority 0: no boost here (slice only, as upstream's user-space mode); upstream's "
                      "kernel mode (its Helm default) would have made it the strongest level: use 1 for that")


class BodyError(InvalidInput):
    """A request body that is not what the route expects; the message names the field."""


@dataclass(frozen=True, slots=True)
class Push:
    """What a push becomes: the intents to apply and every entry as the Manager wrote it."""

    intents: list[Intent]
    entries: list[SenderEntry]

    @property
    def failed(self) -> list[SenderEntry]:
        return [e for e in self.entries if e.failed]


def _list_field(body: Any, name: str, max_count: int) -> list[Any]:
    if not isinstance(body, Mapping):
        raise BodyError("Invalid request payload: expected a JSON object")
    value = body.get(name)
    if value is None:  # absent or null: Go decodes both to an empty slice, which empties the set
        return []
    if not isinstance(value, list):
        raise BodyError(f"{name}: expected a list")
    if len(value) > ENTRIES_HELD_FACTOR * max_count:
        held = ENTRIES_HELD_FACTOR * max_count
        raise BodyError(f"{name}: {len(value)} entries, more than can be held ({held} = "
                        f"{ENTRIES_HELD_FACTOR} x api.max_intents_per_source)")
    return value


def _item(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:  # Go decodes a null element of []struct to the zero struct
        return {}
    if not isinstance(value, Mapping):
        raise BodyError(f"{where}: expected an object")
    return value


def _str(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BodyError(f"{where}.{key}: expected a string")
    return value


def _too_long(**names: str) -> str:
    """Why an entry with a name over NAME_MAX characters fails ("" when none is): Go takes any length,
    our status and metrics labels do not."""
    for key, value in names.items():
        if len(value) > NAME_MAX:
            return f"{key} is {len(value)} characters, at most {NAME_MAX}: this entry is not applied"
    return ""


def _int(item: Mapping[str, Any], key: str, where: str) -> int:
    value = item.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise BodyError(f"{where}.{key}: expected an integer")
    if not GO_INT64_MIN <= value <= GO_INT64_MAX:
        raise BodyError(f"{where}.{key}: does not fit a 64-bit integer")
    return value


@dataclass(frozen=True, slots=True)
class _Values:
    """An entry's priority and slice as we can honour them, or why we cannot."""

    priority: int
    execution_time: int
    warnings: tuple[str, ...]
    failed: str = ""


def honourable(priority: int, execution_time: int) -> _Values:
    """Bring the Manager's numbers into the contract's bounds (module docstring: which and why)."""
    warnings: list[str] = []
    if priority > PRIORITY_MAX:
        return _Values(priority, execution_time, (), (
            f"priority {priority} is above {PRIORITY_MAX}: upstream's scheduler cannot store it either "
            f"(its map write fails silently); use 0-{PRIORITY_MAX}"
        ))
    if priority < 0:
        warnings.append(f"priority {priority} is negative: applied as 0 (no boost), as upstream boosts only "
                        "priority > 0")
        priority = 0
    elif priority == 0:
        warnings.append(PRIORITY_ZERO_NOTE)
    if execution_time < 0:
        warnings.append(f"executionTime {execution_time} ns is negative: applied as 0 (the default slice)")
        execution_time = 0
    elif 0 < execution_time < SLICE_MIN_NS:
        warnings.append(f"executionTime {execution_time} ns is below {SLICE_MIN_NS} ns: clamped to "
                        f"{SLICE_MIN_NS} ns")
        execution_time = SLICE_MIN_NS
    elif execution_time > SLICE_MAX_NS:
        warnings.append(f"executionTime {execution_time} ns is above {SLICE_MAX_NS} ns: clamped to "
                        f"{SLICE_MAX_NS} ns")
        execution_time = SLICE_MAX_NS
    return _Values(priority, execution_time, tuple(warnings))


def _outcome(doc: dict[str, Any], values: _Values, where: str) -> tuple[Intent | None, str]:
    """The intent an entry becomes, or None and why not (the contract's words, our field names). The
    pattern has no size limit of ours (upstream's has none): RE2 refuses what does not fit its memory."""
    if values.failed:
        return None, values.failed
    doc = {**doc, "priority": values.priority, "executionTime": values.execution_time}
    try:
        return parse_intent(doc, pattern_max_bytes=None), ""
    except IntentValidationError as exc:
        return None, exc.message


class _Keys:
    """Status names of entries that became no intent: `<id>#<12 hex of a hash of the entry>` (never an
    intent id: those cannot hold '#'). Made of the content, not the position, so the same set pushed in
    another order names them the same; an exact repeat gets `-2`, `-3`, ..."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def __call__(self, ident: str, content: str) -> str:
        # surrogatepass: a lone surrogate is refused by the store with its own message, not here
        digest = hashlib.sha256(content.encode("utf-8", "surrogatepass")).hexdigest()
        key = f"{ident if ID_RE.match(ident) else ''}#{digest[:12]}"
        n = self._seen[key] = self._seen.get(key, 0) + 1
        return key if n == 1 else f"{key}-{n}"


def _entry(record: dict[str, RecordValue], intent: Intent | None, key: str, failed: str,
           warnings: tuple[str, ...]) -> SenderEntry:
    if intent is not None:
        return SenderEntry(record=record, key=intent.id, intent_id=intent.id, warnings=warnings)
    return SenderEntry(record=record, key=key, failed=failed)


def _in_merkle_order(items: Sequence[Any], sort_key: Callable[[Any], str]) -> list[int]:
    """Indices of `items` in the Manager's merkle order (module docstring: why)."""
    return sorted(range(len(items)), key=lambda i: sort_key(items[i]))


def _over_limit(max_count: int) -> str:
    return (f"more than {max_count} entries can be applied per source (api.max_intents_per_source): "
            "this one is over the limit (the first ones in the Manager's merkle order are applied)")


def node_policies(body: Any, max_count: int) -> Push:
    """The intents and entries of a node-intents push. Raises BodyError (400) for a malformed body only."""
    records: list[NodePolicyRecord] = []
    for index, raw in enumerate(_list_field(body, "policies", max_count)):
        where = f"policies[{index}]"
        item = _item(raw, where)
        records.append(NodePolicyRecord(
            node_id=_str(item, "nodeID", where),
            policy_id=_str(item, "policyID", where),
            command_regex=_str(item, "commandRegex", where),
            priority=_int(item, "priority", where),
            execution_time=_int(item, "executionTime", where),
        ))
    intents: list[Intent] = []
    entries: list[SenderEntry | None] = [None] * len(records)
    taken: set[str] = set()
    keys = _Keys()
    for index in _in_merkle_order(records, NodePolicyRecord.sort_key):
        record = records[index]
        values = honourable(record.priority, record.execution_time)
        failed = _too_long(nodeID=record.node_id, policyID=record.policy_id)
        if failed:
            pass
        elif not record.command_regex:
            failed = (
                "commandRegex is empty: upstream's Decision Maker skips a node policy without a pattern; "
                "give one (^name$ for an exact thread name)"
            )
        elif record.policy_id in taken:
            failed = "duplicate policyID: another entry with it is applied (the first in the merkle order)"
        elif len(intents) >= max_count:
            failed = _over_limit(max_count)
        intent: Intent | None = None
        if not failed:
            intent, failed = _outcome({"id": record.policy_id, "commandRegex": record.command_regex}, values,
                                      f"policies[{index}]")
        if intent is not None:
            taken.add(record.policy_id)
            intents.append(intent)
        entries[index] = _entry(record.as_doc(), intent, keys(record.policy_id, record.sort_key()), failed,
                                values.warnings)
    return Push(intents, [e for e in entries if e is not None])


def pod_intents(body: Any, max_count: int) -> Push:
    """The intents and entries of a pod-intents push. Raises BodyError (400) for a malformed body only.

    The intent id is `<podID>.<12 hex digits of the leaf hash>`: stable across re-pushes of the same
    intent, distinct for several intents of one pod. Exact repeats stay separate entries (the Manager
    hashes each) but are one intent.
    """
    records: list[PodIntentRecord] = []
    for index, raw in enumerate(_list_field(body, "intents", max_count)):
        where = f"intents[{index}]"
        item = _item(raw, where)
        labels_raw = item.get("podLabels") or {}
        if not isinstance(labels_raw, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels_raw.items()
        ):
            raise BodyError(f"{where}.podLabels: expected an object of strings")
        records.append(PodIntentRecord(
            pod_name=_str(item, "podName", where),
            pod_id=_str(item, "podID", where),
            node_id=_str(item, "nodeID", where),
            namespace=_str(item, "k8sNamespace", where),
            command_regex=_str(item, "commandRegex", where),
            priority=_int(item, "priority", where),
            execution_time=_int(item, "executionTime", where),
            labels=dict(labels_raw),
        ))
    intents: list[Intent] = []
    entries: list[SenderEntry | None] = [None] * len(records)
    seen: set[str] = set()
    keys = _Keys()
    for index in _in_merkle_order(records, PodIntentRecord.sort_key):
        record = records[index]
        values = honourable(record.priority, record.execution_time)
        warnings = values.warnings
        if not record.command_regex:
            warnings += ("no commandRegex: every task of the pod but its pause container, as upstream",)
        ident = f"{record.pod_id}.{sha256_hex(record.sort_key())[:12]}"
        failed = _too_long(podName=record.pod_name, nodeID=record.node_id, k8sNamespace=record.namespace)
        intent: Intent | None = None
        if not record.pod_id:
            failed = "podID is empty: this intent selects no pod"
        elif not failed and ident not in seen and len(intents) >= max_count:
            failed = _over_limit(max_count)
        elif not failed:
            doc = {"id": ident, "commandRegex": record.command_regex, "podUID": record.pod_id}
            intent, failed = _outcome(doc, values, f"intents[{index}]")
            if intent is None and ID_RE.match(ident) is None:
                failed = "podID is not a pod UID: this intent selects no pod"
        if intent is not None and intent.id not in seen:
            seen.add(intent.id)
            intents.append(intent)
        key = keys(record.pod_id, record.sort_key())
        entries[index] = _entry(record.as_doc(), intent, key, failed, warnings)
    return Push(intents, [e for e in entries if e is not None])


def node_record_of(entry: SenderEntry) -> NodePolicyRecord:
    return NodePolicyRecord.from_doc(entry.record)


def pod_record_of(entry: SenderEntry) -> PodIntentRecord:
    return PodIntentRecord.from_doc(entry.record)


def legacy_node_record(intent: Intent) -> NodePolicyRecord:
    """What the Manager hashed, recovered from a `manager` intent stored before entries were kept (the
    contract then refused every value it could not hold as it was, so the intent is the record)."""
    return NodePolicyRecord(
        node_id=intent.node_names[0] if intent.node_names else "",
        policy_id=intent.id,
        command_regex=intent.command_regex,
        priority=intent.priority,
        execution_time=intent.execution_time,
    )
