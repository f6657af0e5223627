"""Upgrades: the state file and the configuration carry a format version, an agent reads what an earlier
release wrote, and refuses (without destroying) what a newer release wrote.

tests/fixtures/state/intents-0.1.0.json is the state file release 0.1.0 wrote, kept byte for byte: a later
release must load it (same generations, sender entries and Manager digests; since issue 39 the priorities
of the sources that are not the Manager's on today's scale). When a release changes the format, add its own
fixture next to it (`python -m tests.unit.test_versions --write <path>` writes one with the code of the
checkout) and keep the old ones: each stays a test. tests/fixtures/state/v2-before-issue39/ is the state
directory (snapshot and journal, format version 2) that the revision before issue 39 (d9f7f60) wrote with
its own `write_fixture`: priorities on the old scale, 20 the strongest.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from gthulhu_node import config as configuration
from gthulhu_node.intents.model import Intent, SenderEntry
from gthulhu_node.intents.parse import parse_intent
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.intents.state_file import STATE_FILE, STATE_VERSION
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.intents.store_errors import NewerStateError
from gthulhu_node.rest.merkle import records_root
from gthulhu_node.rest.translate import node_record_of

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "state"
RELEASE_0_1_0 = FIXTURES / "intents-0.1.0.json"
STATE_V2 = FIXTURES / "v2-before-issue39"
# The Manager's node-policy merkle root of both fixtures, as the revision before issue 39 served it (d9f7f60's
# rest/app.py `_node_root` over the fixture): the Manager's numbers are not migrated, so the upgrade
# changes no root and causes no re-push.
MANAGER_ROOT_BEFORE = "18cb630deadb74f4d34e182f226131209e2a8a3262eb8905b910130590eee634"
REPO = Path(__file__).resolve().parents[2]


def _intent(doc: dict[str, object]) -> Intent:
    return parse_intent(doc)


def write_fixture(state_dir: Path) -> Path:
    """What the fixture holds: every persisted feature of the format (several sources and generations,
    a slice-only intent, user and cgroup filters, node selectors, a lenient sender's entries)."""
    store = IntentStore(state_dir)
    store.apply("cli", 0, [
        _intent({"id": "vllm", "commandRegex": "^EngineCore(_DP[0-9]+)?$", "priority": 5,
                 "executionTime": 2_000_000}),
        _intent({"id": "slice-only", "commandRegex": "^llama-server$", "executionTime": 1_000_000,
                 "users": ["llm"]}),
    ])
    store.apply("cli", 0, [
        _intent({"id": "vllm", "commandRegex": "^EngineCore(_DP[0-9]+)?$", "priority": 5,
                 "executionTime": 2_000_000, "cgroupRegex": "^/system.slice/vllm.service$"}),
    ])
    store.apply("ops", 7, [
        _intent({"id": "batch", "commandRegex": "^batch-", "priority": 9,
                 "nodeSelectors": [{"key": "gpu", "value": "true"}]}),
    ])
    entries = [
        SenderEntry(record={"policyID": "manager-1", "priority": 8, "commandRegex": "^worker$"},
                    key="manager-1", intent_id="manager-1"),
        SenderEntry(record={"policyID": "manager-2", "priority": 25}, key="manager-2#1",
                    failed="priority 25 is above 20"),
    ]
    store.apply("manager", 0, [_intent({"id": "manager-1", "commandRegex": "^worker$", "priority": 8})],
                allow_reserved=True, entries=entries)
    return state_dir / STATE_FILE


def test_reads_the_state_file_release_0_1_0_wrote(tmp_path: Path) -> None:
    shutil.copy(RELEASE_0_1_0, tmp_path / STATE_FILE)
    store = IntentStore(tmp_path)
    assert store.load() == 3
    snap = store.snapshot()
    assert sorted(snap) == ["cli", "manager", "ops"]
    assert snap["cli"].generation == 2 and [i.id for i in snap["cli"].intents] == ["vllm"]
    vllm = snap["cli"].intents[0]
    # migrated to today's scale (old 10 -> 5, old 3 -> 9); the Manager's numbers as it pushed them
    assert (vllm.priority, vllm.execution_time, vllm.cgroup_regex) == (5, 2_000_000,
                                                                      "^/system.slice/vllm.service$")
    assert snap["ops"].generation == 7 and snap["ops"].intents[0].priority == 9
    assert snap["manager"].intents[0].priority == 8
    assert _manager_root(snap) == MANAGER_ROOT_BEFORE
    assert [e.key for e in snap["manager"].entries] == ["manager-1", "manager-2#1"]
    assert snap["manager"].entries[1].failed == "priority 25 is above 20"
    # read as it was written: what this release would write for the same content is the same file
    fresh = write_fixture(tmp_path / "fresh")
    again = IntentStore(tmp_path / "fresh")
    again.load()
    for name in snap:
        assert again.get(name).push_digest == snap[name].push_digest, name  # type: ignore[union-attr]
    assert fresh.is_file()


def _manager_root(snap: dict[str, SourceSet]) -> str:
    """The node-policy root the agent serves the Manager (rest/intent_routes.py `_node_root`)."""
    return records_root(node_record_of(e) for e in snap["manager"].entries)


def test_migrates_the_priorities_of_a_version_2_state_directory(tmp_path: Path) -> None:
    """Issue 39: the saved intents of the CLI and gRPC sources move to upstream's scale by the stated rule
    (old 20 -> 1, old 1 -> 9: limits.migrate_pre_issue39), journal included; the Manager's keep their numbers
    and its merkle root; the first change writes the current version, and a restart reads the same numbers
    (the migration is not applied twice)."""
    state = tmp_path / "state"
    shutil.copytree(STATE_V2, state)
    store = IntentStore(state)
    assert store.load() == 3
    snap = store.snapshot()
    assert snap["cli"].generation == 2 and snap["cli"].intents[0].priority == 5  # old 10
    assert snap["ops"].generation == 7 and snap["ops"].intents[0].priority == 9  # old 3
    assert snap["manager"].intents[0].priority == 8  # the Manager's number, as pushed
    assert [e.record.get("priority") for e in snap["manager"].entries] == [8, 25]
    assert _manager_root(snap) == MANAGER_ROOT_BEFORE
    # a retry of the migrated set is no change; the stored digest names what is stored
    assert not store.apply("ops", 7, list(snap["ops"].intents)).changed
    store.apply("grpc-client", 0, [_intent({"id": "new", "commandRegex": "^x$", "priority": 2})])
    assert json.loads((state / STATE_FILE).read_text())["version"] == STATE_VERSION
    again = IntentStore(state)
    again.load()
    after = again.snapshot()
    assert [after[n].intents[0].priority for n in ("cli", "ops", "manager", "grpc-client")] == [5, 9, 8, 2]
    assert _manager_root(after) == MANAGER_ROOT_BEFORE


@pytest.mark.parametrize("journal", ["none", "another snapshot's"])
def test_a_version_2_snapshot_without_its_journal_is_migrated_too(tmp_path: Path, journal: str) -> None:
    """Every snapshot write removes the journal, so most v2 state directories hold intents.json alone (or a
    journal another snapshot left). The scale was taken from the journal's header then: with no journal to
    read, the v2 snapshot was loaded unmigrated and its strongest old level (20) became a weak head start."""
    state = tmp_path / "state"
    shutil.copytree(STATE_V2, state)
    if journal == "none":
        (state / "intents.journal").unlink()
    else:
        text = (state / "intents.journal").read_text()
        other = text.replace('"journal":"ff8fe28f9b7cd6cd"', '"journal":"0"', 1)
        (state / "intents.journal").write_text(other)
    store = IntentStore(state)
    store.load()
    snap = store.snapshot()
    assert snap["cli"].generation == 1
    assert [i.priority for i in snap["cli"].intents] == [5, 0]  # old 10 -> 5; slice-only stays 0


def test_a_newer_state_file_is_refused_and_left_in_place(tmp_path: Path) -> None:
    text = RELEASE_0_1_0.read_text().replace('"version": 1', '"version": 99', 1)
    (tmp_path / STATE_FILE).write_text(text)
    with pytest.raises(NewerStateError, match="newer gthulhu-node"):
        IntentStore(tmp_path).load()
    assert (tmp_path / STATE_FILE).read_text() == text
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]


def test_config_carries_a_version() -> None:
    default = configuration.load(REPO / "gthulhu_node" / "share" / "config.yaml")
    assert default.version == configuration.CONFIG_VERSION == 1
    assert "\nversion: 1 " in (REPO / "gthulhu_node" / "share" / "config.yaml").read_text()


def test_config_without_a_version_is_the_first_format(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("log: {level: debug}\n")
    assert configuration.load(path).version == 1


def test_config_of_a_newer_format_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("version: 2\n")
    with pytest.raises(configuration.ConfigError, match="written for a newer gthulhu-node"):
        configuration.load(path)


if __name__ == "__main__":
    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        sys.exit("usage: python -m tests.unit.test_versions --write PATH")
    target = Path(sys.argv[2])
    scratch = target.parent / ".state-fixture"
    shutil.move(write_fixture(scratch), target)
    shutil.rmtree(scratch)
    print(target)
