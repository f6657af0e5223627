"""Real kernel, real proc events, dry run forced: the table follows a vLLM-like process step by step.

The periodic rescan is set to an hour, so everything seen here arrived through proc connector events.
Nothing on this machine is rescheduled: the backend is the dry run.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gthulhu_node.backends.base import Entry, EntryKey, KeyKind
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.engine import Engine
from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.tasks.procfs import read_task

pytestmark = pytest.mark.host

WORKLOAD = Path(__file__).with_name("vllm_threads.py")
DEADLINE_S = 30.0
VLLM = "^EngineCore(_DP[0-9]+)?$"


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {DEADLINE_S}s: {what}")
        time.sleep(0.005)


class Workload:
    def __init__(self) -> None:
        self.p = subprocess.Popen(
            [sys.executable, str(WORKLOAD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.pid = self.p.pid

    def cmd(self, line: str) -> str:
        assert self.p.stdin is not None and self.p.stdout is not None
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()
        return self.p.stdout.readline().strip()

    def spawn(self, name: str) -> int:
        return int(self.cmd(f"spawn {name}").split()[2])

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()


@pytest.fixture
def workload() -> Iterator[Workload]:
    w = Workload()
    yield w
    w.close()


def start_engine(intent: dict[str, object]) -> tuple[Engine, DryRunBackend]:
    backend = DryRunBackend()
    backend.start()
    policy = PolicySet.build([(f"local/{intent['id']}", Intent.model_validate(intent))])
    engine = Engine(Reconciler(backend, policy=policy), rescan_interval_s=3600)
    engine.start()
    return engine, backend


def start_time(pid: int, tid: int) -> int:
    task = read_task(pid, tid)
    assert task is not None
    return task.start_time


def test_thread_table_follows_create_rename_end(workload: Workload) -> None:
    engine, backend = start_engine(
        {"id": "vllm", "commandRegex": VLLM, "priority": 10, "executionTime": 2_000_000}
    )
    try:

        def ours() -> dict[EntryKey, Entry]:
            return {k: v for k, v in backend.table.items() if k.kind is KeyKind.TID and k.id in tids.values()}

        tids: dict[str, int] = {}
        # created after the agent started, named like vLLM's engine threads
        tids["dp0"] = workload.spawn("EngineCore_DP0")
        tids["dp1"] = workload.spawn("EngineCore_DP1")
        tids["tok"] = workload.spawn("tokenizer")
        expected = {
            EntryKey(KeyKind.TID, tids[n]): Entry(10, 2_000_000, start_time(workload.pid, tids[n]))
            for n in ("dp0", "dp1")
        }
        wait_for("both engine threads written", lambda: ours() == expected)
        assert EntryKey(KeyKind.TGID, workload.pid) not in backend.table

        # one renamed away: its entry goes, the other stays
        assert workload.cmd("rename EngineCore_DP1 idle") == "ok"
        del expected[EntryKey(KeyKind.TID, tids["dp1"])]
        wait_for("renamed thread removed", lambda: ours() == expected)

        # a non-matching thread renamed into the pattern gets one
        assert workload.cmd("rename tokenizer EngineCore_DP2") == "ok"
        expected[EntryKey(KeyKind.TID, tids["tok"])] = Entry(
            10, 2_000_000, start_time(workload.pid, tids["tok"])
        )
        wait_for("renamed-in thread written", lambda: ours() == expected)

        # one ends: its entry goes at once
        assert workload.cmd("end EngineCore_DP0") == "ok"
        del expected[EntryKey(KeyKind.TID, tids["dp0"])]
        wait_for("ended thread removed", lambda: ours() == expected)

        # the process ends: nothing of it is left
        assert workload.cmd("quit") == "bye"
        workload.p.wait()
        wait_for("process gone, no entry left", lambda: ours() == {})
        matches = engine.call(lambda r: [m for m in r.matches() if m.tgid == workload.pid])
        assert matches == []
        events = engine.call(lambda r: r.stats().events)
        assert events["comm"] >= 5 and events["fork"] >= 3 and events["exit"] >= 3
        assert engine.call(lambda r: r.stats().scans) == 1  # only the start scan: events did the rest
    finally:
        engine.close()


def test_process_scope_one_tgid_entry(workload: Workload) -> None:
    engine, backend = start_engine(
        {"id": "vllm-proc", "commandRegex": VLLM, "priority": 7, "scope": "process"}
    )
    try:
        key = EntryKey(KeyKind.TGID, workload.pid)
        time.sleep(0.1)
        assert key not in backend.table
        dp0 = workload.spawn("EngineCore_DP0")
        leader_start = start_time(workload.pid, workload.pid)
        wait_for("TGID entry written", lambda: backend.table.get(key) == Entry(7, 0, leader_start))
        later = workload.spawn("detokenizer")
        wait_for(
            "later thread covered through the TGID entry",
            lambda: any(
                m.tid == later and m.entry == f"tgid:{workload.pid}"
                for m in engine.call(lambda r: r.matches())
            ),
        )
        assert EntryKey(KeyKind.TID, later) not in backend.table
        assert EntryKey(KeyKind.TID, dp0) not in backend.table
        assert workload.cmd("rename EngineCore_DP0 idle") == "ok"
        wait_for("no thread matches any more: TGID entry removed", lambda: key not in backend.table)
    finally:
        engine.close()


def test_lost_events_reopen_the_socket_and_rescan(workload: Workload) -> None:
    """A tiny receive buffer and a busy engine overflow the socket: ENOBUFS, fresh socket, full rescan."""
    from gthulhu_node.tasks.events import ProcEventSource

    backend = DryRunBackend()
    backend.start()
    intent = Intent.model_validate({"id": "vllm", "commandRegex": VLLM, "priority": 10})
    reconciler = Reconciler(backend, policy=PolicySet.build([("local/vllm", intent)]))
    engine = Engine(reconciler, rescan_interval_s=3600, events=ProcEventSource(rcvbuf=4096))
    engine.start()
    try:
        gate = engine.submit(lambda r: time.sleep(1.0))  # the engine is busy while events pile up
        tids = [workload.spawn(f"EngineCore_DP{i}") for i in range(60)]
        gate.result(10)
        wait_for("events lost and recovered", lambda: engine.call(lambda r: r.stats().events_lost) >= 1)
        assert engine.stats().events_reopens >= 1
        want = {EntryKey(KeyKind.TID, t) for t in tids}
        wait_for("every thread written after the rescan", lambda: want <= set(backend.table))
        # the fresh socket still delivers
        late = workload.spawn("EngineCore_DP99")
        wait_for("new socket delivers", lambda: EntryKey(KeyKind.TID, late) in backend.table)
    finally:
        engine.close()
