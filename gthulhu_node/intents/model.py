"""The intent contract shared by every source and backend (docs/intents.md).

Validation lives here and only here, so a local file, a gRPC push and a REST push are refused for the same
reasons with the same words. Nothing is clamped: a value outside its bounds is an error naming the field.
"""

from __future__ import annotations

import enum
import functools
import re
import re._parser as re_parser  # type: ignore[import-not-found]  # the stdlib's regex parser: min width
import warnings
from collections.abc import Sized
from typing import Annotated, Any

import re2
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

# the limits shared with the backends (gthulhu_node/limits.py), re-exported: sources and tests read them here
from gthulhu_node.limits import PRIORITY_MAX as PRIORITY_MAX
from gthulhu_node.limits import SLICE_MAX_NS as SLICE_MAX_NS
from gthulhu_node.limits import SLICE_MIN_NS as SLICE_MIN_NS

ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}\Z")
SOURCE_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}\Z")
# manager-pods: the upstream Manager's pod intents (REST `POST /api/v1/intents`), kept apart from its
# node policies (`manager`) because each push replaces only its own set.
RESERVED_SOURCES = frozenset({"local", "manager", "manager-pods"})
# The sources upstream's Manager fills (over REST): lenient where upstream is (docs/rest.md).
SENDER_SOURCES = frozenset({"manager", "manager-pods"})
# A Kubernetes pod UID (a UUID, or 32 hex digits for static pods), as the Manager sends it.
POD_UID_RE = re.compile(r"^[0-9a-fA-F][0-9a-fA-F-]{0,63}\Z")

PATTERN_MAX_BYTES = 256
# Validation context key (`Intent.model_validate(doc, context={PATTERN_LIMIT: None})`): the pattern size
# limit for an intent whose sender is upstream's Manager, which accepts any length (Go's regexp); None
# leaves only RE2's own memory bound (RE2_MAX_MEM), which keeps matching linear in time and bounded in memory.
PATTERN_LIMIT = "pattern_max_bytes"
COMM_MAX_BYTES = 15
# RE2 refuses programs above this size; it keeps a valid-but-enormous pattern (a{1000}{1000}) out.
RE2_MAX_MEM = 8 << 20
# Caps on every list, so one intent (or one push) costs bounded memory whatever its source. A node name
# list names the nodes of a cluster (1,024 is more than one Manager push needs per policy); a node's
# labels are a few dozen at most. Per source, all intents' list entries together are capped too: 10,000
# intents of 1,024 names each would still be gigabytes.
NODE_NAMES_MAX = 1024
NODE_SELECTORS_MAX = 64
USERS_MAX = 64
# A uid, or a user name as useradd accepts it (a trailing $ for machine accounts).
USER_RE = re.compile(r"^([0-9]{1,10}|[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?)\Z")
LIST_ENTRIES_PER_SOURCE_MAX = 50_000
_NUL_ESCAPE = re.compile(r"\\(x00|x\{0+\}|0(?![0-7]))")
# A pod intent without a pattern selects every task of the pod but its pause container, as upstream's
# Decision Maker does (it skips processes whose comm is exactly "pause"). RE2 has no negative lookahead,
# so "anything but exactly `pause`" is spelled out prefix by prefix.
PAUSE_COMM = "pause"
ALL_BUT_PAUSE = r"^(?:$|[^p]|p$|p[^a]|pa$|pa[^u]|pau$|pau[^s]|paus$|paus[^e]|pause.)"


class Scope(enum.StrEnum):
    """What a match covers: the matching thread, or its whole process (through a TGID entry)."""

    THREAD = "thread"
    PROCESS = "process"


class NodeSelector(BaseModel):
    """One label requirement, as upstream writes it: `{"key": ..., "value": ...}`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    key: Annotated[str, Field(min_length=1, max_length=317)]
    value: Annotated[str, Field(max_length=63)] = ""


def compile_pattern(
    pattern: str, field: str = "commandRegex", max_bytes: int | None = PATTERN_MAX_BYTES
) -> Any:
    """Compile a user pattern with RE2 (linear time), refusing what the contract refuses.

    `max_bytes` None: no size limit of ours, only RE2's (a pattern whose program does not fit RE2_MAX_MEM
    is refused as invalid). Raises ValueError with a message that says what is wrong with the pattern.
    """
    size = len(pattern.encode())
    if size == 0:
        raise ValueError(f"{field} is empty")
    if max_bytes is not None and size > max_bytes:
        raise ValueError(f"{field} is {size} bytes, at most {max_bytes} are allowed")
    try:
        return _compiled(pattern) if size <= CACHED_PATTERN_MAX_BYTES else _make_regexp(pattern, _OPTIONS)
    except re2.error as exc:
        why = exc.args[0] if exc.args else ""
        if isinstance(why, bytes):
            why = why.decode("utf-8", "replace")
        shown = pattern if len(pattern) <= 80 else f"{pattern[:60]}... ({size} bytes)"
        raise ValueError(f"{field} {shown!r} is not valid RE2 syntax: {why}") from None


# Validation compiles a pattern, and so does every policy build after it: a cache makes the second (and
# a re-push of the same patterns) free. A compiled pattern is immutable and safe to share between threads.
# Only short patterns (thread names are at most 15 bytes: real ones are short) are kept: a program grows
# with its pattern, and 10,000 patterns of 280 characters held 30 MB (issue 38, item 6).
CACHED_PATTERN_MAX_BYTES = 64


@functools.lru_cache(maxsize=16_384)
def _compiled(pattern: str) -> Any:
    return _make_regexp(pattern, _OPTIONS)


_OPTIONS = re2.Options()
_OPTIONS.max_mem = RE2_MAX_MEM
_OPTIONS.log_errors = False
# re2.compile copies every option into a fresh Options object on each call, which costs twice what
# compiling a short pattern does (a 10,000-policy push compiles 10,000). The class it then builds takes
# the options as they are; re2.compile stays the fallback should the binding rename it.
_make_regexp: Any = getattr(re2, "_Regexp", re2.compile)


# Status asks every second for every intent's warnings; parsing a pattern with the stdlib's parser takes
# about 100 us, so a cache smaller than the patterns in effect (10,000 from one Manager push) made each
# refresh re-parse them all, holding the GIL for a second. Larger than the store's limits together.
@functools.lru_cache(maxsize=65_536)
def pattern_warnings(pattern: str) -> tuple[str, ...]:
    """What makes a valid pattern unable to match any thread name (comm: at most 15 bytes, no NUL)."""
    out: list[str] = []
    if "\x00" in pattern or _NUL_ESCAPE.search(pattern):
        out.append("commandRegex contains NUL, which no thread name (comm) contains")
    try:
        with warnings.catch_warnings():  # the stdlib parser's FutureWarnings are about its own syntax
            warnings.simplefilter("ignore")
            shortest = re_parser.parse(pattern).getwidth()[0]
    except (re.error, RecursionError, OverflowError):
        shortest = 0  # RE2-only syntax: no opinion
    if shortest > COMM_MAX_BYTES:
        out.append(
            f"commandRegex needs at least {shortest} characters, but a thread name (comm) has at most "
            f"{COMM_MAX_BYTES} bytes: it can never match"
        )
    return tuple(out)


def _check_count(value: Any, name: str, limit: int) -> Any:
    if isinstance(value, Sized) and not isinstance(value, str | bytes) and len(value) > limit:
        raise ValueError(f"{name} has {len(value)} entries, at most {limit} are allowed")
    return value


class Intent(BaseModel):
    """One rule for this node. Field names follow upstream's REST API so its JSON works unchanged."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    id: str
    command_regex: str = Field(alias="commandRegex")
    priority: int = 0
    execution_time: int = Field(default=0, alias="executionTime")
    scope: Scope = Scope.THREAD
    node_names: tuple[str, ...] = Field(default=(), alias="nodeNames")
    node_selectors: tuple[NodeSelector, ...] = Field(default=(), alias="nodeSelectors")
    # Optional extra selector: only threads of processes in this pod's cgroup (matched through
    # /proc/<pid>/cgroup). Left out of documents when unset, so other intents serialize as before.
    pod_uid: str | None = Field(default=None, alias="podUID", exclude_if=lambda v: v is None)
    # Optional selectors on who may be boosted (docs/security.md): the process's user (uid or name), its
    # cgroup v2 path (RE2 search), its executable path (RE2 search). Left out of documents when unset.
    users: tuple[str, ...] = Field(default=(), exclude_if=lambda v: not v)
    cgroup_regex: str | None = Field(default=None, alias="cgroupRegex", exclude_if=lambda v: v is None)
    executable_regex: str | None = Field(default=None, alias="executableRegex",
                                         exclude_if=lambda v: v is None)

    @field_validator("id")
    @classmethod
    def _check_id(cls, v: str) -> str:
        if not ID_RE.match(v):
            raise ValueError("id must be 1-64 characters of [A-Za-z0-9._-]")
        return v

    @field_validator("pod_uid")
    @classmethod
    def _check_pod_uid(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not POD_UID_RE.match(v):
            raise ValueError("podUID must be a pod UID: 1-64 hex digits and '-'")
        return v.lower()

    @field_validator("node_names", mode="before")
    @classmethod
    def _cap_node_names(cls, v: Any) -> Any:
        return _check_count(v, "nodeNames", NODE_NAMES_MAX)

    @field_validator("node_selectors", mode="before")
    @classmethod
    def _cap_node_selectors(cls, v: Any) -> Any:
        return _check_count(v, "nodeSelectors", NODE_SELECTORS_MAX)

    @field_validator("users", mode="before")
    @classmethod
    def _check_users(cls, v: Any) -> Any:
        _check_count(v, "users", USERS_MAX)
        if isinstance(v, list | tuple):
            v = [str(u) if isinstance(u, int) and not isinstance(u, bool) else u for u in v]
            for u in v:
                if not isinstance(u, str) or not USER_RE.match(u) or (u.isdigit() and int(u) >= 2**32 - 1):
                    raise ValueError(f"users entry {u!r} is neither a uid (0-4294967294) nor a user name")
        return v

    @field_validator("cgroup_regex", "executable_regex")
    @classmethod
    def _check_owner_patterns(cls, v: str | None, info: Any) -> str | None:
        if v is not None:
            compile_pattern(v, "cgroupRegex" if info.field_name == "cgroup_regex" else "executableRegex")
        return v

    @field_validator("command_regex")
    @classmethod
    def _check_regex(cls, v: str, info: ValidationInfo) -> str:
        if v:  # empty: allowed for pod intents only, checked with the whole intent below
            context = info.context if isinstance(info.context, dict) else {}
            compile_pattern(v, max_bytes=context.get(PATTERN_LIMIT, PATTERN_MAX_BYTES))
        return v

    @field_validator("priority", mode="before")
    @classmethod
    def _check_priority(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("priority must be an integer")
        if not 0 <= v <= PRIORITY_MAX:
            raise ValueError(f"priority {v} is outside 0-{PRIORITY_MAX}")
        return v

    @field_validator("execution_time", mode="before")
    @classmethod
    def _check_slice(cls, v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError("executionTime must be an integer number of nanoseconds")
        if v != 0 and not SLICE_MIN_NS <= v <= SLICE_MAX_NS:
            raise ValueError(
                f"executionTime {v} ns is outside 0 or {SLICE_MIN_NS}-{SLICE_MAX_NS} ns"
            )
        return v

    @field_validator("node_names")
    @classmethod
    def _check_node_names(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for name in v:
            if not name or len(name) > 253:
                raise ValueError("nodeNames entries must be 1-253 characters")
        return v

    @model_validator(mode="after")
    def _check_whole(self) -> Intent:
        if not self.command_regex and self.pod_uid is None:
            raise ValueError("commandRegex is empty (only a pod intent may leave it empty)")
        return self

    @property
    def list_entries(self) -> int:
        """Entries of its lists, counted against LIST_ENTRIES_PER_SOURCE_MAX."""
        return len(self.node_names) + len(self.node_selectors) + len(self.users)

    @property
    def names_owner(self) -> bool:
        """Whether it restricts matching to tasks of given users or cgroups (a pod is a cgroup): what
        `security.unprivileged_tasks: named_only` asks of an intent before it may boost such a task."""
        return bool(self.users) or self.cgroup_regex is not None or self.pod_uid is not None

    @property
    def matching_pattern(self) -> str:
        """The pattern tasks are matched with: the pod-wide one when a pod intent has none."""
        return self.command_regex or ALL_BUT_PAUSE

    @property
    def is_noop(self) -> bool:
        """priority 0 and executionTime 0: valid, but changes nothing (status carries a warning)."""
        return self.priority == 0 and self.execution_time == 0

    def selects_node(self, node_name: str, labels: dict[str, str]) -> bool:
        """Empty nodeNames and nodeSelectors mean this node (an intent given to this node's agent is for
        it). Otherwise both must hold, as upstream's Manager resolves a policy's nodes (the intersection
        of nodeNames and the label query; Gthulhu/Gthulhu@c969a96b api/manager/service/node_policy_svc.go
        resolveNodesForPolicy, k8s_adapter/adapter.go QueryNodesBySelectors)."""
        if self.node_names and node_name not in self.node_names:
            return False
        return all(labels.get(sel.key) == sel.value for sel in self.node_selectors)


RecordValue = str | int | dict[str, str]


class SenderEntry(BaseModel):
    """One entry of a push as its sender wrote it, and what became of it.

    Why: a lenient sender (upstream's Manager) hashes what it sent, not what we made of it, and expects
    every entry to be kept, including the ones we cannot honour. The store keeps these next to the
    intents (persisted in the same atomic write), so the merkle root and the status describe the same
    push after a restart. `intent_id` names the intent the entry became ("" when it became none);
    `failed` says why it could not be honoured; `warnings` what was changed to honour it (a clamped
    value); `key` is how status names it (the intent id, or `<id>#<index>` for an entry that is not one).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    record: dict[str, RecordValue]
    key: str
    intent_id: str = ""
    failed: str = ""
    warnings: tuple[str, ...] = ()

    def other_node(self, node_name: str) -> str:
        """The node the sender meant this entry for (its `nodeID`) when that is not `node_name`, else ""."""
        node_id = self.record.get("nodeID")
        return node_id if isinstance(node_id, str) and node_id and node_id != node_name else ""


def intent_key(source: str, intent_id: str) -> str:
    """The full key of an intent: `source/id`. It orders ties in precedence."""
    return f"{source}/{intent_id}"


def check_source(source: str, *, allow_reserved: bool = False) -> str:
    """Validate a source name; `local` and `manager` are reserved for the agent's own sources."""
    if not SOURCE_RE.match(source):
        raise ValueError("source must be 1-63 characters of [a-z0-9._-], starting with a letter or digit")
    if source in RESERVED_SOURCES and not allow_reserved:
        raise ValueError(f"source {source!r} is reserved")
    return source
