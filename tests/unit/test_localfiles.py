"""Local policy files: the accepted forms, default ids, bad files, reload keeping the last good content."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.intents.localfiles import (
    LocalPolicies,
    PolicyDirError,
    PolicyFileError,
    policy_files,
    read_file,
)
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


# Files that stopped the agent (issue 38): the reader raised ReaderError or ValueError out of the reload,
# so no later edit of any file was applied, and the agent did not start.
ONE_BAD_BYTE = {
    "nul.yaml": ("id: nul\x00\ncommandRegex: x\n", "line 1, column 8: character #x0000 is not allowed"),
    "esc.yaml": ("# \x1b[1m comment\nid: esc\ncommandRegex: x\n", "character #x001b is not allowed"),
    "digits.yaml": ("id: d\ncommandRegex: x\npriority: " + "9" * 5000 + "\n",
                    "an integer of 5000 characters"),
    "digits.json": ('{"id": "j", "commandRegex": "x", "priority": ' + "9" * 5000 + "}",
                    "an integer of 5000 digits"),
    "surrogate.json": ('{"id": "s", "commandRegex": "x\\ud800"}', "commandRegex: not valid Unicode text"),
}


def test_one_bad_byte_refuses_that_file_only(tmp_path: Path) -> None:
    store = IntentStore(None)
    write(tmp_path / "a.yaml", "id: a\ncommandRegex: x\n")
    for name, (text, _) in ONE_BAD_BYTE.items():
        write(tmp_path / name, text)
    local = LocalPolicies(tmp_path, store)
    local.reload()  # what start-up does: it used to raise here
    assert [i.id for i in store.get("local").intents] == ["a"]  # type: ignore[union-attr]
    errors = local.errors()
    for name, (_, words) in ONE_BAD_BYTE.items():
        assert words in errors[str(tmp_path / name)], (name, errors[str(tmp_path / name)])
    write(tmp_path / "b.yaml", "id: b\ncommandRegex: y\n")  # root's edits to other files still apply
    local.reload(force=False)
    assert [i.id for i in store.get("local").intents] == ["a", "b"]  # type: ignore[union-attr]


def test_whatever_a_parser_raises_is_that_files_refusal(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The boundary holds for errors nobody foresaw: a parser bug is the file's refusal (its type only:
    its words may quote the file), logged with where it was raised, and the other files are loaded."""
    from gthulhu_node.intents import localfiles

    def broken(text: str) -> Any:
        raise KeyError("SECRET words of the file")

    monkeypatch.setattr(localfiles, "load_yaml", broken)
    write(tmp_path / "a.json", '{"id": "a", "commandRegex": "x"}')
    write(tmp_path / "b.yaml", "id: b\ncommandRegex: x\n")
    store = IntentStore(None)
    local = LocalPolicies(tmp_path, store)
    local.reload()
    assert [i.id for i in store.get("local").intents] == ["a"]  # type: ignore[union-attr]
    assert local.errors()[str(tmp_path / "b.yaml")] == "could not be parsed (KeyError): not loaded"
    assert local.stats().bad_files == 1


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


# ---- hostile files (issue 18) --------------------------------------------------------------------------

NOBODY = 65534


def alias_bomb(items: int = 1000, aliases: int = 2000) -> str:
    """~20 KB that PyYAML's safe_load expands into `aliases` copies of a 1,000-item list (1 GB, 7 s)."""
    selectors = ", ".join(str(n) for n in range(items))
    return f"- &a {{commandRegex: x, nodeSelectors: [{selectors}]}}\n" + "- *a\n" * aliases


def test_yaml_alias_bomb_refused_at_the_first_anchor(tmp_path: Path) -> None:
    with pytest.raises(PolicyFileError, match=r"line 1, column 3: YAML anchors \(&name\) are not allowed"):
        read_file(write(tmp_path / "bomb.yaml", alias_bomb()))
    with pytest.raises(PolicyFileError, match=r"line 2, column 3: YAML aliases \(\*name\) are not allowed"):
        read_file(write(tmp_path / "alias.yaml", "- {commandRegex: x}\n- *a\n"))


@pytest.mark.parametrize(("name", "text"), [("deep.yaml", "[" * 5000 + "]" * 5000),
                                            ("deep.json", "[" * 5000 + "]" * 5000),
                                            ("deep2.json", "[" * 33 + "]" * 33)])
def test_deep_nesting_refused_with_the_limit(tmp_path: Path, name: str, text: str) -> None:
    with pytest.raises(PolicyFileError, match="nested more than 32 levels deep"):
        read_file(write(tmp_path / name, text))


def test_lists_past_their_caps_refused_naming_field_and_cap(tmp_path: Path) -> None:
    names = json.dumps({"id": "n", "commandRegex": "x", "nodeNames": [f"n{i}" for i in range(1025)]})
    with pytest.raises(PolicyFileError, match="nodeNames: nodeNames has 1025 entries, at most 1024"):
        read_file(write(tmp_path / "names.json", names))
    sels = json.dumps({"id": "s", "commandRegex": "x",
                       "nodeSelectors": [{"key": f"k{i}"} for i in range(65)]})
    with pytest.raises(PolicyFileError, match="nodeSelectors has 65 entries, at most 64"):
        read_file(write(tmp_path / "sels.json", sels))


def test_yaml_error_never_quotes_the_file(tmp_path: Path) -> None:
    f = write(tmp_path / "secret.yaml", "root: $6$hash-that-must-not-leak: 19000:0:99999:7:::\n")
    with pytest.raises(PolicyFileError) as exc:
        read_file(f)
    assert "hash-that-must-not-leak" not in str(exc.value) and "line" in str(exc.value)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda f: os.chown(f, NOBODY, -1), "owned by uid 65534"),
        (lambda f: os.chmod(f, 0o664), "group-writable"),
        (lambda f: os.chmod(f, 0o646), "world-writable"),
    ],
)
def test_file_someone_else_could_change_refused(tmp_path: Path, change, words: str) -> None:  # type: ignore[no-untyped-def]
    f = write(tmp_path / "p.yaml", "commandRegex: ^bash$\npriority: 20\n")
    os.chmod(f, 0o644)
    change(f)
    with pytest.raises(PolicyFileError, match=words):
        read_file(f)


def test_symlinks_only_to_trusted_files_and_never_echoed(tmp_path: Path) -> None:
    d = tmp_path / "policies.d"
    d.mkdir()
    good = write(tmp_path / "good.yaml", "id: g\ncommandRegex: x\n")
    (d / "good.yaml").symlink_to(good)
    assert [i.id for i in read_file(d / "good.yaml").intents] == ["g"]
    theirs = write(tmp_path / "theirs.yaml", "id: t\ncommandRegex: ^bash$\npriority: 20\n")
    os.chown(theirs, NOBODY, -1)
    (d / "theirs.yaml").symlink_to(theirs)
    with pytest.raises(PolicyFileError, match=f"symlink target {theirs} is owned by uid 65534"):
        read_file(d / "theirs.yaml")
    (d / "dir.yaml").symlink_to(tmp_path)
    with pytest.raises(PolicyFileError, match="which is a directory: not read"):
        read_file(d / "dir.yaml")


def test_directory_someone_else_could_change_keeps_last_good_and_says_why(tmp_path: Path) -> None:
    d = tmp_path / "policies.d"
    d.mkdir(mode=0o755)
    write(d / "a.yaml", "id: a\ncommandRegex: x\npriority: 1\n")
    store = IntentStore(None)
    local = LocalPolicies(d, store)
    local.reload()
    os.chmod(d, 0o1777)
    write(d / "evil.yaml", "id: evil\ncommandRegex: ^bash$\npriority: 20\n")
    local.reload()
    assert [i.id for i in store.get("local").intents] == ["a"]  # type: ignore[union-attr]
    assert "is world-writable" in local.errors()[str(d)]
    assert local.stats().dir_errors == 1 and local.stats().dir_unreadable
    os.chmod(d, 0o755)
    os.chown(d, NOBODY, -1)
    local.reload()
    assert "owned by uid 65534" in local.errors()[str(d)]


def test_not_regular_files_are_reported_not_skipped(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "sub.yml").mkdir()
    local = LocalPolicies(tmp_path, IntentStore(None))
    local.reload()
    errors = local.errors()
    assert "a FIFO, not a regular file" in errors[str(tmp_path / "fifo.yaml")]
    assert "a directory, not a regular file" in errors[str(tmp_path / "sub.yml")]


def test_directory_that_cannot_be_listed_keeps_every_intent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE while listing used to read as "no files": every local intent was removed."""
    write(tmp_path / "a.yaml", "id: a\ncommandRegex: x\npriority: 1\n")
    store = IntentStore(None)
    local = LocalPolicies(tmp_path, store)
    local.reload()

    def emfile(path: object) -> list[str]:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(os, "listdir", emfile)
    assert not local.reload()
    assert not local.reload(force=False)
    assert [i.id for i in store.get("local").intents] == ["a"]  # type: ignore[union-attr]
    why = local.errors()[str(tmp_path)]
    assert "cannot list" in why and "Too many open files" in why and "last good content" in why
    assert local.stats().dir_errors == 2
    monkeypatch.undo()
    (tmp_path / "a.yaml").unlink()
    local.reload()
    assert store.get("local").intents == ()  # type: ignore[union-attr]
    assert local.errors() == {}


class _HeldFirstApply(IntentStore):
    """A store whose first apply waits until released: the moment a reload has read the files and is
    handing its set over, which is where a second reload used to overtake it."""

    def __init__(self) -> None:
        super().__init__(None)
        self.entered = threading.Event()
        self.release = threading.Event()
        self._held = False

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        if not self._held:
            self._held = True
            self.entered.set()
            self.release.wait(5)
        return super().apply(*args, **kwargs)


def test_a_slower_older_reload_never_lands_after_a_newer_one(tmp_path: Path) -> None:
    """SIGHUP's reload and the poller's run on different threads: the set a reload read earlier must not
    replace the set a later reload read (the store must end with what the files say now)."""
    store = _HeldFirstApply()
    d = tmp_path / "policies.d"
    d.mkdir()
    write(d / "a.yaml", "id: a\ncommandRegex: x\npriority: 1\n")
    local = LocalPolicies(d, store, poll_interval_s=0)
    older = threading.Thread(target=local.reload)
    older.start()
    assert store.entered.wait(5)  # the older reload read priority 1 and is about to apply it
    write(d / "a.yaml", "id: a\ncommandRegex: x\npriority: 7\n")
    newer = threading.Thread(target=local.reload)
    newer.start()
    newer.join(0.5)  # unserialised, the newer reload is done by now; serialised, it waits for the older
    store.release.set()
    older.join(5)
    newer.join(5)
    (held,) = store.get("local").intents  # type: ignore[union-attr]
    assert held.priority == 7


# -- trust by owner, on descriptors (issue 38, item 3) ---------------------------------------------------


@pytest.mark.parametrize(("target", "words"), [
    ("/proc/self/cmdline", "which is on procfs, a kernel interface, not a file: not read"),
    ("/proc/kmsg", "which is on procfs, a kernel interface, not a file: not read"),
    ("/sys/kernel/mm/transparent_hugepage/enabled", "which is on sysfs"),
    ("/dev/null", "which is a character device: not read"),
])
def test_kernel_interfaces_and_devices_are_never_read(tmp_path: Path, target: str, words: str) -> None:
    """A symlink to /proc/self/cmdline used to stop the agent (a NUL in YAML); one to /proc/kmsg was read,
    consuming the kernel log. Root owns both: owner checks alone did not refuse them."""
    if not Path(target).exists():
        pytest.skip(f"{target} does not exist here")
    (tmp_path / "k.yaml").symlink_to(target)
    with pytest.raises(PolicyFileError, match=words):
        read_file(tmp_path / "k.yaml")


def test_a_symlink_must_be_roots_too(tmp_path: Path) -> None:
    """A link nobody left (while the directory was briefly world-writable) was followed once the directory
    was 0755 again: the link's own owner was not checked. It chooses what is read."""
    good = write(tmp_path / "root.yaml", "id: r\ncommandRegex: x\n")
    d = tmp_path / "policies.d"
    d.mkdir()
    (d / "left.yaml").symlink_to(good)
    os.lchown(d / "left.yaml", NOBODY, -1)
    with pytest.raises(PolicyFileError, match=f"symlink {d / 'left.yaml'} is owned by uid 65534"):
        read_file(d / "left.yaml")


def test_every_directory_on_the_way_is_checked(tmp_path: Path) -> None:
    """A symlink through a directory nobody owns let nobody choose which root-owned file was loaded: the
    resolved path's directories were root's, the hop through nobody's was not looked at."""
    roots = write(tmp_path / "roots.yaml", "id: r\ncommandRegex: ^bash$\npriority: 20\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "inner").mkdir()
    (theirs / "hop.yaml").symlink_to(roots)  # nobody may re-point it at any root-owned file
    os.chown(theirs, NOBODY, -1)
    d = tmp_path / "policies.d"
    d.mkdir()
    (d / "via.yaml").symlink_to(theirs / "hop.yaml")
    (d / "rel.yaml").symlink_to("../theirs/inner/../hop.yaml")
    for name in ("via.yaml", "rel.yaml"):
        with pytest.raises(PolicyFileError, match=f"directory {theirs} .*owned by uid 65534"):
            read_file(d / name)


def test_a_swap_between_the_check_and_the_read_is_never_read(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The check and the read use the same descriptors: a link re-pointed, or a file renamed over the
    checked one, after the check and before the read, is refused or not seen, never read."""
    from gthulhu_node.intents import trust

    d = tmp_path / "policies.d"
    d.mkdir()
    checked = write(tmp_path / "checked.yaml", "id: checked\ncommandRegex: x\n")
    other = write(tmp_path / "other.yaml", "id: other\ncommandRegex: ^bash$\npriority: 20\n")
    os.chown(other, NOBODY, -1)
    (d / "p.yaml").symlink_to(checked)
    real = trust.filesystem_type
    swaps: list[Callable[[], None]] = []

    def swap_then_answer(fd: int) -> int:
        for swap in swaps:
            swap()
        return real(fd)

    monkeypatch.setattr(trust, "filesystem_type", swap_then_answer)

    def repoint() -> None:  # the link now names nobody's file
        (d / "p.yaml").unlink()
        (d / "p.yaml").symlink_to(other)

    swaps[:] = [repoint]
    assert [i.id for i in read_file(d / "p.yaml").intents] == ["checked"]  # the checked one, not other
    (d / "p.yaml").unlink()
    (d / "p.yaml").symlink_to(checked)

    def rename_over() -> None:  # another file takes the checked one's name
        os.rename(other, checked)

    swaps[:] = [rename_over]
    with pytest.raises(PolicyFileError, match="replaced while it was being checked: not read"):
        read_file(d / "p.yaml")


def test_the_policy_directory_is_walked_like_its_files(tmp_path: Path) -> None:
    """The directory was checked by its resolved path: a policies.d symlink nobody owned (left while its
    parent was briefly writable) chose which root-owned directory was listed, since the link's owner and
    the hops on the way were not looked at. Now it is walked on descriptors like every file."""
    real = tmp_path / "real"
    real.mkdir()
    write(real / "a.yaml", "id: a\ncommandRegex: x\n")
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "hop").symlink_to(real)
    os.chown(theirs, NOBODY, -1)
    left = tmp_path / "left.d"
    left.symlink_to(real)
    os.lchown(left, NOBODY, -1)
    via = tmp_path / "via.d"
    via.symlink_to(theirs / "hop")
    for directory, words in ((left, f"symlink {left} is owned by uid 65534"),
                             (via, f"directory {theirs} .*owned by uid 65534")):
        with pytest.raises(PolicyDirError, match=words):
            policy_files(directory)
    os.lchown(left, 0, -1)
    assert policy_files(left) == [left / "a.yaml"]  # a root-owned link is followed
    assert policy_files(tmp_path / "missing.d") == []
