"""The probe's thread sources against the real thing, without BPF: the agent's ListMatches over its real
socket (dry-run backend: nothing is rescheduled) and the regex source on real /proc and proc events. These
decide what the kernel filter holds, so they are tested where the kernel side cannot run."""

from __future__ import annotations

import time

import pytest

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.probe.preflight import ProbeUnavailable
from gthulhu_node.probe.targets import AgentTargets, RegexTargets, Target
from tests.host.agent_support import NamedThread, intent, running_agent, short_dir, stub_of, wait_for

pytestmark = pytest.mark.host


def _with(got: dict[int, Target], *tids: int) -> dict[int, Target] | None:
    return got if set(tids) <= set(got) else None


def test_agent_source_follows_list_matches() -> None:
    with running_agent() as agent, NamedThread("gn-probe-a") as a, NamedThread("gn-probe-b") as b:
        with stub_of(agent) as stub:
            stub.ApplyIntents(pb.ApplyIntentsRequest(source="t", intents=[
                intent("one", regex="^gn-probe-a$"), intent("two", regex="^gn-probe-b$", priority=0,
                                                             execution_time=2_000_000)]))
        source = AgentTargets(agent.config.api.socket)
        only_one = AgentTargets(agent.config.api.socket, intent="t/one")
        try:
            got = wait_for(lambda: _with(source.poll(), a.tid, b.tid), what="both threads listed")
            assert (got[a.tid].intent, got[b.tid].intent) == ("t/one", "t/two")
            assert got[a.tid].comm == "gn-probe-a"
            assert set(only_one.poll()) == {a.tid}
            b.rename("gn-elsewhere")  # no longer matched: leaves the source's set
            wait_for(lambda: b.tid not in source.poll(), what="the renamed thread to leave")
        finally:
            source.close()
            only_one.close()


def test_agent_source_without_an_agent_is_one_clear_line() -> None:
    with pytest.raises(ProbeUnavailable) as info:
        AgentTargets(short_dir() / "none.sock", timeout_s=2)
    message = str(info.value)
    assert "\n" not in message and "cannot list matches from the agent" in message and "--regex" in message


def test_regex_source_follows_creation_rename_and_exit() -> None:
    source = RegexTargets("^gn-rx-")
    try:
        with NamedThread("gn-rx-early") as early:
            wait_for(lambda: _with(source.poll(), early.tid), what="the early thread")
            with NamedThread("plain-name") as late:
                late.rename("gn-rx-late")
                wait_for(lambda: late.tid in source.poll(), what="the renamed thread")
            wait_for(lambda: late.tid not in source.poll(), what="the exited thread to leave")
        time.sleep(0.1)
        wait_for(lambda: early.tid not in source.poll(), what="the early thread to leave")
    finally:
        source.close()
