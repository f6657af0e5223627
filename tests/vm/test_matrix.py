"""The kernel matrix and the wide shape: what must hold on every kernel from 6.12 LTS to 7.3, and on a
guest of 8 vCPUs over 2 NUMA nodes (tests/vm/matrix.py).

On both kernels: the agent, run as a user runs it, loads the scheduler, applies the vLLM example, and the
engine threads are in the kernel's own TID map; `backend: auto` falls back to the eevdf backend, loudly,
when the kernel refuses the scheduler, and `backend: sched_ext` fails hard instead. On 8 vCPUs, function
only (4 emulated CPUs per host core make shares and latencies meaningless): no ejection, the watchdog
quiet, affinity and NUMA placement respected.
"""

from __future__ import annotations

import json
import shutil
from typing import Any

import pytest

from tests.vm import libbpf_build, matrix, scenarios
from tests.vm.lab import Lab
from tests.vm.test_scheduler import scenario

pytestmark = pytest.mark.vm



def unloadable(lab: Lab) -> str:
    """The test object with an ops member no kernel has, in the kfunc naming of the guest's kernel (so the
    member, not a kfunc name, is what the kernel refuses: the failure 6.12 showed before the fix)."""
    flavour = "-6.12" if lab.kernel.version.startswith("6.12") else ""
    return f"{lab.repo}/bpf/.output/gthulhu-unloadable{flavour}.bpf.o"

ENGINE_PRIORITY = 5  # systemd/policies.d/vllm.yaml.example


def smoke(lab: Lab, *args: str) -> dict[str, Any]:
    r = lab.run([".venv/bin/python", "tests/vm/guest_smoke.py", "run", *args], timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    data: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return data


@pytest.mark.parametrize("lab", matrix.BOTH_KERNELS, indirect=True)
def test_agent_loads_and_applies_the_vllm_example(lab: Lab) -> None:
    out = smoke(lab)
    assert out["before"]["state"] == "disabled", out
    assert out["loaded"] == {"state": "enabled", "ops": "gthulhu"}, out
    assert out["backend"] == "sched_ext", out
    assert out["apply_rc"] == 0, out
    assert out["intent_state"] == "INTENT_STATE_APPLIED" and out["matched"] == 2, out
    # the kernel's own map, not the agent's memory
    assert set(out["kernel_priorities"].values()) == {ENGINE_PRIORITY}, out
    assert out["stopped_rc"] == 0 and out["after"]["state"] == "disabled", out


@pytest.mark.parametrize("lab", matrix.BOTH_KERNELS, indirect=True)
def test_auto_falls_back_loudly_when_the_kernel_refuses_the_scheduler(lab: Lab) -> None:
    out = smoke(lab, "--bpf-object", unloadable(lab))
    assert out.get("agent_exit") is None, out  # it runs, it does not die
    assert out["backend"] == "eevdf", out
    reason = out["backend_reason"]
    assert "refused the sched_ext scheduler" in reason and "gthulhu_no_such_member" in reason, out
    assert "gthulhu_node_sched_ext_refused 1.0" in out["metrics"], out
    assert out["refused_log"] is not None and out["refused_log"]["libbpf"], out  # libbpf's own words
    assert out["intent_state"] == "INTENT_STATE_APPLIED" and out["matched"] == 2, out
    assert out["loaded"]["state"] == "disabled" and out["after"]["state"] == "disabled", out


@pytest.mark.parametrize("lab", matrix.BOTH_KERNELS, indirect=True)
def test_the_scheduler_loads_with_a_newer_libbpf_too(lab: Lab) -> None:
    """Debian 12's libbpf 1.1.2 is what every other test uses; this one loads with libbpf 1.5 (built from
    the 6.12 source's tools/lib/bpf), which checks struct_ops members and kfuncs its own way."""
    # the guest has a tmpfs on /var/cache: hand the library over through the scratch share
    newer = lab.scratch_host / "libbpf.so"
    shutil.copy(libbpf_build.obtain(), newer)
    env = {"GTHULHU_LIBBPF": str(newer)}
    version = lab.run([".venv/bin/python", "-c", "from gthulhu_node.scheduler import libbpf; import ctypes; "
                       "f = libbpf.lib().libbpf_version_string; f.restype = ctypes.c_char_p; "
                       "print(f().decode())"], env=env).check()
    assert version.stdout.strip().startswith("v1.5"), version.stdout
    r = lab.run([".venv/bin/python", "tests/vm/sched_workloads.py", "lifecycle"], env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["loaded"] == {"state": "enabled", "ops": "gthulhu"}, out
    assert out["counters_after_load"]["fair_dispatches"] > 0, out
    assert out["stopped"] == {"state": "disabled", "ops": ""}, out


def test_forced_sched_ext_fails_hard_when_the_kernel_refuses_it(lab: Lab) -> None:
    out = smoke(lab, "--bpf-object", unloadable(lab), "--backend", "sched_ext")
    assert out["agent_exit"] not in (None, 0), out
    assert "gthulhu_no_such_member" in out["log"], out


@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_wide_guest_has_the_shape_asked_for(lab: Lab) -> None:
    r = lab.run("nproc; ls -d /sys/devices/system/node/node* | wc -l").check()
    assert r.stdout.split() == ["8", "2"]


@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_wide_no_starvation_and_the_watchdog_stays_quiet(lab: Lab) -> None:
    out = scenario(lab, "starvation", "--seconds", "5", timeout=600)
    for case in ("cpu_bound", "sixty_percent"):
        res = out[case]
        assert res["health"] == "running", res
        assert res["state"] == {"state": "enabled", "ops": "gthulhu"}, res
        assert res["victim_share"] > 0, res  # function: the unboosted task ran at all


@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_wide_pinned_tasks_run_only_where_allowed(lab: Lab) -> None:
    out = scenario(lab, "affinity", "--seconds", "3")
    pin = out["pinned_to"]
    assert out["cpus_seen"] == {"waker": [pin], "hog": [pin]}, out
    assert out["health"] == "running", out


@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_wide_tasks_bound_to_a_numa_node_stay_there(lab: Lab) -> None:
    out = scenario(lab, "numa", "--seconds", "3")
    assert len(out["nodes"]) == 2, out
    assert out["cpus_seen"] and set(out["cpus_seen"]) <= set(out["allowed"]), out
    assert all(ns > 0 for ns in out["ran_ns"].values()), out
    assert out["boosted_dispatches"] > 0, out
    assert out["health"] == "running" and out["state"] == {"state": "enabled", "ops": "gthulhu"}, out


@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_wide_nodes_share_the_hogs_evenly(lab: Lab) -> None:
    """Per-node fair queues: twelve hogs queued on one node's four CPUs and six on the other's even out
    (nine and nine: every hog near the same share), and the pull path is what runs (no queue ever empties,
    so nothing is stolen). Without any balancing the first node's hogs would get half of what the second's
    do (crowded over rest and min/max 0.5). Under TCG the reserve's turns, which serve the least-served head
    of every node's queue, came often enough to even the nodes out too (our reading: single-threaded TCG
    runs one vCPU at a time, so 25 ms of guest time pass for a vCPU while the other seven run): with the
    pull compiled out the shares came out at 0.85-0.87 of each other (over three seconds, 51afaa7), so
    here the pull count checks the mechanism and the shares only the outcome: no bound on them tells the
    pull from the reserve. Relative shares only: the eight vCPUs share this machine's cores.

    Eight seconds, not three: over three seconds the hogs' shares follow the order they were forked in,
    under the kernel's EEVDF as much as under this scheduler (2026-12-06, `min_over_max` over three
    seconds: EEVDF 0.35-0.72, ours 0.61-0.85, twice below 0.7 in one make test; over eight: EEVDF
    0.74-0.80 in three runs, ours 0.83-0.94 in nine, crowded over rest 0.98-1.03; docs/lab.md)."""

    def run() -> dict[str, Any]:
        out = scenario(lab, "node-balance", "--seconds", "8", timeout=600)
        assert out["health"] == "running" and out["state"] == {"state": "enabled", "ops": "gthulhu"}, out
        return out

    def bounds(out: dict[str, Any]) -> None:
        # measured 63-98 pulls, 0 steals over eight seconds
        assert out["domain_pulls"] > 0 and out["domain_steals"] <= 2, out
        assert 0.85 <= out["crowded_over_rest"] <= 1 / 0.85, out  # measured 0.98-1.03
        assert out["min_over_max"] >= 0.7, out  # measured 0.83-0.94

    scenarios.once_more_on_failure(run, bounds, "the wide nodes' hog shares")


@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_wide_cgroup_scenarios_keep_the_scheduler(lab: Lab) -> None:
    for name in ("group-share", "cpu-max"):
        out = scenario(lab, name, "--seconds", "2", timeout=600)
        assert out["health"] == "running", (name, out)
