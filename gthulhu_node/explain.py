"""`explain`: why one thread is (not) governed, intent by intent, from the agent's own matching.

Why a module of its own: the answer must be the agent's, not a second implementation that drifts from it.
Every verdict here comes from the objects the reconciler matches with (`PolicySet.match` for patterns
and scope, `CompiledIntent.admits` and `pod_uid` for the owner and pod selectors, `Intent.selects_node`
for the node, `matching.best` for the winner, `CompiledIntent.rank` (`precedence_rank`) for why it
won); this module only records, for each intent, the first check that turned it away, in the order the
reconciler makes them (node, in effect, pattern and scope, pod, owner). The owner is read with the
reconciler's own readers (`read_owner`, `read_pod_uid`).

Two halves: `explain_task` (pure: a policy, the store's intents, one thread and its process) and
`held_for` (run on the engine thread through `Engine.call`: what the reconciler wrote for the thread's
TID and TGID and what the backend reads back for them), so the agent touches nothing of its own tables
from another thread.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from gthulhu_node.backends.base import Backend, BackendHealth, BackendState, Entry, EntryKey
from gthulhu_node.backends.sched_attr import KERNEL_SLICE_MAX_NS, KERNEL_SLICE_MIN_NS, SchedAttrSyscalls
from gthulhu_node.config import AgentConfig
from gthulhu_node.engine import Engine
from gthulhu_node.errors import InvalidInput, NotFound, Unavailable
from gthulhu_node.intents.model import Intent, Scope, compile_pattern, intent_key
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.intents.status import IntentState, IntentStatus, MatchRow, StatusBoard
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.matching import CompiledIntent, Owner, PolicySet, best, read_owner, read_pod_uid
from gthulhu_node.probe.histogram import WaitHistogram
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.procfs import Task, read_task, snapshot
from gthulhu_node.tasks.schedstat import Lately, first_reads, lately


class ProbeView(Protocol):
    """What `explain` reads of the agent's run-queue probe (probe/continuous.py's ContinuousProbe)."""

    state: str
    reason: str

    def histograms(self) -> dict[str, WaitHistogram]: ...


class AgentView(Protocol):
    """What `explain` and the preview read of the running agent (gthulhu_node/agent.py's Agent)."""

    config: AgentConfig
    engine: Engine | None
    store: IntentStore
    board: StatusBoard
    probe: ProbeView | None  # the run-queue probe, when the service runs one (probe.enabled)

    def matches(self, intent: str = "") -> list[MatchRow]: ...

# The fields a line names as the first reason an intent does not govern a thread.
NODE = "node"  # nodeNames / nodeSelectors do not select this node
FAILED = "failed"  # the intent is Failed (a Manager entry that became no intent, a policy that failed)
PENDING = "pending"  # stored, not yet in the policy the reconciler holds
COMMAND = "commandRegex"
SCOPE = "scope"  # scope=thread: the pattern matches another thread of the process, not this one
POD = "podUID"
OWNER = "owner"  # the process's owner could not be read (gone): owner selectors fail closed
USERS = "users"
CGROUP = "cgroupRegex"
EXE = "executableRegex"
NAMED_ONLY = "named_only"

# precedence_rank's components, in its order (docs/watching.md, "Precedence")
_RULES = ("priority", "executionTime", "source/id")


# How long a request waits for its turn on the engine thread (which feeds the watchdog: never long).
ENGINE_WAIT_S = 10.0
# At most this many threads per request: a --comm that matches every thread asks too broad a question.
MAX_THREADS = 512
# ... and at most this many intent lines (threads x intents) in one answer, unless it is one thread: an
# answer stays far below the API's message limit (a line is about 100 bytes).
MAX_LINES = 200_000


class NoSuchTask(NotFound):
    """No thread with that TID (or no process with that PID) on this host."""


@dataclass(frozen=True, slots=True)
class Subject:
    """The thread explained: what the kernel says it is, and who owns its process."""

    tid: int
    tgid: int
    comm: str
    owner: Owner | None  # None: gone, or unreadable (then owner selectors fail closed, as in the agent)
    pod_uid: str | None
    owner_error: str = ""  # why the owner could not be read, when not because the process is gone
    process_comms: tuple[tuple[int, str], ...] = ()  # (tid, comm) of every thread of the process


@dataclass(frozen=True, slots=True)
class IntentLine:
    """One intent of one source, against the thread."""

    key: str
    matched: bool
    field: str = ""  # the first check it failed ("" when matched)
    reason: str = ""  # that check, in words
    state: str = ""  # its status (IntentState value), "" when the agent has none yet
    note: str = ""  # what else a matched intent's status says (a Failed write, a noop)


@dataclass(frozen=True, slots=True)
class Explanation:
    subject: Subject
    lines: tuple[IntentLine, ...]
    winner: str  # "source/id", "" when no intent governs the thread
    why: tuple[str, ...]  # why the winner beats each intent it shadows, one line each
    shadows: tuple[str, ...]  # intents that match the thread but lose to the winner
    winner_priority: int = 0
    winner_slice_ns: int = 0
    winner_scope: str = ""

    @property
    def governed(self) -> bool:
        return bool(self.winner)


@dataclass(frozen=True, slots=True)
class HeldEntry:
    """One key the agent may hold for the thread: its desired entry, what it believes the backend holds
    (written and acknowledged), and what the backend reads back now."""

    key: str  # "tid:123" / "tgid:100"
    owner: str  # the intent that produced the desired entry, "" when none
    desired: Entry | None
    applied: Entry | None
    read_back: Entry | None
    failure: str = ""  # why the backend refused it, when it waits for a retry


@dataclass(frozen=True, slots=True)
class Held:
    """What the agent holds for a thread (its TID and its TGID), gathered on the engine thread."""

    backend: str
    entries: tuple[HeldEntry, ...]
    read_back: str  # how the backend's values were read ("" when they were)
    kernel: Mapping[str, str] = field(default_factory=dict)  # what the kernel shows now (eevdf: nice, ...)
    agent_winner: str = ""  # the reconciler's own winner for the TID ("" when none)
    #: what the scheduler did with the thread since it was loaded (boosted_runs, demotions), empty when
    #: not available, and then `task_stats_note` says why (never zeros for "unknown")
    task_stats: Mapping[str, int] = field(default_factory=dict)
    task_stats_note: str = ""
    #: what the backend cannot express of the winner's strategy (eevdf: a slice outside the kernel's range)
    backend_note: str = ""
    #: the process the backend boosts by itself, without an entry (the agent's own; 0 when none)
    boosted_tgid: int = 0


# ---- the subject -----------------------------------------------------------------------------------


def tgid_of(tid: int, proc_root: Path = Path("/proc")) -> int:
    """The process of a thread (`Tgid:` of /proc/<tid>/status; the kernel resolves any TID there)."""
    try:
        with open(b"%s/%d/status" % (os.fsencode(proc_root), tid), "rb") as f:
            text = f.read(4096)
    except FileNotFoundError:
        raise NoSuchTask(f"no task {tid} on this host") from None
    for line in text.splitlines():
        if line.startswith(b"Tgid:"):
            return int(line.split()[1])
    raise NoSuchTask(f"no task {tid} on this host (no Tgid in its status)")


def threads_of(tgid: int, proc_root: Path = Path("/proc")) -> list[Task]:
    """Every thread of a process now (by TID), read with the scanner's reader."""
    try:
        names = os.listdir(b"%s/%d/task" % (os.fsencode(proc_root), tgid))
    except FileNotFoundError:
        raise NoSuchTask(f"no process {tgid} on this host") from None
    out = [t for n in sorted(names, key=int) if (t := read_task(tgid, int(n), proc_root)) is not None]
    if not out:
        raise NoSuchTask(f"no process {tgid} on this host")
    return out


def read_subject(tid: int, proc_root: Path = Path("/proc"), tgid: int | None = None) -> Subject:
    """The thread, its process's threads and owner, read as the reconciler reads them."""
    tgid = tgid_of(tid, proc_root) if tgid is None else tgid
    threads = threads_of(tgid, proc_root)
    me = next((t for t in threads if t.tid == tid), None)
    if me is None:
        raise NoSuchTask(f"no task {tid} in process {tgid}")
    error = ""
    try:
        owner = read_owner(tgid, proc_root)
        pod = read_pod_uid(tgid, proc_root)
    except OSError as exc:  # unknown, not "nobody": selectors that ask fail closed, as in the agent
        owner, pod, error = None, None, str(exc)
    return Subject(tid, tgid, me.comm, owner, pod, error, tuple((t.tid, t.comm) for t in threads))


# ---- the explanation -------------------------------------------------------------------------------


def _owner_reason(c: CompiledIntent, subject: Subject, named_only: bool) -> tuple[str, str]:
    """The first owner check `admits` failed (called only when it did), in admits's own order."""
    owner = subject.owner
    if owner is None:
        why = subject.owner_error or "the process is gone"
        if c.needs_owner:
            return OWNER, f"its owner selectors need the process's owner, which could not be read ({why})"
        return NAMED_ONLY, f"named_only: the process's owner could not be read ({why})"
    if c.uids is not None and owner.uid not in c.uids:
        return USERS, f"users {list(c.intent.users)} do not include uid {owner.uid}"
    if c.cgroup is not None and c.cgroup.search(owner.cgroup) is None:
        return CGROUP, f"cgroupRegex {c.intent.cgroup_regex!r} does not match cgroup {owner.cgroup!r}"
    if c.exe is not None and c.exe.search(owner.exe) is None:
        return EXE, f"executableRegex {c.intent.executable_regex!r} does not match {owner.exe!r}"
    return NAMED_ONLY, (f"security.unprivileged_tasks is named_only: uid {owner.uid} is not root and the "
                        "intent names no user, cgroup or pod")


def pattern_hits(subject: Subject, policy: PolicySet) -> dict[str, list[tuple[int, str]]]:
    """For each intent key, the threads of the subject's process whose comm its pattern matches
    (`PolicySet.match`, both scopes): one pass over the threads, not one per intent."""
    hits: dict[str, list[tuple[int, str]]] = {}
    for tid, comm in subject.process_comms:
        m = policy.match(comm)
        for c in (*m.thread, *m.process):
            hits.setdefault(c.key, []).append((tid, comm))
    return hits


def _pattern_reason(c: CompiledIntent, subject: Subject, hits: Mapping[str, list[tuple[int, str]]]
                    ) -> tuple[str, str] | None:
    """None when the intent's pattern covers the thread under its scope; else the field and why."""
    pattern = c.intent.matching_pattern
    threads = hits.get(c.key, [])
    if c.scope is Scope.PROCESS:
        if threads:
            return None
        return COMMAND, (f"{pattern!r} matches no thread of process {subject.tgid} (scope=process; this "
                         f"thread's comm is {subject.comm!r})")
    if any(tid == subject.tid for tid, _ in threads):
        return None
    others = [f"{tid} ({comm!r})" for tid, comm in threads]
    if others:
        return SCOPE, (f"scope=thread: {pattern!r} matches thread {', '.join(others[:3])} of this process, "
                       f"not this one ({subject.comm!r})")
    return COMMAND, f"{pattern!r} does not match comm {subject.comm!r}"


def _check(c: CompiledIntent, subject: Subject, policy: PolicySet,
           hits: Mapping[str, list[tuple[int, str]]]) -> tuple[str, str] | None:
    """The first check that turns `c` away from the thread, in the reconciler's order; None if none."""
    miss = _pattern_reason(c, subject, hits)
    if miss is not None:
        return miss
    if c.pod_uid is not None and c.pod_uid != subject.pod_uid:
        where = f"pod {subject.pod_uid}" if subject.pod_uid else "no pod"
        return POD, f"podUID {c.intent.pod_uid} is not the process's ({where})"
    if not c.admits(subject.owner, policy.named_only):
        return _owner_reason(c, subject, policy.named_only)
    return None


def why_wins(winner: CompiledIntent, loser: CompiledIntent) -> str:
    """Which rule of the precedence decides between two intents: the first component of
    `precedence_rank` in which they differ (no priority numbers compared here)."""
    i = next((n for n, (w, lo) in enumerate(zip(winner.rank, loser.rank, strict=True)) if w != lo), 2)
    rule = _RULES[i]
    if i == 0:
        detail = f"priority {winner.priority} over {loser.priority}"
    elif i == 1:
        detail = f"executionTime {winner.slice_ns} ns over {loser.slice_ns} ns (same priority)"
    else:
        detail = f"{winner.key} sorts before {loser.key} (same priority and executionTime)"
    return f"{winner.key} beats {loser.key} on {rule} (precedence rule {i + 1}): {detail}"


@dataclass(frozen=True, slots=True)
class Listed:
    """One intent as the store holds it, with its status (None when the agent has not computed one)."""

    key: str
    intent: Intent | None  # None for a Manager entry that became no intent
    status: IntentStatus | None
    failed: str = ""  # a Manager entry's reason


def listed_intents(sources: Mapping[str, SourceSet], statuses: Iterable[IntentStatus]) -> list[Listed]:
    """Every intent of every source, including a lenient sender's entries that became none."""
    by_key = {s.key: s for s in statuses}
    out: list[Listed] = []
    for name in sorted(sources):
        ss = sources[name]
        for entry in ss.entries:
            if entry.failed:
                key = intent_key(name, entry.key)
                out.append(Listed(key, None, by_key.get(key), entry.failed))
        for i in ss.intents:
            key = intent_key(name, i.id)
            out.append(Listed(key, i, by_key.get(key)))
    return out


def explain_task(
    subject: Subject,
    policy: PolicySet,
    intents: Sequence[Listed],
    *,
    node_name: str,
    node_labels: Mapping[str, str],
) -> Explanation:
    """Every intent against one thread, the winner (matching.best over the same candidates the
    reconciler takes: the strongest thread-scope match and the process's strongest process-scope one),
    why it wins and what it shadows. `policy` is the one the reconciler holds."""
    hits = pattern_hits(subject, policy)
    labels = dict(node_labels)
    lines: list[IntentLine] = []
    thread_cands: list[CompiledIntent] = []
    process_cands: list[CompiledIntent] = []
    for item in intents:
        state = item.status.state.value if item.status is not None else ""
        if item.intent is None:
            lines.append(IntentLine(item.key, False, FAILED, f"the entry became no intent: {item.failed}",
                                    state))
            continue
        if not item.intent.selects_node(node_name, labels):
            shown = ", ".join(f"{k}={v}" for k, v in sorted(labels.items())) or "no labels"
            lines.append(IntentLine(item.key, False, NODE, f"its nodeNames/nodeSelectors do not select "
                                    f"node {node_name!r} ({shown})", state))
            continue
        c = policy.by_key.get(item.key)
        if c is None or (c.intent is not item.intent and c.intent != item.intent):
            if item.status is not None and item.status.state is IntentState.FAILED:
                lines.append(IntentLine(item.key, False, FAILED, item.status.reason, state))
            else:
                why = "stored, not yet in the policy the agent holds (being applied)"
                lines.append(IntentLine(item.key, False, PENDING, why, state))
            continue
        miss = _check(c, subject, policy, hits)
        if miss is not None:
            lines.append(IntentLine(item.key, False, miss[0], miss[1], state))
            continue
        note = ""
        if item.status is not None and item.status.state is IntentState.FAILED:
            note = f"status Failed: {item.status.reason}"
        elif c.is_noop:
            note = "noop: priority 0 and executionTime 0 (wins like any other, writes nothing)"
        lines.append(IntentLine(item.key, True, state=state, note=note))
        (process_cands if c.scope is Scope.PROCESS else thread_cands).append(c)
    # the candidates the reconciler takes (_assign): its strongest thread match and the process winner
    thread_best = best(thread_cands)
    winner = best((thread_best, best(process_cands)))
    if winner is None:
        return Explanation(subject, tuple(lines), "", (), ())
    shadowed = sorted((c for c in (*thread_cands, *process_cands) if c is not winner), key=lambda c: c.rank)
    return Explanation(
        subject,
        tuple(lines),
        winner.key,
        tuple(why_wins(winner, c) for c in shadowed),
        tuple(c.key for c in shadowed),
        winner.priority,
        winner.slice_ns,
        winner.scope.value,
    )


# ---- what the agent holds (on the engine thread) ----------------------------------------------------


def held_for(reconciler: Reconciler, threads: Sequence[tuple[int, int, int]]) -> list[Held]:
    """What the reconciler wrote for each (tid, tgid, start_time)'s TID and TGID keys and what its backend
    reads back (one read-back for all). Run on the engine thread (`Engine.call`): the reconciler and the
    backend are that thread's."""
    backend = reconciler.backend
    views = [reconciler.explain_view(tid, tgid) for tid, tgid, _ in threads]
    health = backend.health()
    read_note = ""
    back: dict[EntryKey, Entry] = {}
    if health.state is not BackendState.RUNNING:  # nothing to read: say so, never "it holds nothing"
        read_note = f"not read back: the backend is {health.state.value}" + (
            f" ({health.reason})" if health.reason else "")
    else:
        try:
            back = backend.read_keys([k for view, _ in views for k in view])
        except Exception as exc:  # the backend's own words, not an empty answer
            read_note = f"not read back: {exc}"
    stats = _task_stats(backend, threads, health)
    boosted = backend.boosted_tgid if health.state is BackendState.RUNNING else 0
    out: list[Held] = []
    for (tid, _, _), (view, agent_winner) in zip(threads, views, strict=True):
        entries = tuple(
            HeldEntry(str(k), owner, desired, applied, back.get(k), failure)
            for k, (desired, owner, applied, failure) in view.items()
            if desired is not None or applied is not None or k in back
        )
        counted = stats.get(tid, "not available: the backend did not answer for this thread")
        stats_or_none, note = ({}, counted) if isinstance(counted, str) else (counted, "")
        out.append(Held(backend.name, entries, read_note, {}, agent_winner, stats_or_none, note,
                        boosted_tgid=boosted))
    return out


def _task_stats(backend: Backend, threads: Sequence[tuple[int, int, int]], health: BackendHealth
                ) -> dict[int, dict[str, int] | str]:
    """The backend's per-task counters for the threads, or for each why not (never an empty answer)."""
    if health.state is not BackendState.RUNNING:
        return {t[0]: f"not available: the backend is {health.state.value}" for t in threads}
    try:
        return backend.task_stats(threads)
    except Exception as exc:  # the backend's own words
        return {t[0]: f"not available: {exc}" for t in threads}


def agent_boost(subject: Subject, held: Held) -> str:
    """Why an agent thread is boosted without an intent, "" when it is not: the scheduler gives the
    agent's own process AGENT_RANK (above every intent) in lookup_strategy, but only when neither map
    holds an entry for the thread (an entry, from an intent that matches the agent, comes first)."""
    if not held.boosted_tgid or subject.tgid != held.boosted_tgid:
        return ""
    if any(e.read_back is not None for e in held.entries):
        return ""  # the intent's entry is what the scheduler takes
    boost = (f"the agent's own thread: the {held.backend} scheduler boosts the agent's process "
             f"{subject.tgid} by itself, above every intent (its agent protection, not an intent), so "
             "that the agent is never starved")
    if held.read_back:
        boost += f" (unless an entry is held for it: {held.read_back})"
    return boost


@dataclass(frozen=True, slots=True)
class ProbeWaits:
    """What the agent's run-queue probe says of the thread: its figures, or why none (`note`)."""

    intent: str = ""  # whose histogram the figures are (the probe keeps one per intent, none per thread)
    waits: int = 0
    mean_ns: int = 0
    p99_ns: int = 0
    note: str = ""


def probe_waits(probe: ProbeView | None, winner: str) -> ProbeWaits:
    """The probe keeps no per-thread figures in the agent (probe/continuous.py: per-thread histograms
    would outlive exited threads in the kernel), so the thread's own waits are schedstat's; the probe's
    are those of the intent governing it, the thread among them."""
    if probe is None:
        return ProbeWaits(note="not running: probe.enabled is false")
    if probe.state != "running":
        return ProbeWaits(note=f"not running ({probe.state}{': ' + probe.reason if probe.reason else ''})")
    if not winner:
        return ProbeWaits(note="it measures only the threads intents govern, per intent: none for this one")
    try:
        hist = probe.histograms().get(winner)
    except Exception as exc:  # the probe's own words, never "no waits"
        return ProbeWaits(winner, note=f"not read: {exc}")
    if hist is None or hist.count == 0:
        return ProbeWaits(winner, note=f"no per-thread figures; no wait of {winner}'s threads measured yet")
    return ProbeWaits(winner, hist.count, hist.sum_ns // hist.count, int(hist.percentile_ns(0.99)),
                      f"no per-thread figures: these are all of {winner}'s threads, since the probe started")


def kernel_attrs(tid: int) -> dict[str, str]:
    """What the kernel shows for the thread now (sched_getattr): the eevdf backend's settings."""
    try:
        a = SchedAttrSyscalls().get(tid)
    except OSError as exc:
        return {"error": str(exc)}
    return {"policy": a.policy_name, "nice": str(a.nice), "slice_ns": str(a.runtime_ns)}


def eevdf_limits(ex: Explanation) -> str:
    """What the eevdf backend cannot express of the winner's strategy: EEVDF clamps a slice request into
    its range without an error, so the thread runs with another slice than the intent asks; and a priority
    is a nice level (a weight), not a place ahead of the queue (docs/eevdf.md)."""
    if not ex.winner:
        return ""
    notes = []
    s = ex.winner_slice_ns
    if s and not KERNEL_SLICE_MIN_NS <= s <= KERNEL_SLICE_MAX_NS:
        clamped = min(max(s, KERNEL_SLICE_MIN_NS), KERNEL_SLICE_MAX_NS)
        notes.append(f"executionTime {s} ns is outside the kernel's slice range "
                     f"({KERNEL_SLICE_MIN_NS}-{KERNEL_SLICE_MAX_NS} ns): it runs with {clamped} ns")
    if ex.winner_priority:
        notes.append(f"priority {ex.winner_priority} is a nice level here, a weight: no preemption, no place "
                     "ahead of the queue")
    return "; ".join(notes)


# ---- in the agent ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Report:
    """One thread's explanation, what the agent holds for it, and what the scheduler did with it lately
    (the kernel's schedstat, and the agent's probe)."""

    explanation: Explanation
    held: Held
    lately: Lately = field(default_factory=Lately)
    probe: ProbeWaits = field(default_factory=ProbeWaits)
    #: why the scheduler boosts it without an intent (an agent thread), "" when not
    agent_boost: str = ""

    @property
    def governed(self) -> bool:
        """Given a strategy: by an intent, or by the agent's own boost (exit status 0 either way)."""
        return self.explanation.governed or bool(self.agent_boost)


def select_threads(tid: int, pid: int, comm_regex: str, proc_root: Path = Path("/proc")) -> list[Task]:
    """The threads a request names: one TID, every thread of a PID (a TID given as `pid` that leads no
    process is that thread alone), or every thread whose comm matches."""
    if sum((tid != 0, pid != 0, bool(comm_regex))) != 1:
        raise InvalidInput("name exactly one of: a tid, a pid, a comm regex")
    if tid < 0 or pid < 0:
        raise InvalidInput("a tid or pid is a positive number")
    if tid:
        tgid = tgid_of(tid, proc_root)
        me = read_task(tgid, tid, proc_root)
        if me is None:
            raise NoSuchTask(f"no task {tid} on this host")
        return [me]
    if pid:  # a process's leader: all of its threads; any other thread: that one
        tgid = tgid_of(pid, proc_root)
        if tgid != pid:
            return select_threads(pid, 0, "", proc_root)
        return threads_of(pid, proc_root)
    try:
        pattern = compile_pattern(comm_regex, "comm regex")
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    snap = snapshot(proc_root)
    found = sorted((t for t in snap.tasks.values() if pattern.search(t.comm) is not None),
                   key=lambda t: (t.tgid, t.tid))
    if not found:
        raise NoSuchTask(f"no thread on this host has a comm matching {comm_regex!r}")
    if len(found) > MAX_THREADS:
        raise InvalidInput(f"{len(found)} threads match {comm_regex!r}, at most {MAX_THREADS} are explained "
                           "at once: narrow the pattern or name a pid")
    return found


def explain_in_agent(agent: AgentView, *, tid: int = 0, pid: int = 0, comm_regex: str = "") -> list[Report]:
    """`explain` as the running agent answers it: its policy, store, status and the reconciler's entries
    (read on the engine thread), the backend's read-back, and for the eevdf backend the kernel's view."""
    proc_root = agent.config.watch.proc_root
    tasks = select_threads(tid, pid, comm_regex, proc_root)
    listed = listed_intents(agent.store.snapshot(), agent.board.intents())
    if len(tasks) > 1 and len(tasks) * len(listed) > MAX_LINES:
        raise InvalidInput(f"{len(tasks)} threads x {len(listed)} intents is more than {MAX_LINES:,} lines "
                           "to explain at once: name one thread, or a narrower --comm")
    engine = agent.engine
    if engine is None or not engine.running:
        raise Unavailable("the agent's engine is not running: nothing to explain against")
    first = first_reads(tasks, proc_root)  # the schedstat window starts here, and ends after the engine's
    refs = [(t.tid, t.tgid, t.start_time) for t in tasks]
    try:
        policy, held = engine.call(lambda r: (r.policy, held_for(r, refs)), timeout=ENGINE_WAIT_S)
    except concurrent.futures.TimeoutError:
        raise Unavailable(f"the engine did not answer within {ENGINE_WAIT_S:g} s; ask again") from None
    recent = lately(tasks, first, proc_root)
    node = agent.config.node
    out: list[Report] = []
    for task, h in zip(tasks, held, strict=True):
        try:
            subject = read_subject(task.tid, proc_root, tgid=task.tgid)
        except NoSuchTask:
            if tid:
                raise
            continue  # one of many threads exited meanwhile
        ex = explain_task(subject, policy, listed, node_name=node.name, node_labels=node.labels)
        if h.backend == "eevdf":
            h = replace(h, kernel=kernel_attrs(task.tid), backend_note=eevdf_limits(ex))
        out.append(Report(ex, h, recent[task.tid], probe_waits(agent.probe, ex.winner),
                          agent_boost(subject, h)))
    return out
