"""The probe's cost in the lab VM, against a baseline measured in the same run (docs/probe.md).

A context-switch-heavy load (`stress-ng --switch 2`: pairs of processes ping-ponging over pipes) runs three
times: without the probe; with the probe attached but measuring none of its threads (the cost every other
thread of the machine pays: one hash lookup per event); and measuring all of them (the full path). The
probe programs' own run time comes from the kernel (kernel.bpf_stats_enabled: run_time_ns, run_cnt).
"""

from __future__ import annotations

import json

import pytest

from tests.vm.lab import Lab

pytestmark = [pytest.mark.bench, pytest.mark.vm, pytest.mark.timeout(1800)]


def test_probe_overhead(lab: Lab) -> None:
    r = lab.run([lab.venv_python, "tests/vm/guest_probe.py", "overhead", "--seconds", "5"], timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    base = out["without_probe"]["switch_ops_per_s"]
    print(f"\nprobe overhead, lab VM ({out['cpus']} vCPU, TCG), stress-ng --switch 2, "
          f"{out['seconds']:g} s each:")
    for key in ("without_probe", "probe_no_targets", "probe_all_targets"):
        row = out[key]
        ops = row["switch_ops_per_s"]
        print(f"  {key:18} switch ops/s {ops:10.0f} ({ops / base:5.2f}x)"
              f"  ctx switches/s {row['context_switches_per_s']:8d}"
              f"  probe events/s {row['probe_events_per_s']:8d}"
              f"  probe CPU {row['probe_cpu_percent_of_one_cpu']:5.2f}% of a CPU"
              f"  {row['probe_ns_per_event']:7.1f} ns/event")
    print(f"  waits measured with all targets: {out['all_targets_measured_waits']}")
    assert out["probe_all_targets"]["probe_events_per_s"] > 0
    assert out["all_targets_measured_waits"] > 0
