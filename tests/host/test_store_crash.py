"""kill -9 at any moment leaves the intent store with the old or the new set, never a mix.

A writer process makes a fixed, seeded sequence of changes (large and small pushes, deletes, sender
entries; compaction made frequent, so kills land in journal appends and in snapshot writes alike) and
prints each change's number once the store has acknowledged it. The test kills it with SIGKILL at a
random moment, then reads the state directory: it must hold exactly the state after the last
acknowledged change or after the one in flight, compared with the same sequence played in memory.
Run as a writer: `python -m tests.host.test_store_crash DIR` (the test does this).
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import structlog

from gthulhu_node.intents import state_file as state_file_module
from gthulhu_node.intents.model import Intent, SenderEntry
from gthulhu_node.intents.parse import parse_intent
from gthulhu_node.intents.store import IntentStore

pytestmark = pytest.mark.host

REPO = Path(__file__).resolve().parents[2]
ITERATIONS = 50
SEED = 1717
Content = dict[str, tuple[object, ...]]


def _intent(n: int, priority: int) -> Intent:
    return parse_intent({"id": f"i{n}", "commandRegex": f"^worker-{n}$", "priority": priority})


def change(store: IntentStore, rng: random.Random) -> None:
    """One change, chosen from the store's current content (so the sequence replays identically)."""
    source = rng.choice(["big", "big", "small", "manager"])
    current = store.get(source)
    if current is not None and current.intents and rng.random() < 0.25:
        store.delete(source, rng.choice(current.intents).id, allow_reserved=True)
        return
    size = rng.choice([1, 3, 200, 600]) if source == "big" else rng.randint(0, 4)
    ids = rng.sample(range(800), size)
    intents = [_intent(n, rng.randint(0, 20)) for n in ids]
    entries = [SenderEntry(record={"policyID": f"i{n}", "r": rng.randint(0, 9)}, key=f"i{n}",
                           intent_id=f"i{n}") for n in ids] if source == "manager" else []
    store.apply(source, 0, intents, allow_reserved=True, entries=entries)


def content(store: IntentStore) -> Content:
    return {name: (ss.generation, ss.push_digest, ss.intents, ss.entries)
            for name, ss in store.snapshot().items()}


def expected_states(count: int) -> list[Content]:
    """The state after 0, 1, ... count changes."""
    rng = random.Random(SEED)
    store = IntentStore(None)
    states = [content(store)]
    for _ in range(count):
        change(store, rng)
        states.append(content(store))
    return states


def writer(state: Path) -> None:
    # stdout carries the acknowledgements only: the store's log lines go to stderr
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    state_file_module.COMPACT_MIN_BYTES = 16 << 10  # compactions every few changes
    store = IntentStore(state)
    rng = random.Random(SEED)
    print("ready", flush=True)
    n = 0
    while True:
        change(store, rng)
        n += 1
        print(n, flush=True)


def test_sigkill_at_random_moments_leaves_the_old_or_the_new_set(tmp_path: Path) -> None:
    kills = random.Random()
    seen: dict[str, int] = {"old": 0, "new": 0}
    states = expected_states(0)
    for iteration in range(ITERATIONS):
        state = tmp_path / f"state-{iteration}"
        proc = subprocess.Popen([sys.executable, "-m", "tests.host.test_store_crash", str(state)], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(kills.uniform(0.0, 1.0))
        proc.send_signal(signal.SIGKILL)
        acks = [line for line in proc.stdout.read().split() if line.isdigit()]
        proc.wait()
        acknowledged = int(acks[-1]) if acks else 0
        if len(states) < acknowledged + 2:
            states = expected_states(acknowledged + 50)
        store = IntentStore(state)
        store.load()
        got = content(store)
        assert got in (states[acknowledged], states[acknowledged + 1]), (iteration, acknowledged)
        seen["old" if got == states[acknowledged] else "new"] += 1
    print(f"\n{ITERATIONS} kills: {seen['old']} left the last acknowledged set, "
          f"{seen['new']} the one in flight")


if __name__ == "__main__":
    writer(Path(sys.argv[1]))
