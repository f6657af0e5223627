"""Guest side of tests/vm/test_watching_vm.py: the real scheduler's BPF maps follow a vLLM-like process.

Runs as root in the lab VM: loads the gthulhu sched_ext scheduler (SchedExtBackend), runs the Engine with
real proc events, drives tests/host/vllm_threads.py (threads created after start, named EngineCore_DP0/1,
one renamed away, one renamed in, one ended, the process ended), and after every step waits until the maps
read back from the kernel hold exactly the expected entries. Prints one JSON object:
{"steps": [{"step", "ok", "want", "got"}...], "state": sched_ext state while loaded}.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import structlog

from gthulhu_node.backends.base import Entry, EntryKey, KeyKind
from gthulhu_node.engine import Engine
from gthulhu_node.intents.model import Intent
from gthulhu_node.matching import PolicySet
from gthulhu_node.reconciler import Reconciler
from gthulhu_node.scheduler.backend import SchedExtBackend
from gthulhu_node.tasks.procfs import read_task

WORKLOAD = Path(__file__).resolve().parents[1] / "host" / "vllm_threads.py"
DEADLINE_S = 60.0
PATTERN = "^EngineCore(_DP[0-9]+)?$"


def main() -> int:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    backend = SchedExtBackend()
    backend.start()
    steps: list[dict[str, object]] = []
    w = subprocess.Popen(
        [sys.executable, str(WORKLOAD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    engine: Engine | None = None
    try:
        assert w.stdin is not None and w.stdout is not None
        stdin, stdout = w.stdin, w.stdout

        def cmd(line: str) -> str:
            stdin.write(line + "\n")
            stdin.flush()
            return stdout.readline().strip()

        intents = [
            (
                "local/vllm",
                Intent.model_validate(
                    {"id": "vllm", "commandRegex": PATTERN, "priority": 5, "executionTime": 2_000_000}
                ),
            )
        ]
        engine = Engine(Reconciler(backend, policy=PolicySet.build(intents)), rescan_interval_s=3600)
        engine.start()
        pid = w.pid
        tids: dict[str, int] = {}

        def in_kernel() -> dict[EntryKey, Entry]:
            table = engine.call(lambda r: r.backend.read_back()) if engine else {}
            ours = {pid, *tids.values()}
            return {k: v for k, v in table.items() if k.id in ours}

        def step(name: str, want: dict[EntryKey, Entry]) -> None:
            got: dict[EntryKey, Entry] = {}
            end = time.monotonic() + DEADLINE_S
            while time.monotonic() < end:
                got = in_kernel()
                if got == want:
                    break
                time.sleep(0.02)
            steps.append(
                {
                    "step": name,
                    "ok": got == want,
                    "want": {str(k): [v.priority, v.slice_ns, v.start_time] for k, v in want.items()},
                    "got": {str(k): [v.priority, v.slice_ns, v.start_time] for k, v in got.items()},
                }
            )

        def entry(tid: int) -> tuple[EntryKey, Entry]:
            task = read_task(pid, tid)
            assert task is not None
            return EntryKey(KeyKind.TID, tid), Entry(5, 2_000_000, task.start_time)

        step("nothing before the threads exist", {})
        for name in ("EngineCore_DP0", "EngineCore_DP1", "tokenizer"):
            tids[name] = int(cmd(f"spawn {name}").split()[2])
        want = dict(entry(tids[n]) for n in ("EngineCore_DP0", "EngineCore_DP1"))
        step("threads created after start are written", want)
        cmd("rename EngineCore_DP1 idle")
        del want[EntryKey(KeyKind.TID, tids["EngineCore_DP1"])]
        step("a thread renamed away loses its entry", want)
        cmd("rename tokenizer EngineCore_DP2")
        want.update([entry(tids["tokenizer"])])
        step("a thread renamed into the pattern gets one", want)
        cmd("end EngineCore_DP0")
        del want[EntryKey(KeyKind.TID, tids["EngineCore_DP0"])]
        step("an ended thread's entry is gone", want)
        cmd("quit")
        w.wait(30)
        step("the ended process leaves nothing", {})
        state = Path("/sys/kernel/sched_ext/state").read_text().strip()
    finally:
        if w.poll() is None:
            w.kill()
            w.wait()
        if engine is not None:
            engine.close()
        backend.stop()
    print(json.dumps({"steps": steps, "state": state}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
