"""`apply --dry-run`: what a set of intents would do on this host right now, changing nothing.

It runs the agent's own matching (the reconciler with its precedence and scope rules) against a fresh
/proc scan, writing into a throwaway in-memory backend, so the preview and the agent cannot disagree.
Intents the running agent already holds from other sources can be included, so overlaps with them show.

The running agent previews too (`preview_in_agent`: the Preview RPC and REST's POST /api/v1/preview):
with every other source it holds and its `named_only` setting, and the threads the previewed intents
would take from the intent that governs them now (`Displaced`). It reads the agent's store and published
matches; it changes nothing there (a throwaway reconciler and backend, as above).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.explain import AgentView
from gthulhu_node.intents.model import Intent, intent_key
from gthulhu_node.intents.status import NO_MATCH_WARNING, NOOP_WARNING, MatchRow
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.procfs import snapshot


@dataclass(frozen=True, slots=True)
class PreviewIntent:
    key: str
    intent: Intent
    for_this_node: bool
    matched_tasks: int  # tasks it would govern
    warnings: tuple[str, ...]
    lost_tasks: int = 0  # tasks it would match but another intent would win


@dataclass(frozen=True, slots=True)
class Preview:
    intents: tuple[PreviewIntent, ...]
    matches: tuple[MatchRow, ...]  # only tasks governed by the previewed intents
    tasks_scanned: int


def preview(
    source: str,
    intents: Sequence[Intent],
    *,
    node_name: str,
    node_labels: dict[str, str],
    others: Sequence[tuple[str, Intent]] = (),
    proc_root: Path = Path("/proc"),
    named_only: bool = False,
) -> Preview:
    """Match `intents` (as source `source`, replacing what that source holds) plus `others` on this host."""
    mine = [(intent_key(source, i.id), i) for i in intents]
    mine_keys = {k for k, _ in mine}
    everything = [(k, i) for k, i in mine] + [(k, i) for k, i in others if k not in mine_keys]
    selected = [(k, i) for k, i in everything if i.selects_node(node_name, node_labels)]
    backend = DryRunBackend()
    backend.start()
    policy = PolicySet.build(selected, named_only=named_only)
    reconciler = Reconciler(backend, policy=policy, proc_root=proc_root)
    snap = snapshot(proc_root)
    reconciler.apply_snapshot(snap)
    stats = reconciler.intent_figures()
    out: list[PreviewIntent] = []
    for key, intent in mine:
        st = stats.get(key)
        if st is None:
            out.append(PreviewIntent(key, intent, False, 0, ("not for this node: would not be applied",)))
            continue
        warnings = [NOOP_WARNING] if intent.is_noop else []
        if st.matched_tasks == 0:
            warnings.append(NO_MATCH_WARNING)
        for winner, n in sorted(st.overlaps.items()):
            warnings.append(f"overlaps with {winner} on {n} tasks: {winner} wins")
        out.append(PreviewIntent(key, intent, True, st.applied_tasks, tuple(warnings), st.lost_tasks))
    rows = tuple(
        MatchRow(m.tid, m.tgid, m.comm, m.intent_key, m.priority, m.slice_ns, m.scope, m.overlaps)
        for m in reconciler.matches()
        if m.intent_key in mine_keys
    )
    backend.stop()
    return Preview(tuple(out), rows, len(snap.tasks))


@dataclass(frozen=True, slots=True)
class Displaced:
    """A thread an intent governs now that a previewed intent would take."""

    tid: int
    tgid: int
    comm: str
    now: str  # the intent governing it now ("source/id")
    then: str  # the previewed intent that would


def preview_in_agent(
    agent: AgentView, source: str, intents: Sequence[Intent]
) -> tuple[Preview, list[Displaced]]:
    """What `intents`, as the whole set of `source`, would do on this node now, against everything else the
    running agent holds; and what they would displace. Changes nothing in the agent."""
    cfg = agent.config
    held = agent.store.snapshot()
    others = [(intent_key(name, i.id), i) for name, ss in sorted(held.items()) if name != source
              for i in ss.intents]
    result = preview(source, intents, node_name=cfg.node.name, node_labels=dict(cfg.node.labels),
                     others=others, proc_root=cfg.watch.proc_root,
                     named_only=cfg.security.unprivileged_tasks == "named_only")
    now = {m.tid: m for m in agent.matches()}
    displaced = [Displaced(m.tid, m.tgid, m.comm, was.intent, m.intent) for m in result.matches
                 if (was := now.get(m.tid)) is not None and was.intent != m.intent
                 and not was.intent.startswith(f"{source}/")]
    return result, displaced
