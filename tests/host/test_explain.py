"""`explain` against a real agent (dry-run backend) and real threads of this process renamed with prctl:
the threads it calls governed are exactly those `matches` lists, each reason shows, the agent's entries
and the backend's read-back, the CLI's tables, JSON and exit statuses, over the real unix socket."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.probe.histogram import WaitHistogram
from tests.host.agent_support import NamedThread, intent, run_cli, running_agent, stub_of, wait_for

# One worker runs them all: their --comm and --pid questions see every gn-ex-* thread of the host, so two
# of them at once (make test's lanes) saw each other's threads.
pytestmark = [pytest.mark.host, pytest.mark.xdist_group("explain-threads")]

INTENTS = [
    intent("eng", "^gn-ex-eng$", priority=2, execution_time=2_000_000),
    intent("both", "^gn-ex-(eng|aux)$", priority=10),
    intent("elsewhere", "^gn-ex-aux$", priority=9, node_names=["other-node"]),
    intent("root-only", "^gn-ex-aux$", priority=9, users=["4242"]),
    intent("nothing", "^gn-ex-none$", priority=1),
]


@pytest.fixture(scope="module")
def world() -> Iterator[tuple[Any, dict[str, NamedThread]]]:
    with running_agent() as agent, stub_of(agent) as stub:
        threads = {name: NamedThread(f"gn-ex-{name}") for name in ("eng", "aux", "idle")}
        for t in threads.values():
            t.__enter__()
        try:
            stub.ApplyIntents(pb.ApplyIntentsRequest(source="ex", intents=INTENTS))
            agent.sync()
            wait_for(lambda: {m.comm for m in agent.matches()} >= {"gn-ex-eng", "gn-ex-aux"},
                     what="both renamed threads matched")
            yield agent, threads
        finally:
            for t in threads.values():
                t.__exit__()


def explain(agent: Any, **request: Any) -> list[pb.ThreadExplanation]:
    with stub_of(agent) as stub:
        return list(stub.Explain(pb.ExplainRequest(**request)).threads)


def own_tids() -> set[int]:
    return {int(n) for n in os.listdir(f"/proc/{os.getpid()}/task")}


def test_governed_is_exactly_what_matches_lists(world: Any) -> None:
    agent, _ = world
    agent.sync()
    listed = {m.tid: m.intent for m in agent.matches() if m.tgid == os.getpid()}
    before = own_tids()
    threads = explain(agent, pid=os.getpid())
    after = own_tids()
    explained = {t.tid for t in threads}
    # This process's short-lived threads (gRPC's, the agent's) may start or end while explain reads
    # /proc: every thread alive before and after the call is explained. A thread explained beyond those
    # lived for part of the call, which two reads of /proc can neither confirm nor refute.
    assert before & after <= explained
    assert all(t.tgid == os.getpid() for t in threads)
    governed = {t.tid: t.winner for t in threads if t.winner}
    assert governed == listed and len(governed) == 2
    assert all(t.agent_winner == t.winner for t in threads)
    # the overlaps per thread: explain's shadows are what `matches` shows the winner beats
    overlaps = {m.tid: list(m.overlaps) for m in agent.matches() if m.tgid == os.getpid()}
    assert {t.tid: sorted(t.shadows) for t in threads if t.winner} == overlaps
    assert sorted(overlaps.values()) == [[], ["ex/both"]]


def test_overlaps_in_matches_cli_and_the_lost_tasks_metric(world: Any) -> None:
    agent, threads = world
    rows = json.loads(run_cli("matches", "-o", "json", "--socket", str(agent.config.api.socket),
                              check=True).stdout)["matches"]
    by_tid = {r["tid"]: r for r in rows}
    assert by_tid[threads["eng"].tid]["overlaps"] == ["ex/both"]
    assert by_tid[threads["aux"].tid]["overlaps"] == []
    table = run_cli("matches", "--socket", str(agent.config.api.socket), check=True).stdout
    assert "BEATS" in table and "ex/both" in table
    from gthulhu_node.metrics import Metrics

    metrics = Metrics()
    metrics.attach(agent)
    families = {f.name: f for f in metrics.registry.collect()}
    lost = {s.labels["intent"]: s.value for s in families["gthulhu_node_intent_lost_tasks"].samples}
    assert lost["ex/both"] == 1 and lost["ex/eng"] == 0


def test_reasons_winner_and_shadows(world: Any) -> None:
    agent, threads = world
    (aux,) = explain(agent, tid=threads["aux"].tid)
    lines = {i.intent: i for i in aux.intents}
    assert aux.comm == "gn-ex-aux" and aux.tgid == os.getpid() and aux.owner_known and aux.uid == os.getuid()
    assert aux.exe == os.readlink(f"/proc/{os.getpid()}/exe")
    assert aux.winner == "ex/both" and list(aux.shadows) == []
    # ex/eng's pattern matches the eng thread of this same process, not this one: scope=thread says why
    assert (lines["ex/eng"].field, lines["ex/elsewhere"].field) == ("scope", "node")
    assert f"{threads['eng'].tid} ('gn-ex-eng')" in lines["ex/eng"].reason
    assert lines["ex/root-only"].field == "users" and "4242" in lines["ex/root-only"].reason
    assert lines["ex/nothing"].field == "commandRegex"
    (eng,) = explain(agent, tid=threads["eng"].tid)
    assert eng.winner == "ex/eng" and list(eng.shadows) == ["ex/both"]
    assert eng.why == ["ex/eng beats ex/both on priority (precedence rule 1): priority 2 over 10"]
    (entry,) = eng.entries
    assert entry.key == f"tid:{eng.tid}" and entry.intent == "ex/eng" and entry.failure == ""
    assert entry.desired == entry.applied == entry.read_back
    assert (entry.read_back.priority, entry.read_back.slice_ns) == (2, 2_000_000)
    assert eng.backend == "dry-run" and eng.read_back == ""
    assert not eng.task_stats and eng.task_stats_note == \
        "not available: the dry-run backend keeps no per-task counters"
    (idle,) = explain(agent, tid=threads["idle"].tid)
    assert idle.winner == "" and not idle.entries
    assert {i.intent: i.field for i in idle.intents} == {
        "ex/eng": "scope", "ex/both": "scope", "ex/elsewhere": "node", "ex/root-only": "scope",
        "ex/nothing": "commandRegex"}


def test_comm_selects_threads_and_bad_requests_are_refused(world: Any) -> None:
    agent, threads = world
    got = explain(agent, comm_regex="^gn-ex-(eng|idle)$")
    assert sorted(t.tid for t in got) == sorted((threads["eng"].tid, threads["idle"].tid))
    with stub_of(agent) as stub:
        for request, code in ((pb.ExplainRequest(), grpc.StatusCode.INVALID_ARGUMENT),
                              (pb.ExplainRequest(tid=1, pid=1), grpc.StatusCode.INVALID_ARGUMENT),
                              (pb.ExplainRequest(comm_regex="("), grpc.StatusCode.INVALID_ARGUMENT),
                              (pb.ExplainRequest(comm_regex="^gn-ex-never$"), grpc.StatusCode.NOT_FOUND),
                              (pb.ExplainRequest(tid=0x3FFFFF), grpc.StatusCode.NOT_FOUND)):
            with pytest.raises(grpc.RpcError) as err:
                stub.Explain(request)
            assert err.value.code() == code, request


def test_cli_tables_json_and_exit_statuses(world: Any) -> None:
    agent, threads = world
    sock = ["--socket", str(agent.config.api.socket)]
    eng = run_cli("explain", str(threads["eng"].tid), *sock)
    assert eng.returncode == 0, eng.stderr
    assert f"thread {threads['eng'].tid} (gn-ex-eng)" in eng.stdout
    assert "governed by ex/eng: priority 2, slice 2ms, scope thread" in eng.stdout
    assert "precedence rule 1" in eng.stdout and "READ BACK" in eng.stdout
    assert "scheduler since load: not available: the dry-run backend keeps no per-task counters" in eng.stdout
    assert "  kernel schedstat, last " in eng.stdout and " of a CPU, run-queue waits " in eng.stdout
    assert "  kernel schedstat, since it started " in eng.stdout
    assert "  run-queue probe: not running: probe.enabled is false" in eng.stdout
    idle = run_cli("explain", str(threads["idle"].tid), *sock)
    assert idle.returncode == 1 and "not governed" in idle.stdout
    doc = json.loads(run_cli("explain", "--comm", "^gn-ex-", "-o", "json", *sock).stdout)
    assert {t["taskStatsNote"] for t in doc["threads"]} == {
        "not available: the dry-run backend keeps no per-task counters"}
    for t in doc["threads"]:  # the kernel's schedstat, for every backend: figures, not zeros
        assert t["schedstatNote"] == "" and int(t["sinceStart"]["timeslices"]) > 0
        assert float(t["recent"]["seconds"]) >= 0.5 and "cpuShare" in t["recent"]
    assert {t["comm"]: t["winner"] for t in doc["threads"]} == {
        "gn-ex-eng": "ex/eng", "gn-ex-aux": "ex/both", "gn-ex-idle": ""}
    whole = run_cli("explain", str(os.getpid()), *sock)  # the main thread is governed by nothing
    assert whole.returncode == 1 and whole.stdout.count("\nthread ") + 1 >= 4
    gone = run_cli("explain", str(0x3FFFFF), *sock)
    assert gone.returncode == 2 and "no task" in gone.stderr
    nowhere = run_cli("explain", "1", "--socket", "/nonexistent/api.sock")
    assert nowhere.returncode == 2 and "not running" in nowhere.stderr
    assert run_cli("explain", *sock).returncode == 2


class RunningProbe:
    """The agent's run-queue probe as explain reads it (ContinuousProbe's state and histograms): the
    real one needs BCC and root, and its figures are the lab's (tests/vm/test_probe*.py)."""

    state, reason = "running", ""

    def histograms(self) -> dict[str, WaitHistogram]:
        return {"ex/eng": WaitHistogram.from_values([200_000, 400_000, 600_000])}


def test_the_probes_figures_are_of_the_governing_intent(world: Any) -> None:
    agent, threads = world
    agent.probe = RunningProbe()
    try:
        (eng,) = explain(agent, tid=threads["eng"].tid)
        (idle,) = explain(agent, tid=threads["idle"].tid)
        text = run_cli("explain", str(threads["eng"].tid), "--socket", str(agent.config.api.socket)).stdout
    finally:
        agent.probe = None
    assert (eng.probe_intent, eng.probe_waits, eng.probe_mean_ns) == ("ex/eng", 3, 400_000)
    assert "no per-thread figures" in eng.probe_note
    assert "run-queue probe, ex/eng: 3 waits, mean 400.0 us" in text
    assert idle.probe_waits == 0 and "none for this one" in idle.probe_note


def test_eevdf_backend_read_back_and_kernel_view() -> None:
    """With the eevdf backend the answer carries its read-back (sched_getattr of every covered thread) and
    what the kernel shows for the thread now: the nice, slice and policy it set."""
    from gthulhu_node.backends.eevdf import EevdfBackend
    from gthulhu_node.backends.eevdf_policy import nice_for_priority
    from tests.host.agent_support import short_dir

    base = short_dir()
    backend = EevdfBackend(cover_interval_s=0.05, journal=base / "eevdf-threads.journal")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, base, True)
        agent = stack.enter_context(running_agent(base, backend=backend))
        t = stack.enter_context(NamedThread("gn-ex-eevdf"))
        stub = stack.enter_context(stub_of(agent))
        stub.ApplyIntents(pb.ApplyIntentsRequest(
            source="ex", intents=[intent("e", "^gn-ex-eevdf$", priority=15, execution_time=500_000)]))
        agent.sync()
        wait_for(lambda: any(m.tid == t.tid for m in agent.matches()), what="the thread matched")
        (got,) = wait_for(lambda: [x for x in explain(agent, tid=t.tid) if x.entries
                                   and x.entries[0].HasField("read_back")], what="the entry read back")
        assert got.backend == "eevdf" and got.winner == "ex/e"
        assert (got.entries[0].read_back.priority, got.entries[0].read_back.slice_ns) == (15, 500_000)
        assert dict(got.kernel) == {"policy": "SCHED_OTHER", "nice": str(nice_for_priority(15)),
                                    "slice_ns": "500000"}
        assert got.backend_note == ("priority 15 is a nice level here, a weight: no preemption, no place "
                                    "ahead of the queue")
        assert got.task_stats_note == "not available: the eevdf backend keeps no per-task counters"
        out = run_cli("explain", str(t.tid), "--socket", str(agent.config.api.socket))
        assert out.returncode == 0 and f"nice {nice_for_priority(15)}" in out.stdout
        assert "eevdf cannot express: priority 15 is a nice level" in out.stdout


def agent_state(agent: Any) -> tuple[Any, ...]:
    """Everything a preview must leave as it is: the store, status, matches and the reconciler's tables
    (desired, applied, and its policy), read on the engine thread."""
    tables = agent.engine.call(lambda r: (r.desired(), r.applied(), r.policy))
    status = agent.status()
    return (agent.store.snapshot(), status.intents, status.sources,
            [(m.tid, m.intent, m.overlaps) for m in agent.matches()], tables)


def test_preview_answers_and_changes_nothing(world: Any) -> None:
    agent, threads = world
    agent.sync()
    before = agent_state(agent)
    with stub_of(agent) as stub:
        resp = stub.Preview(pb.PreviewRequest(source="ui", intents=[
            intent("aux-first", "^gn-ex-aux$", priority=1),
            intent("idle-too", "^gn-ex-idle$", priority=1),
            intent("loser", "^gn-ex-eng$", priority=15),
            intent("away", "^gn-ex-idle$", priority=1, node_names=["other-node"])]))
        with pytest.raises(grpc.RpcError) as err:
            stub.Preview(pb.PreviewRequest(intents=[intent("bad", "(")]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    by_key = {p.intent: p for p in resp.intents}
    assert (by_key["ui/aux-first"].would_govern, by_key["ui/idle-too"].would_govern) == (1, 1)
    assert (by_key["ui/loser"].would_govern, by_key["ui/loser"].would_lose) == (0, 1)
    assert any("overlaps with ex/eng" in w for w in by_key["ui/loser"].warnings)
    assert not by_key["ui/away"].for_this_node
    assert {(m.tid, m.intent) for m in resp.matches} == {(threads["aux"].tid, "ui/aux-first"),
                                                         (threads["idle"].tid, "ui/idle-too")}
    displaced = [(d.tid, d.now, d.then) for d in resp.displaced]
    assert displaced == [(threads["aux"].tid, "ex/both", "ui/aux-first")]
    assert resp.tasks_scanned > 3
    assert agent_state(agent) == before


def test_an_answer_too_large_is_refused_with_words(world: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from gthulhu_node import explain as explain_module

    agent, threads = world
    monkeypatch.setattr(explain_module, "MAX_LINES", 10)  # 3 threads x 5 intents
    with stub_of(agent) as stub, pytest.raises(grpc.RpcError) as err:
        stub.Explain(pb.ExplainRequest(comm_regex="^gn-ex-"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "3 threads x 5 intents" in str(err.value.details())
    assert len(explain(agent, tid=threads["eng"].tid)) == 1  # one thread is always answered
