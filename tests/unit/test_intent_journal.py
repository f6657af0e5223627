"""The store's journal: a change costs its own size on disk, reading gives back exactly what was
acknowledged (order, entries, generations), a torn or foreign journal is the old set, and release
0.1.0's snapshot is read and then written in the current version."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from gthulhu_node.intents import state_file as state_file_module
from gthulhu_node.intents.journal import JOURNAL_FILE
from gthulhu_node.intents.model import Intent, SenderEntry
from gthulhu_node.intents.parse import parse_intent
from gthulhu_node.intents.source_set import SourceSet
from gthulhu_node.intents.state_file import STATE_FILE, STATE_VERSION
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.intents.store_errors import NewerStateError

RELEASE_0_1_0 = Path(__file__).resolve().parents[1] / "fixtures" / "state" / "intents-0.1.0.json"


def intent(id: str, priority: int = 5, regex: str = "^worker") -> Intent:
    return parse_intent({"id": id, "commandRegex": regex, "priority": priority})


def content(store: IntentStore) -> dict[str, tuple[object, ...]]:
    """What a restart must give back (everything but the time of the change)."""
    return {name: (ss.generation, ss.push_digest, ss.intents, ss.entries)
            for name, ss in store.snapshot().items()}


def reloaded(state: Path) -> IntentStore:
    store = IntentStore(state)
    store.load()
    return store


def written() -> int:
    """Bytes this process has passed to write(2) so far (logging included)."""
    io = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(io["wchar"])


def test_a_one_intent_change_after_a_large_push_costs_its_own_size(tmp_path: Path) -> None:
    """Before the journal every change rewrote every intent: here 2,000 of them (about 300 KB)."""
    store = IntentStore(tmp_path)
    big = [intent(f"m{n}", priority=n % 20) for n in range(2000)]
    store.apply("manager", 0, big, allow_reserved=True)
    snapshot_inode = (tmp_path / STATE_FILE).stat().st_ino
    assert (tmp_path / STATE_FILE).stat().st_size > 200_000
    before = written()
    store.apply("cli", 0, [intent("x")])  # another source
    one_changed = [*big[:5], intent("m5", priority=19), *big[6:]]
    store.apply("manager", 0, one_changed, allow_reserved=True)
    store.delete("manager", "m7", allow_reserved=True)
    assert written() - before < 20_000  # three small records and their log lines
    assert (tmp_path / STATE_FILE).stat().st_ino == snapshot_inode  # the snapshot was not rewritten
    assert content(reloaded(tmp_path)) == content(store)


def test_random_changes_read_back_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replaced, dropped, reordered and added intents and entries (repeated keys too), across
    compactions: every reload equals what the store held."""
    monkeypatch.setattr(state_file_module, "COMPACT_MIN_BYTES", 4096)
    rng = random.Random(17)
    store = IntentStore(tmp_path)
    for step in range(120):
        source = rng.choice(["a", "b", "manager"])
        current = store.get(source)
        if current is not None and current.intents and rng.random() < 0.2:
            store.delete(source, rng.choice(current.intents).id, allow_reserved=True)
        else:
            ids = rng.sample(range(40), rng.randint(0, 12))
            intents = [intent(f"i{n}", priority=rng.randint(0, 20)) for n in ids]
            entries = [SenderEntry(record={"policyID": f"i{n}", "step": step},
                                   key=rng.choice([f"i{n}", "dup"]), intent_id=f"i{n}")
                       for n in ids] if source == "manager" else []
            store.apply(source, 0, intents, allow_reserved=True, entries=entries)
        if step % 10 == 9:
            assert content(reloaded(tmp_path)) == content(store), step
    assert (tmp_path / JOURNAL_FILE).stat().st_size < 4096 + 2000  # compacted along the way


def test_a_torn_last_record_is_the_old_set_and_is_cut_off(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    store.apply("a", 0, [intent("x")])
    store.apply("a", 0, [intent("x"), intent("y")])
    acknowledged = content(store)
    journal = tmp_path / JOURNAL_FILE
    whole = journal.read_bytes()
    store.apply("a", 0, [intent("z")])
    torn = journal.read_bytes()
    assert torn.startswith(whole)
    for end in range(len(whole), len(torn)):  # any prefix of the record being written
        journal.write_bytes(torn[:end])
        assert content(reloaded(tmp_path)) == acknowledged, end
    for cut in (whole + torn[len(whole):-1], whole + torn[len(whole):-5], whole + b"0000000 {}\n"):
        journal.write_bytes(cut)
        again = reloaded(tmp_path)
        assert content(again) == acknowledged
        again.apply("b", 0, [intent("w")])  # an append after the tail: the tail goes, the record counts
        assert set(content(reloaded(tmp_path))) == {"a", "b"}
        assert content(reloaded(tmp_path))["a"] == acknowledged["a"]


def test_a_journal_left_by_a_compaction_cut_short_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed after the new snapshot's rename but before the old journal's removal: the snapshot has
    every change, and replaying the old journal on it would apply changes twice."""
    store = IntentStore(tmp_path)
    store.apply("a", 0, [intent("x")])
    store.apply("a", 0, [intent("x"), intent("y")])
    old_journal = (tmp_path / JOURNAL_FILE).read_bytes()
    store.apply("a", 0, [intent("y"), intent("x"), intent("z", priority=1)])
    monkeypatch.setattr(state_file_module, "COMPACT_MIN_BYTES", 0)
    store.apply("b", 0, [intent("q") for _ in range(1)])  # outgrows the snapshot: a compaction
    assert not (tmp_path / JOURNAL_FILE).exists()
    (tmp_path / JOURNAL_FILE).write_bytes(old_journal)
    assert content(reloaded(tmp_path)) == content(store)


def test_release_0_1_0_state_is_read_then_written_in_the_current_version(tmp_path: Path) -> None:
    shutil.copy(RELEASE_0_1_0, tmp_path / STATE_FILE)
    store = reloaded(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [STATE_FILE]  # reading rewrites nothing
    loaded = content(store)
    store.apply("cli", 0, [intent("new")])
    doc = json.loads((tmp_path / STATE_FILE).read_text())
    assert doc["version"] == STATE_VERSION == 3
    again = content(reloaded(tmp_path))
    assert again == content(store)
    assert {k: v for k, v in again.items() if k != "cli"} == {k: v for k, v in loaded.items() if k != "cli"}


def test_a_journal_of_a_newer_version_is_refused_and_left_in_place(tmp_path: Path) -> None:
    store = IntentStore(tmp_path)
    store.apply("a", 0, [intent("x")])
    store.apply("a", 0, [intent("y")])
    journal = tmp_path / JOURNAL_FILE
    header, rest = journal.read_bytes().split(b"\n", 1)
    body = json.loads(header.split(b" ", 1)[1])
    body["version"] = 99
    line = state_file_module.encode_line(body)
    journal.write_bytes(line + rest)
    with pytest.raises(NewerStateError, match="journal version 99"):
        IntentStore(tmp_path).load()
    assert journal.read_bytes() == line + rest


def test_a_damaged_record_mid_journal_ends_the_replay_there(tmp_path: Path) -> None:
    """Not a crash (those only tear the end), but the same answer: a consistent earlier set."""
    store = IntentStore(tmp_path)
    store.apply("a", 0, [intent("x")])
    states: list[dict[str, SourceSet]] = []
    for n in range(3):
        store.apply("a", 0, [intent("x", priority=n)])
        states.append(store.snapshot())
    journal = tmp_path / JOURNAL_FILE
    lines = journal.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"priority":1', b'"priority":7')
    journal.write_bytes(b"\n".join(lines))
    assert reloaded(tmp_path).get("a").intents == states[0]["a"].intents  # type: ignore[union-attr]

