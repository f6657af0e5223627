"""Turning raw documents (gRPC messages, policy files, REST bodies) into validated intents.

Every source goes through `parse_intent` / `check_set`, so a bad value is refused with the same words
whatever it came from, and the message names the field the way the sender wrote it
(`intents[2].priority: priority 25 is outside 0-20`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from gthulhu_node.errors import InvalidInput
from gthulhu_node.intents.model import (
    LIST_ENTRIES_PER_SOURCE_MAX,
    PATTERN_LIMIT,
    PATTERN_MAX_BYTES,
    Intent,
)


class IntentValidationError(InvalidInput):
    """A document that is not a valid intent (set). `field` is the path of the offending value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


def _loc_to_path(prefix: str, loc: Sequence[int | str]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def parse_intent(
    data: Mapping[str, Any], where: str = "", *, pattern_max_bytes: int | None = PATTERN_MAX_BYTES
) -> Intent:
    """Validate one intent document (upstream field names). Raises IntentValidationError naming the field.

    `pattern_max_bytes`: the commandRegex size limit; None for the Manager's sources (no limit but RE2's,
    as upstream, model.PATTERN_LIMIT)."""
    if not isinstance(data, Mapping):
        raise IntentValidationError(where, f"expected an object, got {type(data).__name__}")
    try:
        return Intent.model_validate(dict(data), context={PATTERN_LIMIT: pattern_max_bytes})
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        msg = str(err.get("msg", "invalid"))
        # pydantic prefixes messages of custom validators; the contract's own words are enough.
        for noise in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(noise)
        if err.get("type") == "extra_forbidden":
            msg = "unknown field"
        elif err.get("type") == "missing":
            msg = "required"
        return _raise(_loc_to_path(where, err.get("loc", ())), msg)


def _raise(field: str, msg: str) -> Intent:
    raise IntentValidationError(field, msg)


def check_set(intents: Sequence[Intent], *, max_count: int, where: str = "intents") -> None:
    """Refuse a set that is too large (intents, or their list entries together) or has duplicate ids."""
    if len(intents) > max_count:
        raise IntentValidationError(where, f"{len(intents)} intents, at most {max_count} per source")
    entries = sum(i.list_entries for i in intents)
    if entries > LIST_ENTRIES_PER_SOURCE_MAX:
        raise IntentValidationError(
            where,
            f"{entries} nodeNames and nodeSelectors entries in all, at most {LIST_ENTRIES_PER_SOURCE_MAX} "
            "per source",
        )
    seen: dict[str, int] = {}
    for index, intent in enumerate(intents):
        if intent.id in seen:
            raise IntentValidationError(
                f"{where}[{index}].id",
                f"duplicate id {intent.id!r} (also at {where}[{seen[intent.id]}])",
            )
        seen[intent.id] = index


def intent_to_doc(intent: Intent) -> dict[str, Any]:
    """The JSON document of an intent with upstream's field names (what files and the state hold)."""
    return intent.model_dump(by_alias=True, mode="json")
