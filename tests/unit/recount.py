"""The from-scratch recount the produced status is checked against (issue 41: only tests compute it).

`intent_stats(r)` walks the whole task table and the writer's queues and computes every intent's figures
again: what `Reconciler.intent_figures` produces from the counts kept as tasks are matched must equal it.
`check_invariants(r)` is the reconciler's own invariants plus that equality for the kept counts.
"""

from __future__ import annotations

from gthulhu_node.reconciler import Reconciler
from gthulhu_node.status_projection import IntentCount, IntentStats


def intent_stats(r: Reconciler) -> dict[str, IntentStats]:
    """Per-intent matched/applied/lost counts and overlaps, computed from the current tables."""
    table, writer = r._table, r._writer
    current = table.policy
    result = {c.key: IntentStats(c.key, noop=c.is_noop) for c in current.ordered}
    stale = table.stale
    for th in table.threads.values():
        w = th.winner
        if w is None:
            continue
        proc = table.procs[th.task.tgid]
        # a process not yet rematched is counted as the policy it was matched with has it: that is
        # what the backend holds for it
        policy = stale.get(proc.tgid, current)
        candidates = set(table.eligible(policy.match(th.task.comm).thread, proc, policy))
        candidates.update(policy.by_key[k] for k in proc.pmatch)
        for c in candidates:
            s = result.get(c.key)
            if s is None:
                continue
            s.matched_tasks += 1
            if c is w:
                s.applied_tasks += 1
            else:
                s.lost_tasks += 1
                s.overlaps[w.key] = s.overlaps.get(w.key, 0) + 1
    for key, f in writer.failures_by_intent.items():
        if key in result:
            result[key].write_failures = f.count
            result[key].last_error = f.last_message
            result[key].last_reason = f.last_reason
    for _key, reason, owner in writer.refused():
        if owner in result:
            s = result[owner]
            s.pending_failures += 1
            s.pending_reasons[reason] = s.pending_reasons.get(reason, 0) + 1
    for owner in writer.unwritten():
        if owner in result:
            result[owner].unwritten += 1
    return result


def check_invariants(r: Reconciler) -> None:
    """Every part's invariants, and the counts kept as tasks are matched are what a pass over the task
    table gives."""
    r.check_invariants()
    scratch = intent_stats(r)
    status, table = r._status, r._table
    kept = status.counts
    for key, s in scratch.items():
        c = kept.get(key, IntentCount())
        assert (c.matched, c.applied, c.lost, c.overlaps) == (
            s.matched_tasks, s.applied_tasks, s.lost_tasks, s.overlaps), (key, c, s)
    assert all(c.matched > 0 for c in kept.values()), kept
    assert status.matched == sum(1 for th in table.threads.values() if th.winner is not None)
