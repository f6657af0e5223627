"""Reaction latency in the lab VM with the real scheduler: the entry is seen in the BPF map (read from the
kernel by another process) after a prctl or a thread start; the floor is measured in the same run.

Run: `.venv/bin/python -m pytest -m bench -s -p no:cacheprovider tests/bench/test_watching_vm_bench.py`.
Everything runs at nice 0 in the guest (the scheduler itself protects the agent). Goal: p99 <= 3x floor.
"""

from __future__ import annotations

import json

import pytest

from tests.vm.lab import Lab

pytestmark = [pytest.mark.bench, pytest.mark.vm]


def test_reaction_latency_in_the_lab_vm(lab: Lab) -> None:
    r = lab.python(
        "-m",
        "tests.bench.watchbench",
        "latency",
        "--backend=sched_ext",
        "--prio=--nice=0",
        "--count=1000",
        "--interval-ms=8",
        # emulated CPUs: a map walk from Python costs ~1 ms, so the reader polls every 1 ms (a tighter
        # loop takes a vCPU from the agent); spawned threads live 0.5 s, so a slow reaction is measured
        # instead of lost
        "--poll-us=1000",
        "--life-ms=500",
        timeout=3000,
    )
    print("\n" + r.stdout + r.stderr)
    r.check("latency run in the guest failed")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    agent = result["agent"]
    assert agent["events_lost"] == 0 and agent["write_failures"] == 0
    # Every spawned thread (0.5 s of life) must have been written, alive (a TaskGoneError would mean late).
    assert agent["tasks_vanished"] == 0 and agent["tasks_gone"] == 0
    # The reader itself is starved at times under emulation and can miss an entry that came and went
    # between two of its polls; a rename whose way in and way out reach the agent in one wakeup is
    # (correctly) never written. Both show as "missed" here: reported, bounded, not a failure.
    print(f"  not seen by the reader: {result['missed']}")
    assert sum(result["missed"].values()) <= 20
    for kind in ("rename", "spawn"):
        print(f"  {kind}: agent p99 / floor p99 = {result['ratios'][kind]:.1f}x (goal <= 3x)")
