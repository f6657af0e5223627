"""An upgrade as the agent sees it: a real agent process (dry-run backend) started on the state file an
earlier release wrote (tests/fixtures/state/, see tests/unit/test_versions.py) serves its intents, with
their generations, before its API answers; one started on a newer release's file refuses to start and
leaves the file where it is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.intents.store import STATE_FILE
from tests.host.agent_support import AgentProcess, agent_process, client, short_dir, statuses, write_config

pytestmark = pytest.mark.host

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "intents-0.1.0.json"


def test_agent_serves_the_intents_release_0_1_0_saved() -> None:
    base = short_dir()
    try:
        (base / "state").mkdir()
        shutil.copy(FIXTURE, base / "state" / STATE_FILE)
        with agent_process(base) as p, client(p.socket) as stub:
            st = statuses(stub)
            # the Manager's refused entry keeps its status too (a lenient sender's view survives)
            assert set(st) == {"cli/vllm", "ops/batch", "manager/manager-1", "manager/manager-2#1"}
            assert st["cli/vllm"].intent.priority == 10
            assert st["cli/vllm"].intent.execution_time == 2_000_000
            sources = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
            generations = {s.source: s.generation for s in sources.sources}
            assert (generations["cli"], generations["ops"], generations["manager"]) == (2, 7, 1)
            assert p.stop() == 0
        # nothing was moved aside or rewritten by reading it
        assert [f.name for f in (base / "state").iterdir()] == [STATE_FILE]
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_agent_refuses_a_newer_release_state_file() -> None:
    base = short_dir()
    try:
        (base / "state").mkdir()
        newer = FIXTURE.read_text().replace('"version": 1', '"version": 99', 1)
        (base / "state" / STATE_FILE).write_text(newer)
        p = AgentProcess(write_config(base), base / "run" / "api.sock")
        with pytest.raises(AssertionError, match="agent exited with 1"):
            p.start()
        assert "written by a newer gthulhu-node" in p.log.read_text()
        assert (base / "state" / STATE_FILE).read_text() == newer
    finally:
        shutil.rmtree(base, ignore_errors=True)
