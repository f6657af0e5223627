"""Matching tasks to intents: compiled RE2 patterns and the precedence of docs/watching.md ("Precedence").

A pattern is an unanchored RE2 search on the task's comm (the kernel's 15-byte thread name, not the
command line). When several intents match one task, exactly one wins, never a merge:
  1. the stronger `priority` (limits.strength: 1 strongest, 20 weakest, 0 weaker than any);
  2. then the smaller non-zero `executionTime` (a non-zero slice beats 0, the scheduler's default);
  3. then the lexicographically smaller `source/id`.
An intent with `podUID` matches only threads of processes in that pod's cgroup (/proc/<pid>/cgroup); the
reconciler reads a process's pod once, only when such an intent's pattern matches one of its threads.
This order is total, so every task has at most one winner and the result never depends on input order.

Many threads share a comm, so results are cached per comm (a bounded dict: comm is at most 15 bytes and
the number of distinct names on a host is small). A `PolicySet` is immutable: a policy change builds a
new one and the reconciler recomputes everything against it.

Why an RE2 set: a new policy meets every distinct comm again, and searching each comm with each pattern
made a 1,000-intent apply against 2,000 threads take about a second. `PatternSet` puts the distinct
patterns into RE2 sets (one DFA pass per comm answers "which patterns match"), so that cost no longer
grows with the number of intents. Compiled patterns are cached (`intents.model.compile_pattern`), so a
build after validation, or after a change of a few intents, compiles only patterns it has not seen.
"""

from __future__ import annotations

import errno
import os
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import re2

from gthulhu_node.intents.model import Intent, Scope, compile_pattern
from gthulhu_node.limits import strength

# Bound on the per-comm cache; names past it are matched without caching (never wrong, only slower).
COMM_CACHE_MAX = 65_536
# Patterns per RE2 set: a DFA state of a set holds the instructions of every pattern still alive, so one
# set of 60,000 patterns would need far larger states than 60 sets of 1,000 (and compiles no faster).
# Small enough that one set's compile, a single call holding the GIL (so stopping the engine thread too,
# although the policy is built on another), stays near 10 ms: 1,024 took 95-235 ms on a loaded 2-core
# host, 128 took 12-24 ms; an uncached name then costs 18 us instead of 8 us with 1,000 intents.
SET_CHUNK = 128
# A set's DFA budget (allocated as states are met, not up front); RE2's default is 8 MiB.
SET_MAX_MEM = 32 << 20
# A text no thread name can be (comm never holds NUL): the pattern that finds it tells whether a compiled
# set's DFA works, because RE2::Set::Match answers "no match" when its DFA runs out of memory.
_SENTINEL_TEXT = "\x00gthulhu-set-check\x00"
_SENTINEL_PATTERN = r"\A\x00gthulhu-set-check\x00\z"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who a process is, for the owner selectors (users, cgroupRegex, executableRegex)."""

    uid: int  # the real uid: the user who started it (a setuid program keeps its caller's)
    cgroup: str  # the cgroup v2 path ("/system.slice/x.service"), or the whole file on cgroup v1
    exe: str  # the executable's path ("" for kernel threads)


def read_owner(tgid: int, proc_root: Path = Path("/proc")) -> Owner | None:
    """The owner of a process; None when it is gone (then owner selectors fail closed: an intent that
    asks who the process is does not match it). Raises OSError for other read errors (EMFILE, EACCES),
    which the caller must not remember as an answer."""
    base = b"%s/%d" % (os.fsencode(proc_root), tgid)
    try:
        with open(base + b"/status", "rb") as f:
            status = f.read(4096)
        with open(base + b"/cgroup", "rb") as f:
            cgroup_text = f.read(8192).decode("utf-8", "replace")
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    uid = next((int(line.split()[1]) for line in status.splitlines() if line.startswith(b"Uid:")), None)
    if uid is None:
        return None
    v2 = [line[3:] for line in cgroup_text.splitlines() if line.startswith("0::")]
    try:
        exe = os.fsdecode(os.readlink(base + b"/exe"))
    except OSError:
        exe = ""
    return Owner(uid, v2[0] if v2 else cgroup_text, exe)


def resolve_users(names: Iterable[str]) -> tuple[frozenset[int], tuple[str, ...]]:
    """uids of `users` entries, and the names that are no user here (they match nothing)."""
    uids: set[int] = set()
    unknown: list[str] = []
    for name in names:
        if name.isdigit():
            uids.add(int(name))
            continue
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            unknown.append(name)
    return frozenset(uids), tuple(unknown)


@dataclass(frozen=True, slots=True, eq=False)
class CompiledIntent:
    """One intent, ready to match. `rank` orders precedence: the smallest rank wins."""

    key: str  # "source/id"
    intent: Intent
    rank: tuple[int, int, str]
    # owner selectors, compiled: None when the intent has none
    uids: frozenset[int] | None = None
    cgroup: Any = None
    exe: Any = None

    @property
    def needs_owner(self) -> bool:
        return self.uids is not None or self.cgroup is not None or self.exe is not None

    def admits(self, owner: Owner | None, named_only: bool) -> bool:
        """Whether a process with this owner may get this intent (docs/security.md)."""
        if owner is None:
            return not self.needs_owner and not named_only
        if self.uids is not None and owner.uid not in self.uids:
            return False
        if self.cgroup is not None and self.cgroup.search(owner.cgroup) is None:
            return False
        if self.exe is not None and self.exe.search(owner.exe) is None:
            return False
        return not named_only or owner.uid == 0 or self.intent.names_owner

    @property
    def pattern(self) -> Any:
        """The compiled pattern (re2._Regexp), compiled when asked for: matching goes through RE2 sets
        (PatternSet), and a program kept per intent for the policy's life held 30 MB for a Manager push of
        10,000 patterns of 280 characters (issue 38, item 6). Short patterns come from compile_pattern's
        cache."""
        return compile_pattern(self.intent.matching_pattern, max_bytes=None)

    @property
    def priority(self) -> int:
        return self.intent.priority

    @property
    def slice_ns(self) -> int:
        return self.intent.execution_time

    @property
    def scope(self) -> Scope:
        return self.intent.scope

    @property
    def is_noop(self) -> bool:
        """Matches, but writes nothing (priority 0 and executionTime 0)."""
        return self.intent.is_noop

    @property
    def pod_uid(self) -> str | None:
        """When set, only threads of processes in this Kubernetes pod's cgroup match (normalized)."""
        uid = self.intent.pod_uid
        return None if uid is None else normalize_pod_uid(uid)


def precedence_rank(key: str, intent: Intent) -> tuple[int, int, str]:
    """The sort key of the precedence (docs/watching.md): smaller is stronger."""
    slice_rank = intent.execution_time if intent.execution_time > 0 else 1 << 62
    return (-strength(intent.priority), slice_rank, key)


@dataclass(frozen=True, slots=True)
class CommMatch:
    """What one comm matches, each tuple strongest first."""

    thread: tuple[CompiledIntent, ...]  # scope=thread intents whose pattern matches
    process: tuple[CompiledIntent, ...]  # scope=process intents whose pattern matches

    @property
    def any(self) -> bool:
        return bool(self.thread or self.process)


_NO_MATCH = CommMatch((), ())


# A pod's cgroup directory names its UID: `pod<uid>` with the cgroupfs driver, `pod<uid with _>` with the
# systemd driver (kubepods-burstable-pod1234_5678....slice).
_POD_IN_CGROUP = re2.compile(
    r"pod([0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}|[0-9a-fA-F]{32})"
)


def pod_uid_of(cgroup_text: str) -> str | None:
    """The pod UID in a /proc/<pid>/cgroup file's text (normalized, see normalize_pod_uid), or None."""
    m = _POD_IN_CGROUP.search(cgroup_text)
    if m is None:
        return None
    return normalize_pod_uid(str(m.group(1)))


def normalize_pod_uid(uid: str) -> str:
    """Compare pod UIDs by their hex digits only: cgroup drivers write '-' as '_' (or drop it)."""
    return uid.replace("-", "").replace("_", "").lower()


_GONE = frozenset({errno.ENOENT, errno.ESRCH})


def read_pod_uid(tgid: int, proc_root: Path = Path("/proc")) -> str | None:
    """The pod a process belongs to, from its cgroup; None when it is in none (or is gone).

    Raises OSError when the file could not be read for another reason (EMFILE, EACCES): "unknown" is not
    "in no pod", and the caller must not remember it as such."""
    try:
        with open(b"%s/%d/cgroup" % (os.fsencode(proc_root), tgid), "rb") as f:
            text = f.read(8192).decode("utf-8", "replace")
    except OSError as exc:
        if exc.errno in _GONE:
            return None
        raise
    return pod_uid_of(text)


def _compile(key: str, intent: Intent) -> CompiledIntent:
    # refuses here too what its source refused (its size was checked there); the program is not kept
    compile_pattern(intent.matching_pattern, max_bytes=None)
    return CompiledIntent(
        key,
        intent,
        precedence_rank(key, intent),
        uids=resolve_users(intent.users)[0] if intent.users else None,
        cgroup=compile_pattern(intent.cgroup_regex, "cgroupRegex") if intent.cgroup_regex else None,
        exe=compile_pattern(intent.executable_regex, "executableRegex") if intent.executable_regex else None,
    )


def best(candidates: Iterable[CompiledIntent | None]) -> CompiledIntent | None:
    """The winner among candidates by precedence (None when there is none)."""
    winner: CompiledIntent | None = None
    for c in candidates:
        if c is not None and (winner is None or c.rank < winner.rank):
            winner = c
    return winner


class PatternSet:
    """Which of many patterns match a text, answered by RE2 sets instead of one search per pattern.

    Same answer as `compiled.search(text) is not None` for each pattern: both are unanchored RE2 searches
    with the same options. A pattern a set refuses, or a set whose DFA fails its check after compiling,
    falls back to per-pattern searches (slower, never wrong).
    """

    def __init__(self, patterns: Sequence[str]) -> None:
        """`patterns`: pattern texts (each valid for compile_pattern); `match` returns their indices."""
        self._sets: list[tuple[Any, list[int]]] = []  # (re2.Set, set index -> pattern index)
        self._loose: list[tuple[int, Any]] = []  # (pattern index, compiled): searched one by one
        for start in range(0, len(patterns), SET_CHUNK):
            self._add_chunk(patterns, range(start, min(start + SET_CHUNK, len(patterns))))

    def _add_chunk(self, patterns: Sequence[str], indices: range) -> None:
        options = re2.Options()
        options.max_mem = SET_MAX_MEM
        options.log_errors = False
        rset = re2.Set.SearchSet(options)
        members: list[int] = []
        for i in indices:
            try:
                rset.Add(patterns[i])
            except re2.error:
                self._loose.append((i, compile_pattern(patterns[i], max_bytes=None)))
                continue
            members.append(i)
        try:
            sentinel = rset.Add(_SENTINEL_PATTERN)
            rset.Compile()
            working = sentinel in (rset.Match(_SENTINEL_TEXT) or ())
        except re2.error:
            working = False
        if working:
            self._sets.append((rset, members))
        else:
            self._loose.extend((i, compile_pattern(patterns[i], max_bytes=None)) for i in members)

    @property
    def loose(self) -> int:
        """How many patterns are searched one by one (0 unless RE2 refused a set)."""
        return len(self._loose)

    def match(self, text: str) -> list[int]:
        """Indices of the patterns that match `text` (unordered)."""
        out: list[int] = []
        for rset, members in self._sets:
            hits = rset.Match(text)
            if hits:
                out.extend(members[h] for h in hits if h < len(members))
        out.extend(i for i, compiled in self._loose if compiled.search(text) is not None)
        return out


# The last PatternSet built, by its patterns in order: a policy change that keeps the patterns (a re-push
# with other priorities or ids, a change to one intent's values) reuses its compiled sets. Immutable once
# built, so sharing it between policy sets (and threads) is safe.
_last_patterns: tuple[tuple[str, ...], PatternSet] | None = None


def _pattern_set(patterns: Sequence[str]) -> PatternSet:
    global _last_patterns
    key = tuple(patterns)
    last = _last_patterns
    if last is not None and last[0] == key:
        return last[1]
    built = PatternSet(patterns)
    _last_patterns = (key, built)
    return built


class PolicySet:
    """An immutable, compiled set of intents for this node.

    Build it with `PolicySet.build([(intent_key, intent), ...])`. Patterns were validated with the
    intent; they are compiled again here with the same `compile_pattern`, so a pattern the contract
    refuses raises ValueError here too.
    """

    def __init__(self, compiled: Iterable[CompiledIntent], *, named_only: bool = False) -> None:
        """`named_only`: tasks of users other than root get only intents that name their user or cgroup
        (`security.unprivileged_tasks: named_only`)."""
        ordered = sorted(compiled, key=lambda c: c.rank)
        self.named_only = named_only
        self.ordered: tuple[CompiledIntent, ...] = tuple(ordered)
        self.by_key: dict[str, CompiledIntent] = {c.key: c for c in ordered}
        if len(self.by_key) != len(ordered):
            raise ValueError("duplicate intent key in policy set")
        self.has_process_scope = any(c.scope is Scope.PROCESS for c in ordered)
        self.has_pod_selectors = any(c.pod_uid is not None for c in ordered)
        self.has_owner_selectors = named_only or any(c.needs_owner for c in ordered)
        self._cache: dict[str, CommMatch] = {}
        # distinct patterns (many intents may share one), each with its intents' positions in `ordered`
        by_pattern: dict[str, list[int]] = {}
        for pos, c in enumerate(ordered):
            by_pattern.setdefault(c.intent.matching_pattern, []).append(pos)
        distinct = sorted(by_pattern)  # in an order that does not depend on ranks: see _pattern_set
        self._positions: list[list[int]] = [by_pattern[p] for p in distinct]
        self._patterns = _pattern_set(distinct)

    @classmethod
    def build(cls, intents: Iterable[tuple[str, Intent]], *, named_only: bool = False) -> PolicySet:
        return cls((_compile(key, intent) for key, intent in intents), named_only=named_only)

    @classmethod
    def empty(cls) -> PolicySet:
        return cls(())

    def __len__(self) -> int:
        return len(self.ordered)

    def match(self, comm: str) -> CommMatch:
        """Every intent whose pattern matches `comm`, split by scope, strongest first. Cached per comm."""
        hit = self._cache.get(comm)
        if hit is not None:
            return hit
        hits = self._patterns.match(comm)
        positions = sorted(pos for hit in hits for pos in self._positions[hit])
        return self._remember(comm, [self.ordered[pos] for pos in positions])

    def _remember(self, comm: str, matching: Iterable[CompiledIntent]) -> CommMatch:
        """Split the intents matching `comm` (strongest first) by scope and cache the result."""
        thread: list[CompiledIntent] = []
        process: list[CompiledIntent] = []
        for c in matching:
            (process if c.scope is Scope.PROCESS else thread).append(c)
        result = CommMatch(tuple(thread), tuple(process)) if thread or process else _NO_MATCH
        if len(self._cache) < COMM_CACHE_MAX:
            self._cache[comm] = result
        return result

    def winner(self, comm: str) -> CompiledIntent | None:
        """The strongest intent of either scope matching `comm` alone (ignoring other threads)."""
        m = self.match(comm)
        return best((m.thread[0] if m.thread else None, m.process[0] if m.process else None))
