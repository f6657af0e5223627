"""A real agent process (`gthulhu-node run --config ...`, dry-run backend forced): intents survive a clean
restart and SIGKILL, are in effect before the API answers, SIGHUP re-reads the policy files, and a
corrupt state file is moved aside while the agent starts empty."""

from __future__ import annotations

import signal
import threading

import grpc
import pytest

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.intents.journal import JOURNAL_FILE
from gthulhu_node.intents.localfiles import SCALE_MARKER
from gthulhu_node.intents.state_file import STATE_FILE
from tests.host.agent_support import (
    NamedThread,
    agent_process,
    client,
    intent,
    short_dir,
    statuses,
    wait_for,
)

pytestmark = pytest.mark.host


def test_intents_survive_restart_and_sigkill_and_apply_before_the_api() -> None:
    base = short_dir()
    policies = base / "policies.d"
    policies.mkdir()
    (policies / "engine.yaml").write_text("id: eng\ncommandRegex: '^gn-proc-eng$'\npriority: 9\n")
    with NamedThread("gn-proc-eng") as eng, agent_process(base) as p:
        with client(p.socket) as stub:
            stub.ApplyIntents(
                pb.ApplyIntentsRequest(
                    source="persist",
                    generation=3,
                    intents=[intent("a", regex="^gn-proc-eng$", priority=8), intent("b")],  # beats 9
                )
            )
            stub.DeleteIntent(pb.DeleteIntentRequest(source="persist", id="b"))
        assert p.stop() == 0  # clean stop
        p.start()
        with client(p.socket) as stub:
            first = statuses(stub)  # the very first answer after the restart
            assert first["persist/a"].state == pb.INTENT_STATE_APPLIED
            assert first["persist/a"].matched_tasks == 1  # in effect before the API answered
            assert first["local/eng"].state == pb.INTENT_STATE_APPLIED
            assert "persist/b" not in first
            assert first["persist/a"].generation == 3
            matches = stub.ListMatches(pb.ListMatchesRequest()).matches
            assert [m.intent for m in matches if m.tid == eng.tid] == ["persist/a"]
            stub.ApplyIntents(pb.ApplyIntentsRequest(source="persist", generation=4, intents=[intent("c")]))
        p.kill()  # SIGKILL: no chance to save anything on the way out
        p.start()
        with client(p.socket) as stub:
            after = statuses(stub, "persist")
            assert set(after) == {"persist/c"} and after["persist/c"].generation == 4
            with pytest.raises(grpc.RpcError) as exc:
                stub.ApplyIntents(pb.ApplyIntentsRequest(source="persist", generation=3, intents=[]))
            assert exc.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_sigkill_during_a_stream_of_applies_keeps_an_acknowledged_state() -> None:
    base = short_dir()
    with agent_process(base) as p:
        acked: list[int] = []
        stop = threading.Event()

        def hammer() -> None:
            with client(p.socket) as stub:
                gen = 0
                while not stop.is_set():
                    gen += 1
                    try:
                        stub.ApplyIntents(
                            pb.ApplyIntentsRequest(
                                source="storm", generation=gen, intents=[intent(f"g{gen}"), intent("fixed")]
                            ),
                            timeout=5,
                        )
                    except grpc.RpcError:
                        return
                    acked.append(gen)

        t = threading.Thread(target=hammer, daemon=True)
        t.start()
        wait_for(lambda: len(acked) >= 30, what="some acknowledged applies")
        p.kill()
        stop.set()
        t.join(10)
        last_acked = acked[-1]
        p.start()
        with client(p.socket) as stub:
            st = statuses(stub, "storm")
        (gen,) = {s.generation for s in st.values()}
        assert gen in (last_acked, last_acked + 1)  # the one in flight may or may not have landed
        assert set(st) == {f"storm/g{gen}", "storm/fixed"}
        # no stray temp files
        kept = (STATE_FILE, JOURNAL_FILE, SCALE_MARKER)
        assert not [f for f in (base / "state").iterdir() if f.name not in kept]


def test_sighup_rereads_policy_files() -> None:
    base = short_dir()
    policies = base / "policies.d"
    policies.mkdir()
    (policies / "a.json").write_text('{"id": "a", "commandRegex": "x", "priority": 1}')
    with agent_process(base, policies={"poll_interval_s": 0}) as p, client(p.socket) as stub:
        assert statuses(stub, "local")["local/a"].intent.priority == 1
        (policies / "a.json").write_text('{"id": "a", "commandRegex": "x", "priority": 2}')
        (policies / "b.yaml").write_text("commandRegex: y\n")
        p.signal(signal.SIGHUP)
        st = wait_for(
            lambda: (s := statuses(stub, "local")) and "local/b-0" in s and s, what="reload on SIGHUP"
        )
        assert st["local/a"].intent.priority == 2


def test_corrupt_state_file_moved_aside_and_agent_starts_empty() -> None:
    base = short_dir()
    state = base / "state"
    state.mkdir()
    (state / STATE_FILE).write_bytes(b'{"format": "gthulhu-node-intents", "version": 1, "sources": {"x": ')
    with agent_process(base) as p:
        with client(p.socket) as stub:
            assert statuses(stub) == {}
            stub.ApplyIntents(pb.ApplyIntentsRequest(source="fresh", intents=[intent("a")]))
        aside = [f for f in state.iterdir() if f.name.startswith(STATE_FILE + ".corrupt-")]
        assert len(aside) == 1 and aside[0].read_bytes().endswith(b'"x": ')
        assert '"intents_state_corrupt"' in p.log.read_text() or "intents_state_corrupt" in p.log.read_text()
        assert p.stop() == 0
        p.start()
        with client(p.socket) as stub:
            assert set(statuses(stub)) == {"fresh/a"}
