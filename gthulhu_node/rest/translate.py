"""Between the Manager's JSON and the intent contract.

Node policies (`POST /api/v1/node-intents`) become intents of the source `manager`: id = `policyID`,
`nodeID` -> `nodeNames: [nodeID]` (so status says "not for this node" when the Manager's node name is not
this node's configured name, instead of applying it silently; see docs/rest.md). Pod intents
(`POST /api/v1/intents`) become intents of `manager-pods` with `podUID` set.

Every value goes through the contract's own validation (`parse_intent`); error messages name the field
the way the Manager wrote it (`policies[3].priority: priority 25 is outside 0-20`). Fields the contract
does not know are ignored, as the Manager's Go decoder would ignore ours: a newer Manager adding a field
must not make every push fail.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from gthulhu_node.intents.model import Intent
from gthulhu_node.intents.parse import IntentValidationError, check_set, parse_intent
from gthulhu_node.rest.merkle import NodePolicyRecord, PodIntentRecord, sha256_hex

NAME_MAX = 253


class BodyError(ValueError):
    """A request body that is not what the route expects; the message names the field."""


def _list_field(body: Any, name: str) -> list[Any]:
    if not isinstance(body, Mapping):
        raise BodyError("request body must be a JSON object")
    value = body.get(name)
    if value is None:  # absent or null: Go decodes both to an empty slice
        return []
    if not isinstance(value, list):
        raise BodyError(f"{name}: expected a list")
    return value


def _str(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise BodyError(f"{where}.{key}: expected a string")
    if len(value) > NAME_MAX:
        raise BodyError(f"{where}.{key}: longer than {NAME_MAX} characters")
    return value


def _int_or_zero(item: Mapping[str, Any], key: str) -> Any:
    value = item.get(key)
    return 0 if value is None else value  # a wrong type is refused by the contract, naming the field


def _renamed(exc: IntentValidationError, renames: Sequence[tuple[str, str]]) -> BodyError:
    field = exc.field
    for ours, theirs in renames:
        field = re.sub(rf"\.{ours}(\[\d+\])?$", f".{theirs}", field)
    return BodyError(f"{field}: {exc.message}" if field else exc.message)


_POLICY_RENAMES = (("id", "policyID"), ("nodeNames", "nodeID"))
_POD_RENAMES = (("podUID", "podID"), ("nodeNames", "nodeID"))


def node_policies(body: Any, max_count: int) -> list[Intent]:
    """The intents of a node-intents push. Raises BodyError naming the field."""
    out: list[Intent] = []
    for index, item in enumerate(_list_field(body, "policies")):
        where = f"policies[{index}]"
        if not isinstance(item, Mapping):
            raise BodyError(f"{where}: expected an object")
        node_id = _str(item, "nodeID", where)
        doc: dict[str, Any] = {
            "id": _str(item, "policyID", where),
            "commandRegex": _str(item, "commandRegex", where),
            "priority": _int_or_zero(item, "priority"),
            "executionTime": _int_or_zero(item, "executionTime"),
        }
        if node_id:
            doc["nodeNames"] = [node_id]
        try:
            out.append(parse_intent(doc, where))
        except IntentValidationError as exc:
            raise _renamed(exc, _POLICY_RENAMES) from None
    try:
        check_set(out, max_count=max_count, where="policies")
    except IntentValidationError as exc:
        raise _renamed(exc, _POLICY_RENAMES) from None
    return out


def node_record(intent: Intent) -> NodePolicyRecord:
    """What the Manager hashes, recovered from a stored `manager` intent."""
    return NodePolicyRecord(
        node_id=intent.node_names[0] if intent.node_names else "",
        policy_id=intent.id,
        command_regex=intent.command_regex,
        priority=intent.priority,
        execution_time=intent.execution_time,
    )


def pod_intents(body: Any) -> tuple[list[Intent], list[PodIntentRecord]]:
    """The intents of a pod-intents push, and the records the Manager hashes for them.

    The intent id is `<podID>.<12 hex digits of the leaf hash>`: stable across re-pushes of the same
    intent, distinct for several intents of one pod. Records keep exact repeats (the Manager hashes
    them), intents do not.
    """
    intents: list[Intent] = []
    records: list[PodIntentRecord] = []
    seen: set[str] = set()
    for index, item in enumerate(_list_field(body, "intents")):
        where = f"intents[{index}]"
        if not isinstance(item, Mapping):
            raise BodyError(f"{where}: expected an object")
        labels_raw = item.get("podLabels") or {}
        if not isinstance(labels_raw, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in labels_raw.items()
        ):
            raise BodyError(f"{where}.podLabels: expected an object of strings")
        pod_id = _str(item, "podID", where)
        if not pod_id:
            raise BodyError(f"{where}.podID: required")
        priority = _int_or_zero(item, "priority")
        execution_time = _int_or_zero(item, "executionTime")
        record = PodIntentRecord(
            pod_name=_str(item, "podName", where),
            pod_id=pod_id,
            node_id=_str(item, "nodeID", where),
            namespace=_str(item, "k8sNamespace", where),
            command_regex=_str(item, "commandRegex", where),
            priority=priority if isinstance(priority, int) else 0,
            execution_time=execution_time if isinstance(execution_time, int) else 0,
            labels=dict(labels_raw),
        )
        doc: dict[str, Any] = {
            "id": f"{pod_id}.{sha256_hex(record.sort_key())[:12]}",
            "commandRegex": record.command_regex,
            "priority": priority,
            "executionTime": execution_time,
            "podUID": pod_id,
        }
        if record.node_id:
            doc["nodeNames"] = [record.node_id]
        try:
            intent = parse_intent(doc, where)
        except IntentValidationError as exc:
            if exc.field.endswith(".id"):  # only a bad podID can make the derived id invalid
                raise BodyError(f"{where}.podID: not a pod UID") from None
            raise _renamed(exc, _POD_RENAMES) from None
        records.append(record)
        if intent.id not in seen:  # an exact repeat (same id = same values) is one intent
            seen.add(intent.id)
            intents.append(intent)
    return intents, records
