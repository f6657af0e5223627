"""An upgrade as the agent sees it: a real agent process (dry-run backend) started on the state file an
earlier release wrote (tests/fixtures/state/, see tests/unit/test_versions.py) serves its intents, with
their generations, before its API answers; one started on a newer release's file refuses to start and
leaves the file where it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.intents.localfiles import SCALE_MARKER
from gthulhu_node.intents.state_file import STATE_FILE
from tests.host.agent_support import AgentProcess, agent_process, client, short_dir, statuses, write_config

pytestmark = pytest.mark.host

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "intents-0.1.0.json"
STATE_V2 = FIXTURE.parent / "v2-before-issue39"


def test_agent_serves_the_intents_release_0_1_0_saved() -> None:
    base = short_dir()
    try:
        (base / "state").mkdir()
        shutil.copy(FIXTURE, base / "state" / STATE_FILE)
        with agent_process(base) as p, client(p.socket) as stub:
            st = statuses(stub)
            # the Manager's refused entry keeps its status too (a lenient sender's view survives)
            assert set(st) == {"cli/vllm", "ops/batch", "manager/manager-1", "manager/manager-2#1"}
            assert st["cli/vllm"].intent.priority == 5  # saved as 10 on the scale before issue 39
            assert st["cli/vllm"].intent.execution_time == 2_000_000
            sources = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
            generations = {s.source: s.generation for s in sources.sources}
            assert (generations["cli"], generations["ops"], generations["manager"]) == (2, 7, 1)
            assert p.stop() == 0
        # nothing was moved aside or rewritten by reading it (the scale's marker: docs/intents.md)
        assert sorted(f.name for f in (base / "state").iterdir()) == [STATE_FILE, SCALE_MARKER]
        assert (base / "state" / STATE_FILE).read_bytes() == FIXTURE.read_bytes()
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


def _events(p: AgentProcess, name: str) -> list[dict[str, object]]:
    out = []
    for line in p.log.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if doc.get("event") == name:
            out.append(doc)
    return out


def test_first_start_after_the_scale_turned() -> None:
    """Issue 39: an agent started on the state directory the release before wrote (priorities on the old
    scale) serves its saved intents migrated, and names the policy files holding boosted intents (which it
    never rewrites) in a warning with the rule and in status, on that first start only."""
    base = short_dir()
    try:
        shutil.copytree(STATE_V2, base / "state")
        policies = base / "policies.d"
        policies.mkdir(mode=0o755)
        boosted = policies / "vllm.yaml"
        boosted.write_text("id: vllm\ncommandRegex: '^EngineCore$'\npriority: 10\n")
        (policies / "slice.yaml").write_text("id: slice\ncommandRegex: '^llama$'\nexecutionTime: 1000000\n")
        with agent_process(base) as p, client(p.socket) as stub:
            st = statuses(stub)
            assert st["cli/vllm"].intent.priority == 5 and st["ops/batch"].intent.priority == 9
            assert st["manager/manager-1"].intent.priority == 8
            assert st["local/vllm"].intent.priority == 10  # the admin's file, as written
            warned = _events(p, "policy_files_old_scale")
            assert len(warned) == 1 and warned[0]["files"] == [str(boosted)], warned
            assert "9 - ((old - 1) * 9) // 20" in str(warned[0]["rule"])
            migrated = _events(p, "intents_priorities_migrated")
            assert len(migrated) == 1 and migrated[0]["sources"] == ["cli", "ops"], migrated
            shown = stub.GetStatus(pb.GetStatusRequest(), timeout=5)
            notes = [n for s in shown.sources for n in s.notes]
            assert any(str(boosted) in n and "20 -> 1" in n for n in notes), notes
            assert p.stop() == 0
        assert boosted.read_text().endswith("priority: 10\n")  # never rewritten
        with agent_process(base) as p, client(p.socket) as stub:
            assert statuses(stub)["cli/vllm"].intent.priority == 5  # not migrated twice
            assert len(_events(p, "policy_files_old_scale")) == 1  # the log holds the first start's only
            assert p.stop() == 0
    finally:
        shutil.rmtree(base, ignore_errors=True)
