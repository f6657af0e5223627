"""The intent store: generation semantics, per-source replacement, validation words, persistence."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gthulhu_node.intents import state_file as state_file_module
from gthulhu_node.intents.journal import JOURNAL_FILE
from gthulhu_node.intents.model import Intent, SenderEntry
from gthulhu_node.intents.parse import IntentValidationError, parse_intent
from gthulhu_node.intents.state_file import STATE_FILE
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.intents.store_errors import (
    IntentNotFoundError,
    LimitError,
    StaleGenerationError,
    UnencodableError,
)


def intent(id: str, regex: str = "^worker", priority: int = 5, **kw: object) -> Intent:
    return parse_intent({"id": id, "commandRegex": regex, "priority": priority, **kw})


def ids(store: IntentStore, source: str) -> list[str]:
    ss = store.get(source)
    return [i.id for i in ss.intents] if ss else []


def test_apply_replaces_only_that_source(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    store.apply("a", 1, [intent("x"), intent("y")])
    store.apply("b", 1, [intent("z")])
    store.apply("a", 2, [intent("w")])
    assert ids(store, "a") == ["w"]
    assert ids(store, "b") == ["z"]


def test_stale_generation_refused_and_changes_nothing(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    store.apply("a", 5, [intent("x")])
    with pytest.raises(StaleGenerationError, match="stale"):
        store.apply("a", 4, [intent("other")])
    assert ids(store, "a") == ["x"]
    assert store.get("a").generation == 5  # type: ignore[union-attr]


def test_same_generation_same_content_is_noop_other_content_refused(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    first = store.apply("a", 3, [intent("x"), intent("y")])
    assert first.changed
    again = store.apply("a", 3, [intent("y"), intent("x")])  # order does not matter
    assert not again.changed and again.generation == 3
    with pytest.raises(StaleGenerationError, match="other content"):
        store.apply("a", 3, [intent("x")])
    assert ids(store, "a") == ["x", "y"]


def test_generation_zero_means_next(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    assert store.apply("a", 0, [intent("x")]).generation == 1
    assert not store.apply("a", 0, [intent("x")]).changed
    assert store.apply("a", 0, [intent("y")]).generation == 2
    assert store.apply("a", 10, [intent("y")]).generation == 10


def test_delete_keeps_generation_and_retry_does_not_resurrect(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    store.apply("a", 7, [intent("x"), intent("y")])
    store.delete("a", "x")
    assert ids(store, "a") == ["y"]
    assert not store.apply("a", 7, [intent("x"), intent("y")]).changed  # a retry of the accepted push
    assert ids(store, "a") == ["y"]
    with pytest.raises(IntentNotFoundError):
        store.delete("a", "x")


def test_reserved_sources_need_permission(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    for reserved in ("local", "manager"):
        with pytest.raises(IntentValidationError, match="reserved") as exc:
            store.apply(reserved, 0, [intent("x")])
        assert exc.value.field == "source"
    store.apply("manager", 0, [intent("x")], allow_reserved=True)
    assert ids(store, "manager") == ["x"]


def test_duplicate_ids_named(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    with pytest.raises(IntentValidationError) as exc:
        store.apply("a", 0, [intent("x"), intent("y"), intent("x")])
    assert exc.value.field == "intents[2].id"
    assert "'x'" in str(exc.value)
    assert store.get("a") is None


def test_limits(tmp_path: Path) -> None:
    store = IntentStore(tmp_path, max_intents_per_source=2, max_sources=2)
    with pytest.raises(IntentValidationError, match="at most 2"):
        store.apply("a", 0, [intent("x"), intent("y"), intent("z")])
    store.apply("a", 0, [intent("x")])
    store.apply("b", 0, [intent("x")])
    with pytest.raises(LimitError):
        store.apply("c", 0, [intent("x")])
    store.apply("local", 0, [intent("x")], allow_reserved=True)  # the agent's own sources still fit
    store.apply("manager", 0, [intent("x")], allow_reserved=True)


@pytest.mark.parametrize(
    ("doc", "field", "words"),
    [
        ({"id": "a", "commandRegex": "x", "priority": 21}, "priority", "outside 0-20"),
        ({"id": "a", "commandRegex": "x", "priority": -1}, "priority", "outside 0-20"),
        ({"id": "a", "commandRegex": "x", "executionTime": 10}, "executionTime", "outside"),
        ({"id": "a", "commandRegex": "(", "priority": 1}, "commandRegex", "RE2"),
        ({"id": "a", "commandRegex": "x" * 257}, "commandRegex", "257 bytes"),
        ({"id": "a", "commandRegex": "a{1000}{1000}"}, "commandRegex", "RE2"),
        ({"id": "a b", "commandRegex": "x"}, "id", "[A-Za-z0-9._-]"),
        ({"commandRegex": "x"}, "id", "required"),
        ({"id": "a", "commandRegex": "x", "bogus": 1}, "bogus", "unknown field"),
        ({"id": "a", "commandRegex": "x", "scope": "galaxy"}, "scope", ""),
    ],
)
def test_validation_names_the_field(doc: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(IntentValidationError) as exc:
        parse_intent(doc, "intents[3]")
    assert exc.value.field == f"intents[3].{field}"
    assert words in str(exc.value)


def test_persisted_and_loaded(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    store.apply("a", 4, [intent("x", scope="process", nodeNames=["n1"])])
    store.apply("local", 0, [intent("f")], allow_reserved=True)
    store.delete("a", "x")
    store.apply("b", 9, [intent("y", executionTime=2_000_000)])
    mode = os.stat(tmp_path / STATE_FILE).st_mode & 0o777
    assert mode == 0o600
    again = IntentStore(tmp_path)
    assert again.load() == 1
    assert ids(again, "a") == [] and again.get("a").generation == 4  # type: ignore[union-attr]
    assert again.get("b").intents == store.get("b").intents  # type: ignore[union-attr]
    assert again.get("local") is None  # the files are the local source's persistence
    with pytest.raises(StaleGenerationError):
        again.apply("b", 8, [])
    assert {p.name for p in tmp_path.iterdir()} <= {STATE_FILE, JOURNAL_FILE}  # no temp files left behind


def test_sender_entries_persist_with_their_intents(tmp_path: Path) -> None:
    """A lenient sender's entries (failed ones too) survive a restart with the set they belong to; a
    state file without entries (written before they existed) loads unchanged, same digest."""
    entries = [
        SenderEntry(record={"policyID": "x", "priority": 25}, key="x#0", failed="priority 25 is above 20"),
        SenderEntry(record={"policyID": "y", "executionTime": 10_000}, key="y", intent_id="y",
                    warnings=("clamped",)),
    ]
    store = IntentStore(tmp_path)
    store.apply("manager", 0, [intent("y")], allow_reserved=True, entries=entries)
    store.apply("b", 0, [intent("z")])
    again = IntentStore(tmp_path)
    again.load()
    assert again.get("manager").entries == tuple(entries)  # type: ignore[union-attr]
    reordered = again.apply("manager", 0, [intent("y")], allow_reserved=True, entries=entries[::-1])
    assert reordered.changed is False
    assert again.apply("manager", 0, [intent("y")], allow_reserved=True).changed is True  # entries count
    doc = json.loads((tmp_path / STATE_FILE).read_text())
    # sources without entries are written as before, in the snapshot and in the journal
    assert "entries" not in doc["sources"].get("b", {})
    journal = (tmp_path / JOURNAL_FILE).read_bytes().splitlines()
    records = [json.loads(line.split(b" ", 1)[1]) for line in journal]
    assert all("entries" not in r for r in records if r.get("source") == "b")
    assert again.get("b").push_digest == store.get("b").push_digest  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"\xff\xfe",
        b"[]",
        json.dumps({"format": "gthulhu-node-intents", "version": 1, "sources": {"a": {"generation": 1,
                    "intents": [{"id": "x", "commandRegex": "x", "priority": 99}]}}}).encode(),
        b"[" * 100_000,
        # a float too large for a double: OverflowError, which used to end the start with exit 1 (a loop)
        json.dumps({"format": "gthulhu-node-intents", "version": 1, "sources": {"a": {"generation": 1,
                    "updated": 10**400, "intents": [{"id": "x", "commandRegex": "x"}]}}}).encode(),
    ],
)
def test_corrupt_state_moved_aside_and_start_empty(tmp_path: Path, content: bytes) -> None:
    (tmp_path / STATE_FILE).write_bytes(content)
    store = IntentStore(tmp_path)
    assert store.load() == 0
    assert store.snapshot() == {}
    assert store.stats().corrupt_state_files == 1
    aside = [p for p in tmp_path.iterdir() if p.name.startswith(STATE_FILE + ".corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == content
    store.apply("a", 0, [intent("x")])  # and it works afterwards
    assert IntentStore(tmp_path).load() == 1


@pytest.mark.parametrize("with_state", [True, False])
def test_temp_files_left_by_a_killed_agent_are_removed_on_load(tmp_path: Path, with_state: bool) -> None:
    """SIGKILL between writing the temp file and renaming it leaves `.intents.json.tmp-<pid>-<thread>`;
    its content was never acknowledged, and without cleanup every such crash would leave one more."""
    if with_state:
        IntentStore(tmp_path).apply("a", 1, [intent("x")])
    stray = tmp_path / f".{STATE_FILE}.tmp-999999-1"
    stray.write_bytes(b'{"half": ')
    store = IntentStore(tmp_path)
    assert store.load() == (1 if with_state else 0)
    assert not stray.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ([STATE_FILE] if with_state else [])


def test_persist_failure_changes_nothing(tmp_path: Path) -> None:
    target = tmp_path / "state"
    store = IntentStore(target)
    store.apply("a", 1, [intent("x")])
    target.chmod(0o500)
    try:
        if os.geteuid() == 0:  # root ignores the mode: make the directory a file's name instead
            target.chmod(0o700)
            (target / STATE_FILE).unlink()
            (target / STATE_FILE).mkdir()
            (target / JOURNAL_FILE).mkdir()
        with pytest.raises(OSError):
            store.apply("a", 2, [intent("y")])
        assert ids(store, "a") == ["x"] and store.get("a").generation == 1  # type: ignore[union-attr]
    finally:
        target.chmod(0o700)


@pytest.mark.parametrize("first_write", [True, False], ids=["snapshot", "journal"])
def test_unencodable_set_is_refused_before_it_replaces_the_stored_one(tmp_path: Path,
                                                                       first_write: bool) -> None:
    """Text UTF-8 cannot hold (a lone surrogate) used to be swapped into memory and then fail the write
    with an error the commit did not catch: memory held a set disk did not, and nothing could serve it."""
    store = IntentStore(tmp_path)
    heard: list[str] = []
    if not first_write:
        store.apply("m", 0, [intent("x")], entries=[SenderEntry(record={"policyID": "x"}, key="x",
                                                                  intent_id="x")])
    before = store.snapshot()
    store.subscribe(heard.append)
    bad = SenderEntry(record={"policyID": "y\ud800"}, key="#1", failed="no pattern")
    with pytest.raises(UnencodableError, match=r"sources\.m\.entries\[[01]\]\.record\.policyID"):
        store.apply("m", 0, [intent("x")], entries=[*(before["m"].entries if before else ()), bad])
    with pytest.raises(IntentValidationError, match=r"intents\[0\]\.commandRegex: not valid Unicode"):
        store.apply("m", 0, [Intent.model_construct(id="z", command_regex="\udfff", priority=1)])
    assert store.snapshot() == before and heard == []
    assert store.stats().refused_invalid == 2
    again = IntentStore(tmp_path)
    again.load()
    assert again.snapshot() == before
    store.apply("m", 0, [intent("w")])  # the store still takes a good set
    assert ids(store, "m") == ["w"]


def test_failed_journal_write_is_not_found_by_a_restart(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A record written but not synced (fdatasync fails: EIO) was refused to the caller yet could be
    read back by the next start: the journal is cut back to what was acknowledged."""
    store = IntentStore(tmp_path)
    store.apply("a", 0, [intent("x")])
    store.apply("a", 0, [intent("y")])  # the journal exists now

    def eio(fd: int) -> None:
        raise OSError(5, "Input/output error")
    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(OSError):
        store.apply("a", 0, [intent("z")])
    monkeypatch.undo()
    assert ids(store, "a") == ["y"]
    again = IntentStore(tmp_path)
    again.load()
    assert ids(again, "a") == ["y"]


def test_listeners_hear_changes_not_noops(tmp_path: Path) -> None:
    store = IntentStore(None)
    heard: list[str] = []
    store.subscribe(heard.append)
    store.apply("a", 0, [intent("x")])
    store.apply("a", 0, [intent("x")])
    store.delete("a", "x")
    assert heard == ["a", "a"]


@pytest.mark.parametrize("bad", ["abc\n", "a\nb", "\n"])
def test_ids_and_sources_with_a_trailing_newline_refused(bad: str) -> None:
    # Python's `$` also matches before a final newline; the contract's names must not carry one.
    with pytest.raises(IntentValidationError):
        parse_intent({"id": bad, "commandRegex": "x"})
    store = IntentStore(None)
    with pytest.raises(IntentValidationError, match="source"):
        store.apply(bad.lower(), 0, [])


def test_a_source_at_the_largest_generation_can_still_be_changed(tmp_path: Path) -> None:
    """Issue 38 item 8: a source pushed at 2^64-1 could never be changed again (a push at 0 had no next
    generation; every other one was stale). Now a push at 0 starts its numbering again at 1."""
    store = IntentStore(tmp_path)
    store.apply("a", 2**64 - 1, [intent("x")])
    with pytest.raises(IntentValidationError, match="generation"):
        store.apply("a", 2**64, [intent("y")])
    with pytest.raises(StaleGenerationError):
        store.apply("a", 2**64 - 1, [intent("y")])
    assert ids(store, "a") == ["x"]
    outcome = store.apply("a", 0, [intent("y")])
    assert (outcome.generation, outcome.changed) == (1, True)
    assert store.apply("a", 5, [intent("z")]).generation == 5
    again = IntentStore(tmp_path)
    again.load()
    assert ids(again, "a") == ["z"] and again.get("a").generation == 5  # and so it is saved


def test_state_file_larger_than_the_limit_is_moved_aside_unread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_file_module, "STATE_MAX_BYTES", 1000)
    (tmp_path / STATE_FILE).write_bytes(b" " * 1001)
    store = IntentStore(tmp_path)
    assert store.load() == 0 and store.stats().corrupt_state_files == 1
    assert not (tmp_path / STATE_FILE).exists()


def test_push_that_would_outgrow_the_state_limit_is_refused_and_nothing_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = IntentStore(tmp_path)
    store.apply("a", 0, [intent("x")])
    monkeypatch.setattr(state_file_module, "STATE_MAX_BYTES", 2000)
    with pytest.raises(LimitError, match="bytes of state, at most 2000"):
        store.apply("b", 0, [intent(f"i{n}") for n in range(50)])
    assert set(store.snapshot()) == {"a"}
    assert IntentStore(tmp_path).load() == 1


def test_state_file_that_cannot_be_read_stays_and_the_load_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE (or EIO) says nothing about the file: moving it aside would lose every saved intent."""
    IntentStore(tmp_path).apply("a", 0, [intent("x")])

    def emfile(*args: object, **kw: object) -> object:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr("builtins.open", emfile)
    with pytest.raises(OSError, match="Too many open files"):
        IntentStore(tmp_path).load()
    monkeypatch.undo()
    assert (tmp_path / STATE_FILE).exists() and IntentStore(tmp_path).load() == 1


def test_client_sources_together_are_capped_and_reserved_sources_are_not_counted() -> None:
    """64 sources of 10,000 intents each (~2.5 GB) fitted within the per-source limits."""
    store = IntentStore(None, max_client_intents=5)
    store.apply("a", 0, [intent(f"a{n}") for n in range(3)])
    with pytest.raises(LimitError, match="6 intents in all client sources, at most 5"):
        store.apply("b", 0, [intent(f"b{n}") for n in range(3)])
    store.apply("a", 0, [intent(f"a{n}") for n in range(5)])  # replacing its own set counts only once
    store.apply("local", 0, [intent(f"l{n}") for n in range(5)], allow_reserved=True)
    assert set(store.snapshot()) == {"a", "local"}
