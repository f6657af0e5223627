"""Local policy files: the accepted forms, default ids, bad files, reload keeping the last good content."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gthulhu_node.intents.localfiles import LocalPolicies, PolicyFileError, read_file
from gthulhu_node.intents.store import IntentStore

# Upstream Gthulhu's documented REST body for a node scheduling policy, unchanged.
UPSTREAM_BODY = {
    "nodeNames": ["dgx-spark-1"],
    "nodeSelectors": [{"key": "gpu", "value": "gb10"}],
    "draSelectors": [],
    "commandRegex": "^EngineCore(_DP[0-9]+)?$",
    "priority": 10,
    "executionTime": 2000000,
}


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_single_yaml_intent(tmp_path: Path) -> None:
    f = write(tmp_path / "vllm.yaml", "id: vllm\ncommandRegex: '^EngineCore'\npriority: 10\nscope: process\n")
    (i,) = read_file(f).intents
    assert (i.id, i.command_regex, i.priority, i.scope.value) == ("vllm", "^EngineCore", 10, "process")


def test_list_and_intents_key_and_default_ids(tmp_path: Path) -> None:
    f = write(tmp_path / "many.json", json.dumps([{"commandRegex": "a"}, {"id": "b", "commandRegex": "b"}]))
    assert [i.id for i in read_file(f).intents] == ["many-0", "b"]
    g = write(tmp_path / "wrapped.yml", "intents:\n  - commandRegex: x\n    priority: 1\n")
    assert [i.id for i in read_file(g).intents] == ["wrapped-0"]


def test_upstream_rest_body_accepted_as_is(tmp_path: Path) -> None:
    f = write(tmp_path / "policy.json", json.dumps(UPSTREAM_BODY))
    result = read_file(f)
    (i,) = result.intents
    assert i.id == "policy-0" and i.node_names == ("dgx-spark-1",) and i.execution_time == 2_000_000
    assert i.node_selectors[0].key == "gpu"
    assert not result.notes and not result.failed  # an empty draSelectors list is no selector


@pytest.mark.parametrize(
    ("node", "labels", "selected"),
    [
        ("dgx-spark-1", {"gpu": "gb10"}, True),
        ("dgx-spark-1", {"gpu": "h100"}, False),  # named, but the label query does not hold
        ("dgx-spark-2", {"gpu": "gb10"}, False),  # labelled, but not named (before: selected, OR)
    ],
)
def test_node_names_and_selectors_combine_as_upstream(
    tmp_path: Path, node: str, labels: dict[str, str], selected: bool
) -> None:
    """Upstream's Manager intersects nodeNames with the label query (node_policy_svc.go
    resolveNodesForPolicy, Gthulhu/Gthulhu@c969a96b); the OR read here before applied this policy to
    every gb10 node whatever its name, and to a named node without the label (the second and third cases
    failed before the fix)."""
    (i,) = read_file(write(tmp_path / "policy.json", json.dumps(UPSTREAM_BODY))).intents
    assert i.selects_node(node, labels) is selected


def test_entry_without_selectors_is_for_this_node(tmp_path: Path) -> None:
    (i,) = read_file(write(tmp_path / "mine.yaml", "commandRegex: x\npriority: 1\n")).intents
    assert i.selects_node("any-node", {})


def test_dra_selected_entry_is_failed_never_applied(tmp_path: Path) -> None:
    """A DRA-only policy used to be applied on every node (draSelectors ignored); it must not be."""
    body = {**UPSTREAM_BODY, "nodeNames": [], "nodeSelectors": [],
            "draSelectors": [{"deviceClassName": "gpu.nvidia.com"}]}
    d = tmp_path / "policies.d"
    d.mkdir()
    write(d / "dra.json", json.dumps(body))
    write(d / "plain.yaml", "id: plain\ncommandRegex: x\n")
    store = IntentStore(None)
    LocalPolicies(d, store, poll_interval_s=0).reload()
    held = store.get("local")
    assert held is not None and [i.id for i in held.intents] == ["plain"]
    (entry,) = held.entries
    assert entry.key == "dra-0#0" and "draSelectors cannot be evaluated on a node" in entry.failed


def test_node_name_from_environment_first(monkeypatch: pytest.MonkeyPatch) -> None:
    from gthulhu_node.config import AgentConfig

    assert AgentConfig.model_validate({"node": {"name": "from-config"}}).node.name == "from-config"
    monkeypatch.setenv("NODE_NAME", "from-downward-api")
    assert AgentConfig.model_validate({"node": {"name": "from-config"}}).node.name == "from-downward-api"
    assert AgentConfig().node.name == "from-downward-api"


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("bad.yaml", "id: [unclosed\n", "not valid YAML"),
        ("bad.json", "{", "not valid JSON"),
        ("bad.yaml", "- id: a\n  commandRegex: x\n  priority: 99\n", "[0].priority: priority 99"),
        ("bad.yaml", "- {id: a, commandRegex: x}\n- {id: a, commandRegex: y}\n", "duplicate id 'a'"),
        ("bad.yaml", "42\n", "got int"),
        ("bad.yaml", "intents: {}\n", "intents: expected a list"),
    ],
)
def test_bad_files_say_why(tmp_path: Path, name: str, text: str, words: str) -> None:
    with pytest.raises(PolicyFileError, match=None) as exc:
        read_file(write(tmp_path / name, text))
    assert words in str(exc.value)


def test_world_writable_refused(tmp_path: Path) -> None:
    f = write(tmp_path / "open.yaml", "commandRegex: x\n")
    os.chmod(f, 0o666)
    with pytest.raises(PolicyFileError, match="world-writable"):
        read_file(f)


def test_directory_reload_bad_file_keeps_last_good_and_spares_others(tmp_path: Path) -> None:
    store = IntentStore(None)
    d = tmp_path / "policies.d"
    d.mkdir()
    write(d / "a.yaml", "id: a\ncommandRegex: x\npriority: 1\n")
    write(d / "b.yaml", "id: b\ncommandRegex: y\npriority: 2\n")
    write(d / "notes.txt", "ignored")
    write(d / ".hidden.yaml", "ignored: [")
    local = LocalPolicies(d, store)
    local.reload()
    assert sorted(i.id for i in store.get("local").intents) == ["a", "b"]  # type: ignore[union-attr]
    write(d / "b.yaml", "id: b\ncommandRegex: y\npriority: 200\n")
    write(d / "c.json", "{")
    local.reload()
    held = {i.id: i for i in store.get("local").intents}  # type: ignore[union-attr]
    assert sorted(held) == ["a", "b"] and held["b"].priority == 2  # b's last good content stays
    errors = local.errors()
    assert set(errors) == {str(d / "b.yaml"), str(d / "c.json")}
    assert "priority 200" in errors[str(d / "b.yaml")]
    assert local.stats().bad_files == 2
    (d / "b.yaml").unlink()
    write(d / "c.json", '{"id": "c", "commandRegex": "z"}')
    local.reload()
    assert sorted(i.id for i in store.get("local").intents) == ["a", "c"]  # type: ignore[union-attr]
    assert local.errors() == {}


def test_id_clash_between_files(tmp_path: Path) -> None:
    store = IntentStore(None)
    write(tmp_path / "1.yaml", "id: same\ncommandRegex: x\n")
    write(tmp_path / "2.yaml", "id: same\ncommandRegex: y\n")
    local = LocalPolicies(tmp_path, store)
    local.reload()
    assert [i.command_regex for i in store.get("local").intents] == ["x"]  # type: ignore[union-attr]
    assert "also defined in 1.yaml" in local.errors()[str(tmp_path / "2.yaml")]
    (tmp_path / "1.yaml").unlink()
    local.reload(force=False)
    assert [i.command_regex for i in store.get("local").intents] == ["y"]  # type: ignore[union-attr]
    assert local.errors() == {}
