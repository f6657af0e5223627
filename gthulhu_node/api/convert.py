"""Between protobuf messages and the agent's own types. One place, so server and CLI agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.backends.base import Entry
from gthulhu_node.explain import Report
from gthulhu_node.intents.model import Intent
from gthulhu_node.intents.parse import IntentValidationError, parse_intent
from gthulhu_node.intents.status import (
    AgentSummary,
    IntentState,
    IntentStatus,
    MatchRow,
    SourceStatus,
    StatusEvent,
    StatusSnapshot,
)
from gthulhu_node.preview import Displaced, Preview
from gthulhu_node.tasks.schedstat import SchedStat

STATE_TO_PB = {
    IntentState.PENDING: pb.INTENT_STATE_PENDING,
    IntentState.APPLIED: pb.INTENT_STATE_APPLIED,
    IntentState.FAILED: pb.INTENT_STATE_FAILED,
    IntentState.NOT_FOR_THIS_NODE: pb.INTENT_STATE_NOT_FOR_THIS_NODE,
}
PB_TO_STATE = {v: k for k, v in STATE_TO_PB.items()}


def intent_doc_from_pb(msg: pb.Intent) -> dict[str, Any]:
    """The intent's JSON document (upstream names); validation happens on the document."""
    doc: dict[str, Any] = {
        "id": msg.id,
        "commandRegex": msg.command_regex,
        "priority": msg.priority,
        "executionTime": msg.execution_time,
        "scope": msg.scope or "thread",
        "nodeNames": list(msg.node_names),
        "nodeSelectors": [{"key": s.key, "value": s.value} for s in msg.node_selectors],
    }
    if msg.pod_uid:
        doc["podUID"] = msg.pod_uid
    if msg.users:
        doc["users"] = list(msg.users)
    if msg.cgroup_regex:
        doc["cgroupRegex"] = msg.cgroup_regex
    if msg.executable_regex:
        doc["executableRegex"] = msg.executable_regex
    return doc


def intents_from_pb(msgs: Sequence[pb.Intent], *, max_count: int) -> list[Intent]:
    """Validate a request's intents. Raises IntentValidationError naming `intents[i].field`."""
    if len(msgs) > max_count:
        raise IntentValidationError("intents", f"{len(msgs)} intents, at most {max_count} per source")
    return [parse_intent(intent_doc_from_pb(m), f"intents[{i}]") for i, m in enumerate(msgs)]


def intent_to_pb(intent: Intent) -> pb.Intent:
    return pb.Intent(
        id=intent.id,
        command_regex=intent.command_regex,
        priority=intent.priority,
        execution_time=intent.execution_time,
        scope=intent.scope.value,
        node_names=list(intent.node_names),
        node_selectors=[pb.NodeSelector(key=s.key, value=s.value) for s in intent.node_selectors],
        pod_uid=intent.pod_uid or "",
        users=list(intent.users),
        cgroup_regex=intent.cgroup_regex or "",
        executable_regex=intent.executable_regex or "",
    )


def intent_from_pb(msg: pb.Intent) -> Intent:
    """For clients reading status back: the server only sends valid intents (a Manager's pattern may be
    longer than a local one: no size limit here)."""
    return parse_intent(intent_doc_from_pb(msg), pattern_max_bytes=None)


def _ts(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(int(seconds * 1e9))
    return ts


def intent_status_to_pb(st: IntentStatus) -> pb.IntentStatus:
    return pb.IntentStatus(
        source=st.source,
        intent=intent_to_pb(st.intent),
        key=st.key,
        state=STATE_TO_PB[st.state],
        reason=st.reason,
        matched_tasks=st.matched_tasks,
        last_changed=_ts(st.last_changed),
        warnings=list(st.warnings),
        generation=st.generation,
    )


def summary_to_pb(a: AgentSummary) -> pb.AgentSummary:
    return pb.AgentSummary(
        node_name=a.node_name,
        node_labels=dict(a.node_labels),
        backend=a.backend,
        backend_reason=a.backend_reason,
        scheduler_state=a.scheduler_state,
        scheduler_reason=a.scheduler_reason,
        ready=a.ready,
        matched_tasks=a.matched_tasks,
        version=a.version,
        warnings=list(a.warnings),
        capabilities=a.capabilities,
        cgroup_cpu_max=a.cgroup_cpu_max,
    )


def source_status_to_pb(s: SourceStatus) -> pb.SourceStatus:
    return pb.SourceStatus(
        source=s.source,
        generation=s.generation,
        intents=s.intents,
        updated=_ts(s.updated),
        errors=list(s.errors),
        notes=list(s.notes),
    )


def snapshot_to_pb(snap: StatusSnapshot) -> pb.GetStatusResponse:
    return pb.GetStatusResponse(
        agent=summary_to_pb(snap.agent),
        sources=[source_status_to_pb(s) for s in snap.sources],
        intents=[intent_status_to_pb(s) for s in snap.intents],
    )


def event_to_pb(ev: StatusEvent) -> pb.StatusEvent:
    if ev.snapshot is not None:
        return pb.StatusEvent(snapshot=snapshot_to_pb(ev.snapshot))
    if ev.changed is not None:
        return pb.StatusEvent(changed=intent_status_to_pb(ev.changed))
    if ev.removed is not None:
        return pb.StatusEvent(removed=ev.removed)
    assert ev.agent is not None
    return pb.StatusEvent(agent=summary_to_pb(ev.agent))


def match_to_pb(m: MatchRow) -> pb.Match:
    return pb.Match(
        tid=m.tid,
        tgid=m.tgid,
        comm=m.comm,
        intent=m.intent,
        priority=m.priority,
        slice_ns=m.slice_ns,
        scope=m.scope,
        overlaps=list(m.overlaps),
    )


def _sched_entry(e: Entry | None) -> pb.SchedEntry | None:
    if e is None:
        return None
    return pb.SchedEntry(priority=e.priority, slice_ns=e.slice_ns, start_time=e.start_time)


def report_to_pb(r: Report) -> pb.ThreadExplanation:
    ex, held, s = r.explanation, r.held, r.explanation.subject
    owner = s.owner
    return pb.ThreadExplanation(
        tid=s.tid,
        tgid=s.tgid,
        comm=s.comm,
        owner_known=owner is not None,
        uid=owner.uid if owner is not None else 0,
        cgroup=owner.cgroup if owner is not None else "",
        exe=owner.exe if owner is not None else "",
        pod_uid=s.pod_uid or "",
        owner_error=s.owner_error,
        intents=[pb.ExplainIntent(intent=ln.key, matched=ln.matched, field=ln.field, reason=ln.reason,
                                  state=ln.state, note=ln.note) for ln in ex.lines],
        winner=ex.winner,
        priority=ex.winner_priority,
        slice_ns=ex.winner_slice_ns,
        scope=ex.winner_scope,
        why=list(ex.why),
        shadows=list(ex.shadows),
        backend=held.backend,
        entries=[pb.HeldEntry(key=e.key, intent=e.owner, desired=_sched_entry(e.desired),
                              applied=_sched_entry(e.applied), read_back=_sched_entry(e.read_back),
                              failure=e.failure) for e in held.entries],
        read_back=held.read_back,
        kernel=dict(held.kernel),
        agent_winner=held.agent_winner,
        task_stats=dict(held.task_stats),
        task_stats_note=held.task_stats_note,
        backend_note=held.backend_note,
        recent=_schedstat(r.lately.recent),
        since_start=_schedstat(r.lately.since_start),
        schedstat_note=r.lately.note,
        probe_intent=r.probe.intent,
        probe_waits=r.probe.waits,
        probe_mean_ns=r.probe.mean_ns,
        probe_p99_ns=r.probe.p99_ns,
        probe_note=r.probe.note,
        agent_boost=r.agent_boost,
    )


def _schedstat(s: SchedStat | None) -> pb.SchedStat | None:
    if s is None:
        return None
    return pb.SchedStat(seconds=s.seconds, run_ns=s.run_ns, wait_ns=s.wait_ns, timeslices=s.timeslices,
                        cpu_share=s.cpu_share)


def preview_to_pb(result: Preview, displaced: Sequence[Displaced]) -> pb.PreviewResponse:
    return pb.PreviewResponse(
        intents=[pb.PreviewIntent(intent=p.key, for_this_node=p.for_this_node, would_govern=p.matched_tasks,
                                  would_lose=p.lost_tasks, warnings=list(p.warnings))
                 for p in result.intents],
        matches=[match_to_pb(m) for m in result.matches],
        displaced=[pb.Displaced(tid=d.tid, tgid=d.tgid, comm=d.comm, now=d.now, then=d.then)
                   for d in displaced],
        tasks_scanned=result.tasks_scanned,
    )
