"""What one source holds (`SourceSet`) and the content digest of a set: shared by the store, which
compares digests to tell a retry from a change, and its state file, which writes both."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gthulhu_node.intents.model import Intent, SenderEntry
from gthulhu_node.intents.parse import intent_to_doc

# Generations travel as uint64 in the gRPC API.
GENERATION_MAX = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SourceSet:
    """What one source holds now."""

    source: str
    generation: int
    intents: tuple[Intent, ...]
    # digest of the content of the last accepted push (a retry of it is a no-op)
    push_digest: str
    # unix time of the last change
    updated: float
    # the push as its sender wrote it, entry by entry (only senders that need it: the Manager)
    entries: tuple[SenderEntry, ...] = ()


def digest(intents: Sequence[Intent], entries: Sequence[SenderEntry] = ()) -> str:
    """Content digest of a set, independent of order (precedence never depends on it, and a sender's
    re-push in another order is the same set). Without sender entries the digest is the one earlier
    versions computed, so their state files stay valid."""
    return digest_docs(Docs.of(intents, entries))


def digest_docs(docs: Docs) -> str:
    ordered: list[Any] = sorted(docs.intents, key=lambda d: str(d["id"]))
    if docs.entries:
        ordered = [ordered, sorted(json.dumps(e, sort_keys=True) for e in docs.entries)]
    blob = json.dumps(ordered, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Docs:
    """The JSON documents of a set's intents and entries, made once per change: the digest, the journal
    record and the snapshot all need them, and making them is most of a large push's cost."""

    intents: list[dict[str, Any]]
    entries: list[dict[str, Any]]

    @classmethod
    def of(cls, intents: Sequence[Intent], entries: Sequence[SenderEntry]) -> Docs:
        return cls([intent_to_doc(i) for i in intents], [entry_doc(e) for e in entries])


def entry_doc(entry: SenderEntry) -> dict[str, Any]:
    return entry.model_dump(by_alias=True, mode="json")


EMPTY_DIGEST = digest(())
