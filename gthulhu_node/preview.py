"""`apply --dry-run`: what a set of intents would do on this host right now, changing nothing.

It runs the agent's own matching (the reconciler with its precedence and scope rules) against a fresh
/proc scan, writing into a throwaway in-memory backend, so the preview and the agent cannot disagree.
Intents the running agent already holds from other sources can be included, so overlaps with them show.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gthulhu_node.backends.dryrun import DryRunBackend
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
) -> Preview:
    """Match `intents` (as source `source`, replacing what that source holds) plus `others` on this host."""
    mine = [(intent_key(source, i.id), i) for i in intents]
    mine_keys = {k for k, _ in mine}
    everything = [(k, i) for k, i in mine] + [(k, i) for k, i in others if k not in mine_keys]
    selected = [(k, i) for k, i in everything if i.selects_node(node_name, node_labels)]
    backend = DryRunBackend()
    backend.start()
    reconciler = Reconciler(backend, policy=PolicySet.build(selected), proc_root=proc_root)
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
        out.append(PreviewIntent(key, intent, True, st.applied_tasks, tuple(warnings)))
    rows = tuple(
        MatchRow(m.tid, m.tgid, m.comm, m.intent_key, m.priority, m.slice_ns, m.scope)
        for m in reconciler.matches()
        if m.intent_key in mine_keys
    )
    backend.stop()
    return Preview(tuple(out), rows, len(snap.tasks))
