"""A real agent (dry-run backend forced) and real gRPC over its real unix socket: apply/replace/generation
semantics, delete, per-intent status, WatchStatus, ListMatches on a thread this test renamed, local
policy files, health, socket permissions."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.backends.base import ApplyResult, BackendError, Entry, EntryKey
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.intents.status import MAP_FULL_WARNING, NO_MATCH_WARNING, NOOP_WARNING
from tests.host.agent_support import (
    NamedThread,
    intent,
    running_agent,
    short_dir,
    statuses,
    stub_of,
    wait_for,
)

pytestmark = pytest.mark.host

APPLIED = pb.INTENT_STATE_APPLIED


@pytest.fixture(scope="module")
def agent():  # type: ignore[no-untyped-def]
    with running_agent() as a:
        yield a


def apply(stub, source: str, generation: int, *intents: pb.Intent) -> pb.ApplyIntentsResponse:  # type: ignore[no-untyped-def]
    return stub.ApplyIntents(pb.ApplyIntentsRequest(source=source, generation=generation, intents=intents))


def test_apply_replace_and_generations(agent) -> None:  # type: ignore[no-untyped-def]
    with stub_of(agent) as stub:
        assert apply(stub, "gen-a", 1, intent("x"), intent("y")).changed
        apply(stub, "gen-b", 1, intent("z"))
        r = apply(stub, "gen-a", 2, intent("w"))
        assert r.changed and r.generation == 2
        assert set(statuses(stub, "gen-a")) == {"gen-a/w"}
        with pytest.raises(grpc.RpcError) as exc:
            apply(stub, "gen-a", 1, intent("stale"))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as exc:
            apply(stub, "gen-a", 2, intent("other-content"))
        assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        again = apply(stub, "gen-a", 2, intent("w"))
        assert not again.changed and again.generation == 2
        assert set(statuses(stub, "gen-a")) == {"gen-a/w"}
        assert set(statuses(stub, "gen-b")) == {"gen-b/z"}  # other sources untouched throughout


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            pb.ApplyIntentsRequest(source="v", intents=[intent("a"), intent("b", priority=21)]),
            "intents[1].priority",
        ),
        (
            pb.ApplyIntentsRequest(source="v", intents=[intent("a", execution_time=-5)]),
            "intents[0].executionTime",
        ),
        (pb.ApplyIntentsRequest(source="v", intents=[intent("a", regex="(a*")]), "intents[0].commandRegex"),
        (pb.ApplyIntentsRequest(source="v", intents=[intent("a"), intent("a")]), "intents[1].id"),
        (pb.ApplyIntentsRequest(source="v", intents=[intent("a", scope="everything")]), "intents[0].scope"),
        (pb.ApplyIntentsRequest(source="local", intents=[intent("a")]), "source"),
        (pb.ApplyIntentsRequest(source="manager", intents=[]), "source"),
        (pb.ApplyIntentsRequest(source="Bad Name", intents=[]), "source"),
    ],
)
def test_invalid_argument_names_the_field(agent, request_: pb.ApplyIntentsRequest, field: str) -> None:  # type: ignore[no-untyped-def]
    with stub_of(agent) as stub:
        with pytest.raises(grpc.RpcError) as exc:
            stub.ApplyIntents(request_)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details().startswith(field + ":")
        assert "v/a" not in statuses(stub)


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (pb.ApplyIntentsRequest(source="v", intents=[intent("a", node_names=[f"n{i}" for i in range(1025)])]),
         "intents[0].nodeNames: nodeNames has 1025 entries, at most 1024 are allowed"),
        (pb.ApplyIntentsRequest(source="v", intents=[
            intent("a", node_selectors=[pb.NodeSelector(key=f"k{i}") for i in range(65)])]),
         "intents[0].nodeSelectors: nodeSelectors has 65 entries, at most 64 are allowed"),
        (pb.ApplyIntentsRequest(source="v", intents=[
            intent(f"i{n}", node_selectors=[pb.NodeSelector(key=f"k{i}") for i in range(40)])
            for n in range(1300)]),
         "intents: 52000 nodeNames and nodeSelectors entries in all, at most 50000 per source"),
    ],
)
def test_huge_lists_refused_naming_the_cap(agent, request_: pb.ApplyIntentsRequest, field: str) -> None:  # type: ignore[no-untyped-def]
    """100,000 nodeNames (or selectors) in one intent used to be accepted: 72 -> 614 MB, a 30 MB state."""
    with stub_of(agent) as stub:
        with pytest.raises(grpc.RpcError) as exc:
            stub.ApplyIntents(request_)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert exc.value.details() == field
        assert not statuses(stub, "v")


def test_undecodable_request_is_invalid_argument(agent) -> None:  # type: ignore[no-untyped-def]
    """A string field with invalid UTF-8 used to be INTERNAL ("Exception deserializing request!")."""
    raw = pb.ApplyIntentsRequest(source="abc", intents=[intent("a")]).SerializeToString()
    with grpc.insecure_channel(f"unix://{agent.config.api.socket}") as channel:
        call = channel.unary_unary("/gthulhu.node.v1.NodeAgent/ApplyIntents")
        with pytest.raises(grpc.RpcError) as exc:
            call(raw.replace(b"abc", b"a\xffc"))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bad UTF-8" in exc.value.details()
        with stub_of(agent) as stub:
            assert stub.GetStatus(pb.GetStatusRequest()).agent.ready  # and it keeps answering


def test_delete(agent) -> None:  # type: ignore[no-untyped-def]
    with stub_of(agent) as stub:
        apply(stub, "del", 0, intent("a"), intent("b"))
        stub.DeleteIntent(pb.DeleteIntentRequest(source="del", id="a"))
        assert set(statuses(stub, "del")) == {"del/b"}
        with pytest.raises(grpc.RpcError) as exc:
            stub.DeleteIntent(pb.DeleteIntentRequest(source="del", id="a"))
        assert exc.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as exc:
            stub.DeleteIntent(pb.DeleteIntentRequest(source="local", id="a"))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_status_states_and_warnings(agent) -> None:  # type: ignore[no-untyped-def]
    with NamedThread("gn-status-t"), stub_of(agent) as stub:
        apply(
            stub,
            "st",
            0,
            intent("hit", regex="^gn-status-t$", priority=3),  # stronger than by-label's 7
            intent("miss", regex="^no-such-thread$"),
            intent("noop", regex="^no-such-thread$", priority=0),
            intent("elsewhere", node_names=["other-node"]),
            intent(
                "by-label",
                regex="^gn-status-t$",
                priority=7,
                node_selectors=[pb.NodeSelector(key="gpu", value="gb10")],
            ),
            intent("wrong-label", node_selectors=[pb.NodeSelector(key="gpu", value="h100")]),
        )
        st = wait_for(
            lambda: (s := statuses(stub, "st")) and s["st/hit"].matched_tasks == 1 and s, what="match"
        )
        assert st["st/hit"].state == APPLIED and not st["st/hit"].warnings
        assert st["st/miss"].state == APPLIED and NO_MATCH_WARNING in st["st/miss"].warnings
        assert "comm" in NO_MATCH_WARNING and "command line" in NO_MATCH_WARNING
        assert NOOP_WARNING in st["st/noop"].warnings
        for key in ("st/elsewhere", "st/wrong-label"):
            assert st[key].state == pb.INTENT_STATE_NOT_FOR_THIS_NODE
            assert "not for this node" in st[key].reason and "test-node" in st[key].reason
        assert st["st/by-label"].state == APPLIED
        assert st["st/by-label"].matched_tasks == 0
        assert any("overlaps with st/hit" in w for w in st["st/by-label"].warnings)
        assert st["st/hit"].last_changed.seconds > 0
        summary = stub.GetStatus(pb.GetStatusRequest()).agent
        assert summary.node_name == "test-node" and summary.backend == "dry-run" and summary.ready
        assert "dry run forced" in summary.backend_reason and summary.scheduler_state == "running"


def test_failed_with_reason_when_the_map_is_full() -> None:
    with (
        NamedThread("gn-full-a"),
        NamedThread("gn-full-b"),
        running_agent(backend=DryRunBackend(capacity=1)) as a,
        stub_of(a) as stub,
    ):
        apply(stub, "full", 0, intent("both", regex="^gn-full-[ab]$", priority=4))
        st = wait_for(
            lambda: (s := statuses(stub)["full/both"]).state == pb.INTENT_STATE_FAILED and s,
            what="Failed status",
        )
        assert "not written" in st.reason and "full" in st.reason.lower()
        assert MAP_FULL_WARNING in st.warnings


class RefusingBackend(DryRunBackend):
    """Refuses every upsert with an error that is not a full map, whatever its words say."""

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        result = super().apply({}, deletes)
        result.failed.update({k: BackendError("journal disk full") for k in upserts})
        return result


def test_a_refusal_that_is_not_a_full_map_does_not_say_so() -> None:
    """The map-capacity advice comes from the failure's typed reason, not from "full" in its text."""
    with (
        NamedThread("gn-disk-a"),
        running_agent(backend=RefusingBackend()) as a,
        stub_of(a) as stub,
    ):
        apply(stub, "disk", 0, intent("a", regex="^gn-disk-a$", priority=4))
        st = wait_for(
            lambda: (s := statuses(stub)["disk/a"]).state == pb.INTENT_STATE_FAILED and s,
            what="Failed status",
        )
        assert "not written: journal disk full" in st.reason
        assert MAP_FULL_WARNING not in st.warnings


def test_watch_status_streams_a_change(agent) -> None:  # type: ignore[no-untyped-def]
    with stub_of(agent) as stub:
        stream = stub.WatchStatus(pb.WatchStatusRequest(source="watch"))
        first = next(stream)
        assert first.HasField("snapshot")
        got: list[pb.StatusEvent] = []

        def read() -> None:
            for ev in stream:
                got.append(ev)
                if ev.HasField("removed"):
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        apply(stub, "watch", 0, intent("w1"))
        stub.DeleteIntent(pb.DeleteIntentRequest(source="watch", id="w1"))
        reader.join(20)
        stream.cancel()
        changed = [e.changed for e in got if e.HasField("changed")]
        assert changed and changed[0].key == "watch/w1" and changed[0].source == "watch"
        assert got[-1].removed == "watch/w1"
        assert all(e.changed.source == "watch" for e in got if e.HasField("changed"))


@pytest.mark.parametrize("scope", ["thread", "process"])
def test_list_matches_shows_a_renamed_thread(agent, scope: str) -> None:  # type: ignore[no-untyped-def]
    with NamedThread("gn-plain") as t, stub_of(agent) as stub:
        apply(
            stub,
            f"m-{scope}",
            0,
            intent("eng", regex="^gn-engine-[0-9]+$", priority=9, execution_time=2_000_000, scope=scope),
        )

        def mine() -> list[pb.Match]:
            return [m for m in stub.ListMatches(pb.ListMatchesRequest()).matches if m.tid == t.tid]

        # Not matched before the rename. Waited for, not read once: under process scope a thread of this
        # process from the case before (renamed, then gone) counts until the agent has handled its exit.
        wait_for(lambda: not mine(), what="no match for the thread before its rename")
        t.rename("gn-engine-7")
        (m,) = wait_for(mine, what="the renamed thread in ListMatches")
        assert (m.tgid, m.comm, m.intent, m.priority, m.slice_ns, m.scope) == (
            os.getpid(),
            "gn-engine-7",
            f"m-{scope}/eng",
            9,
            2_000_000,
            scope,
        )
        only = stub.ListMatches(pb.ListMatchesRequest(intent=f"m-{scope}/eng")).matches
        assert {x.intent for x in only} == {f"m-{scope}/eng"}
        stub.ApplyIntents(pb.ApplyIntentsRequest(source=f"m-{scope}", intents=[]))


def test_local_files_loaded_reloaded_and_bad_file_reported() -> None:
    base = short_dir()
    policies = base / "policies.d"
    policies.mkdir()
    (policies / "vllm.yaml").write_text("id: vllm\ncommandRegex: '^EngineCore'\npriority: 10\n")
    (policies / "upstream.json").write_text(
        '{"nodeNames": ["test-node"], "nodeSelectors": [], "draSelectors": [], '
        '"commandRegex": "^gn-up$", "priority": 1, "executionTime": 2000000}'
    )
    with running_agent(base) as a, stub_of(a) as stub:
        st = statuses(stub, "local")
        assert set(st) == {"local/vllm", "local/upstream-0"}  # loaded before the agent was ready
        assert st["local/upstream-0"].state == APPLIED
        (policies / "vllm.yaml").write_text("id: vllm\ncommandRegex: '^EngineCore'\npriority: 12\n")
        wait_for(lambda: statuses(stub, "local")["local/vllm"].intent.priority == 12, what="poll reload")
        (policies / "broken.yaml").write_text("id: [\n")
        (policies / "vllm.yaml").write_text("id: vllm\ncommandRegex: '^EngineCore'\npriority: 99\n")
        a.reload()  # what SIGHUP does
        resp = stub.GetStatus(pb.GetStatusRequest(source="local"))
        (src,) = resp.sources
        assert any("broken.yaml" in e and "not valid YAML" in e for e in src.errors)
        assert any("vllm.yaml" in e and "priority 99" in e for e in src.errors)
        assert {s.key: s.intent.priority for s in resp.intents} == {"local/vllm": 12, "local/upstream-0": 1}
        assert not any("draSelectors" in n for n in src.notes)  # an empty list is no DRA selector
        assert a.stats().local_files.bad_files == 2


def test_health_service(agent) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(f"unix://{agent.config.api.socket}") as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", "gthulhu.node.v1.NodeAgent"):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_socket_is_root_only(agent) -> None:  # type: ignore[no-untyped-def]
    sock: Path = agent.config.api.socket
    assert stat.S_IMODE(sock.stat().st_mode) == 0o600
    assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
    assert sock.stat().st_uid == 0
    # Even with the directory opened up, the socket's own mode keeps a non-root user out.
    sock.parent.chmod(0o755)
    try:
        pid = os.fork()
        if pid == 0:  # child: become nobody, try to connect
            code = 3
            try:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
                s = socket.socket(socket.AF_UNIX)
                try:
                    s.connect(str(sock))
                    code = 0
                except PermissionError:
                    code = 1
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 1
    finally:
        sock.parent.chmod(0o700)


class FlakyDryRun(DryRunBackend):
    """A dry-run backend whose restart can be made to fail, to hold it in the ejected state."""

    fail_start = False

    def start(self) -> None:
        if self.fail_start:
            from gthulhu_node.backends.base import BackendUnavailable

            raise BackendUnavailable("test: reload refused")
        super().start()


def test_failed_while_the_scheduler_is_ejected_then_applied_again() -> None:
    backend = FlakyDryRun()
    with (
        NamedThread("gn-eject-t"),
        running_agent(backend=backend, scheduler={"reload_backoff_initial_s": 0.5}) as a,
        stub_of(a) as stub,
    ):
        apply(stub, "ej", 0, intent("e", regex="^gn-eject-t$", priority=6))
        wait_for(lambda: statuses(stub)["ej/e"].state == APPLIED, what="Applied")
        backend.fail_start = True
        assert a.engine is not None
        a.engine.call(lambda r: backend.eject("test: watchdog fired"))
        st = wait_for(
            lambda: (s := statuses(stub)["ej/e"]).state == pb.INTENT_STATE_FAILED and s, what="Failed"
        )
        assert "ejected" in st.reason and "watchdog fired" in st.reason
        assert stub.GetStatus(pb.GetStatusRequest()).agent.scheduler_state == "ejected"
        backend.fail_start = False
        st = wait_for(lambda: (s := statuses(stub)["ej/e"]).state == APPLIED and s, what="Applied again")
        assert st.matched_tasks == 1 and not st.reason


class SlowWrites(DryRunBackend):
    """Takes 40 ms per written key, so a policy's entries are written over several engine loop turns."""

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        deletes = list(deletes)
        time.sleep(0.04 * (len(upserts) + len(deletes)))
        return super().apply(upserts, deletes)


def test_status_is_not_applied_before_every_entry_is_written() -> None:
    """The engine writes a long policy in slices (issue 21); meanwhile status must not call the intent
    applied: every sample that says applied was taken when the backend held all six entries."""
    backend = SlowWrites()
    names = [f"gn-slow-{i}" for i in range(6)]
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(NamedThread(name))
        a = stack.enter_context(running_agent(backend=backend))
        stub = stack.enter_context(stub_of(a))
        samples: list[tuple[int, int]] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                a.refresh_status()
                st = statuses(stub, "slow").get("slow/all")
                written = len(backend.table)  # read after the status: never more than at its computing
                samples.append((st.state if st is not None else -1, written))

        watcher = threading.Thread(target=sample, daemon=True)
        watcher.start()
        apply(stub, "slow", 0, intent("all", regex="^gn-slow-", priority=4))
        wait_for(lambda: statuses(stub, "slow")["slow/all"].state == APPLIED, what="applied")
        done.set()
        watcher.join()
        assert len(backend.table) == 6 and statuses(stub, "slow")["slow/all"].matched_tasks == 6
        assert any(state != APPLIED for state, _ in samples)  # the window was seen
        assert all(written == 6 for state, written in samples if state == APPLIED), samples


def test_a_store_write_returns_before_the_policy_is_built_and_sync_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A writer (a REST push, a gRPC apply, the policy-file poller) returns once its change is stored;
    the policy builder compiles the new set on its own thread, and `sync` (what every gRPC write waits
    on) returns only once that build is in effect. Before, the writer compiled the whole policy itself
    (1-2 s for 10,000 patterns inside a REST push): here the store's apply would block on the held build."""
    from gthulhu_node.intents.parse import parse_intent
    from gthulhu_node.policy_builder import PolicyBuilder

    release = threading.Event()
    building = threading.Event()
    real = PolicyBuilder.build

    def held(self: PolicyBuilder, *args: object) -> object:
        building.set()
        assert release.wait(60)
        return real(self, *args)  # type: ignore[arg-type]

    with NamedThread("gn-builder-t") as t, running_agent() as agent:
        monkeypatch.setattr(PolicyBuilder, "build", held)
        wrote = threading.Thread(target=lambda: agent.store.apply(
            "builder", 0, [parse_intent({"id": "b", "commandRegex": "^gn-builder-t$", "priority": 3})]))
        wrote.start()
        wrote.join(10)
        assert not wrote.is_alive(), "the store write waited for the policy build"
        assert building.wait(10), "no build started"
        synced = threading.Event()
        syncer = threading.Thread(target=lambda: (agent.sync(), synced.set()))
        syncer.start()
        assert not synced.wait(0.5), "sync returned before the held build was handed to the engine"
        release.set()
        syncer.join(30)
        assert synced.is_set()
        with stub_of(agent) as stub:
            row = statuses(stub, "builder")["builder/b"]
            assert row.state == APPLIED and row.matched_tasks == 1
        assert any(m.tid == t.tid for m in agent.matches())
