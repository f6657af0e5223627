"""The merkle roots the Manager compares every 30 s, computed the way the Manager computes them.

If our root differs from the Manager's expectation it re-pushes the whole set every 30 s (what happens to
upstream's own Decision Maker, which hashes the fields in another order). So the leaf text, the leaf
order and the pairing below follow the Manager's side exactly:
- node policy leaf: sha256 hex of `nodeID=..|policyID=..|commandRegex=..|priority=N|executionTime=N`,
  leaves sorted by the string `nodeID|policyID|commandRegex|priority|executionTime`;
- pod intent leaf: sha256 hex of `podName=..|podID=..|nodeID=..|k8sNamespace=..|commandRegex=..|
  priority=N|executionTime=N|podLabels=k=v,k=v` (labels sorted), leaves sorted by the same values
  `|`-joined without the names;
- parent: sha256 of the 64 raw bytes the two child hex strings decode to; an odd last node pairs with
  itself; one leaf is its own root; no leaf: sha256 of the empty string.
Sorting compares UTF-8 bytes (Go string order); Python's code point order of `str` is the same order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gthulhu_node.intents.model import RecordValue

EMPTY_ROOT = hashlib.sha256(b"").hexdigest()


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _pair(left: str, right: str) -> str:
    try:
        data = bytes.fromhex(left) + bytes.fromhex(right)
    except ValueError:  # never for our own leaves; kept to mirror the Manager on non-hex input
        data = (left + right).encode()
    return hashlib.sha256(data).hexdigest()


def merkle_root(leaves: Sequence[str]) -> str:
    """Root of already ordered leaf hashes (hex)."""
    if not leaves:
        return EMPTY_ROOT
    level = list(leaves)
    while len(level) > 1:
        level = [
            _pair(level[i], level[i + 1] if i + 1 < len(level) else level[i])
            for i in range(0, len(level), 2)
        ]
    return level[0]


@dataclass(frozen=True, slots=True)
class NodePolicyRecord:
    """The five values of a node policy the Manager hashes."""

    node_id: str
    policy_id: str
    command_regex: str
    priority: int
    execution_time: int

    def sort_key(self) -> str:
        return "|".join(
            (self.node_id, self.policy_id, self.command_regex, str(self.priority), str(self.execution_time))
        )

    def as_doc(self) -> dict[str, RecordValue]:
        """The Manager's field names and values (what a SenderEntry keeps)."""
        return {"nodeID": self.node_id, "policyID": self.policy_id, "commandRegex": self.command_regex,
                "priority": self.priority, "executionTime": self.execution_time}

    @classmethod
    def from_doc(cls, doc: Mapping[str, RecordValue]) -> NodePolicyRecord:
        return cls(_text(doc, "nodeID"), _text(doc, "policyID"), _text(doc, "commandRegex"),
                   _number(doc, "priority"), _number(doc, "executionTime"))

    def leaf(self) -> str:
        return sha256_hex(
            f"nodeID={self.node_id}|policyID={self.policy_id}|commandRegex={self.command_regex}"
            f"|priority={self.priority}|executionTime={self.execution_time}"
        )


@dataclass(frozen=True, slots=True)
class PodIntentRecord:
    """The values of a pod intent the Manager hashes."""

    pod_name: str
    pod_id: str
    node_id: str
    namespace: str
    command_regex: str
    priority: int
    execution_time: int
    labels: Mapping[str, str] = field(default_factory=dict)

    def as_doc(self) -> dict[str, RecordValue]:
        """The Manager's field names and values (what a SenderEntry keeps)."""
        return {"podName": self.pod_name, "podID": self.pod_id, "nodeID": self.node_id,
                "k8sNamespace": self.namespace, "commandRegex": self.command_regex,
                "priority": self.priority, "executionTime": self.execution_time,
                "podLabels": dict(self.labels)}

    @classmethod
    def from_doc(cls, doc: Mapping[str, RecordValue]) -> PodIntentRecord:
        labels = doc.get("podLabels")
        return cls(_text(doc, "podName"), _text(doc, "podID"), _text(doc, "nodeID"),
                   _text(doc, "k8sNamespace"), _text(doc, "commandRegex"), _number(doc, "priority"),
                   _number(doc, "executionTime"), dict(labels) if isinstance(labels, dict) else {})

    def _labels(self) -> str:
        return ",".join(sorted(f"{k}={v}" for k, v in self.labels.items()))

    def sort_key(self) -> str:
        return "|".join(
            (
                self.pod_name,
                self.pod_id,
                self.node_id,
                self.namespace,
                self.command_regex,
                str(self.priority),
                str(self.execution_time),
                self._labels(),
            )
        )

    def leaf(self) -> str:
        return sha256_hex(
            f"podName={self.pod_name}|podID={self.pod_id}|nodeID={self.node_id}"
            f"|k8sNamespace={self.namespace}|commandRegex={self.command_regex}|priority={self.priority}"
            f"|executionTime={self.execution_time}|podLabels={self._labels()}"
        )


def records_root(records: Iterable[NodePolicyRecord | PodIntentRecord]) -> str:
    """Root over records in the Manager's order."""
    ordered = sorted(records, key=lambda r: r.sort_key())
    return merkle_root([r.leaf() for r in ordered])


def _text(doc: Mapping[str, RecordValue], key: str) -> str:
    value = doc.get(key, "")
    return value if isinstance(value, str) else ""


def _number(doc: Mapping[str, RecordValue], key: str) -> int:
    value = doc.get(key, 0)
    return value if isinstance(value, int) else 0
