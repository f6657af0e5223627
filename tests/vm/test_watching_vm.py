"""In the lab VM with the real gthulhu scheduler: the BPF maps (read back from the kernel) follow a vLLM-like
process through real proc events, step by step (tests/vm/guest_watching.py does the steps in the guest)."""

from __future__ import annotations

import json

import pytest

from tests.vm.lab import Lab

pytestmark = pytest.mark.vm


def test_bpf_maps_follow_threads_created_renamed_ended(lab: Lab) -> None:
    r = lab.python("tests/vm/guest_watching.py", timeout=600).check("guest_watching.py failed")
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["state"] == "enabled"
    names = [s["step"] for s in result["steps"]]
    assert len(names) == 6, names
    for s in result["steps"]:
        assert s["ok"], f"{s['step']}: kernel maps hold {s['got']}, expected {s['want']}"
    # the scheduler is detached afterwards
    assert lab.run("cat /sys/kernel/sched_ext/state").stdout.strip() == "disabled"
