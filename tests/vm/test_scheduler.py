"""The gthulhu scheduler on the real sched_ext kernels of the lab VM (one boot per kernel for every check).

Each test runs one scenario of tests/vm/sched_workloads.py in the guest; the scenario loads the scheduler,
runs real tasks under it and reports what it measured. Shares are compared with a twin in the same run,
never with an absolute time.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

import pytest

from tests.vm import matrix, scenarios
from tests.vm.shares import STALLED_WINDOW, close, leaves_off_eevdf

pytestmark = pytest.mark.vm
# Every check on both kernels of the matrix (6.12 LTS and 7.3), each in one boot of its own.
both_kernels = pytest.mark.parametrize("lab", matrix.BOTH_KERNELS, indirect=True)

SCRIPT = "tests/vm/sched_workloads.py"


def scenario(lab: Any, name: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    return scenarios.run(lab, SCRIPT, name, *args, timeout=timeout)


@both_kernels
def test_load_enabled_with_our_name_and_clean_stop(lab: Any) -> None:
    out = scenario(lab, "lifecycle")
    assert out["before"]["state"] == "disabled"
    assert out["loaded"] == {"state": "enabled", "ops": "gthulhu"}
    assert out["health"] == "running"
    # every task is scheduled by it: unmatched tasks went through the fair path
    assert out["counters_after_load"]["fair_dispatches"] > 0
    assert out["stopped"] == {"state": "disabled", "ops": ""}
    assert out["health_stopped"] == "stopped"


@both_kernels
def test_verifier_work_stays_far_below_its_limit(lab: Any) -> None:
    # Before: dispatch of the 6.17 object needed 494,828 of the verifier's 1,000,000 instructions (loops
    # bounded by counters are walked once per value; docs/scheduler.md, "Verification cost"), 6.7 of the
    # 8 s the load took under TCG. After: 2,183.
    out = scenario(lab, "verifier")
    print("verifier instructions:", json.dumps(out))
    insns = out["insns"]
    assert {"gthulhu_dispatch", "gthulhu_enqueue", "gthulhu_stopping"} <= set(insns), out
    assert all(n is not None and n > 0 for n in insns.values()), out
    assert max(insns.values()) <= 50_000, out


@both_kernels
def test_refuses_to_displace_another_scheduler(lab: Any) -> None:
    out = scenario(lab, "other-scheduler")
    assert out["running"] == {"state": "enabled", "ops": "intruder"}
    assert out["error"] is not None and "another sched_ext scheduler (intruder)" in out["error"]
    assert out["after"] == {"state": "enabled", "ops": "intruder"}
    assert out["final"]["state"] == "disabled"


@both_kernels
def test_sigkilled_agent_next_start_takes_over_without_stale_entries(lab: Any) -> None:
    out = scenario(lab, "crashed-agent")
    assert out["child_said"] == "entries=1"
    # the killed agent left its scheduler running (the attach is not link-based) ...
    assert out["after_kill"] == {"state": "enabled", "ops": "gthulhu"}
    # ... and the next start replaced it: ours again, with none of the old entries
    assert out["after_takeover"] == {"state": "enabled", "ops": "gthulhu"}
    assert out["entries_after_takeover"] == 0
    assert out["live_after_takeover"] == 0
    assert out["upserted_after_takeover"] == 1
    assert out["final"]["state"] == "disabled"


@both_kernels
def test_tid_entry_and_tgid_fallback_get_a_larger_share(lab: Any) -> None:
    out = scenario(lab, "tid-tgid-share", "--seconds", "4")
    assert out["apply"] == {"upserted": 2, "failed": {}}
    assert out["delta"]["tid_hits"] > 0 and out["delta"]["tgid_hits"] > 0
    assert out["delta"]["boosted_dispatches"] > 0
    # the driver plays the agent: its own threads ran boosted (settings.agent_tgid)
    assert out["delta"]["agent_boosts"] > 0
    shares = out["shares"]
    assert shares["by_tid"] > 1.5 * shares["twin"], shares
    assert shares["by_tgid"] > 1.5 * shares["twin"], shares
    assert out["health"] == "running"


@both_kernels
def test_slice_only_entry_changes_run_length_per_turn(lab: Any) -> None:
    out = scenario(lab, "slice-only", "--seconds", "4")
    long_, short, default = (out[k]["ms_per_turn"] for k in ("long", "short", "default"))
    # slices 40 ms / 1 ms / default 5 ms, enforced at the 250 Hz tick (4 ms granularity)
    assert long_ > 3 * default, out
    assert default > short, out
    assert long_ > 5 * short, out
    assert out["health"] == "running"


@both_kernels
def test_no_leak_with_10000_short_lived_matched_threads(lab: Any) -> None:
    out = scenario(lab, "no-leak", "--threads", "10000", timeout=900)
    assert out["writes"] > 0 and out["scans"] > 1
    assert len(out["live_matched"]) == 4
    assert out["held"] == out["live_matched"]
    assert out["live_tid_entries"] == len(out["live_matched"])
    assert out["live_tgid_entries"] == 1
    assert out["after_exit"] == {"live_tid_entries": 0, "live_tgid_entries": 0, "exit_deleted_tgid": 1}


@both_kernels
def test_no_leak_through_the_agents_engine(lab: Any) -> None:
    out = scenario(lab, "no-leak-agent", "--threads", "10000", timeout=900)
    assert len(out["live_matched"]) == 4
    assert out["held"] == out["live_matched"], out["reconciler"]
    assert out["live_tid_entries"] == 4
    assert out["tid_hits"] > 0
    assert out["after_exit"] == 0


@both_kernels
def test_no_starvation_and_the_watchdog_never_fires(lab: Any) -> None:
    out = scenario(lab, "starvation", "--seconds", "10", timeout=600)
    for case in ("cpu_bound", "sixty_percent"):
        res = out[case]
        assert res["health"] == "running", res
        assert res["state"] == {"state": "enabled", "ops": "gthulhu"}, res
        assert res["victim_share"] >= 0.10, res
        assert res["demotions"] + res["throttled_windows"] > 0, res


def test_a_nice_19_kernel_thread_holding_mmap_lock_does_not_stall_a_process(lab: Any) -> None:
    # 7.3 only: the lab's 6.12 kernel is built without transparent huge pages (no khugepaged).
    # Before kernel threads were charged like nice 0 at most, the light task here waited 1.3-9 s at a
    # time (in a page fault, D state, while khugepaged sat in the queue holding its mmap_lock).
    out = scenario(lab, "kthread-lock-holder", "--seconds", "15", timeout=300)
    assert out["health"] == "running" and out["state"] == {"state": "enabled", "ops": "gthulhu"}, out
    # 10 ms sleeps beside 8 hogs: woken within a few 5 ms slices, never a second
    assert out["max_gap_s"] < 0.5, out
    # enough wakeups to mean something: about 1,000 on an idle machine; 146 seen under single-threaded TCG on
    # a loaded machine (both vCPUs on one host thread), where the 10 ms sleeps stretch
    assert out["wakeups"] > 100, out
    assert out["khugepaged_collapses"] > 0, out  # the lock holder was really at work


# 7.3 only, to stay within a minute of lane time: the rule is the same code on 6.12 (`make bench` measures
# it there; docs/benchmarks.md, "What unboosted work pays").
@pytest.mark.lab_seconds(60)
def test_an_unboosted_sleeper_wakes_as_fast_as_under_eevdf(lab: Any) -> None:
    """A periodic SCHED_OTHER sleeper (cyclictest, 5 ms) in a session of its own beside 8 hogs in another,
    five runs under EEVDF and five under ours (no policy), in one boot (tests/vm/sleeper_bench.py
    --paired). Ours' median may exceed EEVDF's by no more than EEVDF's own spread over its five runs (its
    slowest run over its median): ratios, never an absolute time. Two measures of what the scheduler
    decides: the sleeper's run-queue wait per wake-up (schedstat), and the fraction of its wake-ups that
    waited through a timer tick of their CPU before running (traced), which a wake-up waiting for the
    running task's slice to end does and one that preempts does not, counted in ticks so the emulator's
    stalls do not blur it. cyclictest's own average is printed, not asserted: in this single-threaded
    guest it also holds when the emulator delivers the timer interrupt (docs/benchmarks.md)."""
    r = lab.python("tests/vm/sleeper_bench.py", "--paired", "--rounds", "5", "--seconds", "1", timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
    eevdf, ours = out["runs"]["EEVDF"], out["runs"]["ours no policy"]
    print("unboosted sleeper, EEVDF / ours:", json.dumps(out))
    assert len(eevdf) == len(ours) == 5, out
    assert all(run["health_ok"] == 1.0 for run in ours), out
    # enough wake-ups to mean something: 200 per 1 s at 5 ms; 24-168 per 2 s seen in a guest on a host at
    # load 11 (2026-12-05), which measures the emulator, not a scheduler
    assert min(run["wakeups_traced"] for run in eevdf + ours) >= 50, f"the guest ran too slowly: {out}"
    # the least each measure counts as, so that a median of 0 does not make any ratio infinite
    floors = {"runq_wait_us": 1.0, "waited_a_tick": 0.01}
    for key, floor in floors.items():
        base = [max(run[key], floor) for run in eevdf]
        spread = max(base) / statistics.median(base)
        ratio = max(statistics.median(run[key] for run in ours), floor) / statistics.median(base)
        assert ratio <= spread, f"{key}: ours {ratio:.2f}x EEVDF's median, EEVDF's own spread {spread:.2f}x"


@both_kernels
def test_cpu_is_shared_between_task_groups_first_as_under_eevdf(lab: Any) -> None:
    """Six hogs in one group and one hog alone in another, on 2 CPUs: shared per task, the lone hog would
    get 2/7 of a CPU; shared per group first (EEVDF with cgroups or autogroup, and ours), much more.
    The same boot measures EEVDF, so a setup that made no groups would fail here, not pass quietly."""
    out = scenario(lab, "group-share", "--seconds", "3", timeout=600)
    assert out["health"] == "running", out
    for grouping in ("cgroups", "sessions"):
        eevdf, ours = out[f"eevdf_{grouping}"], out[f"ours_{grouping}"]
        assert eevdf["one"][0] > 2 * statistics.median(eevdf["many"]), out  # the groups are real
        assert ours["one"][0] > 0.45, out  # per-task sharing: about 0.29
        assert ours["one"][0] > 2 * statistics.median(ours["many"]), out
        # the crowded group still runs (1.4 CPUs among six): against EEVDF's in the same boot, since a
        # loaded host shrinks both (6.12, 2026-12-02: ours 0.133, EEVDF's six 0.136-0.142)
        assert min(ours["many"]) > 0.6 * statistics.median(eevdf["many"]), out
    # cpu.weight 300 against 100, two hogs each: per-task sharing would be even
    weights = out["ours_weights"]
    assert statistics.median(weights["heavy"]) > 1.4 * statistics.median(weights["light"]), out


@both_kernels
@pytest.mark.lab_seconds(240)  # 226 s (6.12) and 253 s (7.3) measured 2026-12-02 on a loaded host
@pytest.mark.timeout(900)  # room for the one rerun of its bounds (scenarios.once_more_on_failure)
def test_nested_cgroup_weights_compound_as_under_eevdf(lab: Any) -> None:
    """cpu.weight at every level of a Kubernetes-like tree counts, as under EEVDF (measured in the same
    boot): three services in system.slice share its one weight, pods share their QoS level's. With only the
    task's own group counting, each service would weigh as much as all of kubepods.slice. Then the lightest
    cases: a weight-1 group with more busy threads than the hogs beside it, and sixteen BestEffort pods
    whose compounded weight is below the floor (docs/scheduler.md): each of their threads runs and none
    waits as long as the watchdog (10 s here; it would eject the scheduler), where the weight-1 group was
    charged 800 times each run before the floor."""
    def run() -> dict[str, Any]:
        out = scenario(lab, "hierarchy", "--seconds", "4", timeout=900)
        print(json.dumps(out))
        for name in ("light", "many_be"):
            # The kernel's watchdog is the bound on every wait: an ejection would show here.
            assert out[f"health_{name}"] == "running", out
            assert all(hog["turns"] > 0 and hog["share"] > 0 for hog in out[f"ours_{name}"].values()), out
        assert out["state"]["state"] == "enabled", out
        return out

    def bounds(out: dict[str, Any]) -> None:
        eevdf, ours = out["eevdf_k8s"], out["ours_k8s"]
        # Every leaf near its share by the weights at every level. EEVDF splits a group's weight per CPU by
        # where its tasks sit, so on 2 CPUs it strays from the weights itself, differently from run to run
        # (measured: the Guaranteed pod's hogs 0.13-0.22 of a CPU, 0.19-0.21 by the weights): ours must match
        # EEVDF wherever EEVDF comes near the weights. The guest's capacity varies with the host's load, so
        # EEVDF's shares are scaled to the CPU time the hogs got under ours.
        total = sum(h["share"] for h in ours.values())
        scale = total / sum(h["share"] for h in eevdf.values())
        by_weights = {leaf: fraction * total for leaf, fraction in out["weights_k8s"].items()}
        table = {leaf: (round(ours[leaf]["share"], 3), round(eevdf[leaf]["share"] * scale, 3),
                        round(by_weights[leaf], 3)) for leaf in by_weights}
        print("leaf: (ours, EEVDF scaled, by the weights)", json.dumps(table, indent=1))
        assert all(close(ours[leaf]["share"], by_weights[leaf]) for leaf in by_weights), table
        ours_shares = {leaf: hog["share"] for leaf, hog in ours.items()}
        eevdf_scaled = {leaf: hog["share"] * scale for leaf, hog in eevdf.items()}
        assert not leaves_off_eevdf(ours_shares, eevdf_scaled, by_weights), table

    # pod-b2's second hog at 0.075 of a CPU against 0.061 by the weights (room 0.073), once in make test
    # (2026-12-06, 7.3), every other leaf within 0.003 of its weights
    scenarios.once_more_on_failure(run, bounds, "the nested cgroup weights")


@both_kernels
def test_pinned_tasks_run_only_where_allowed(lab: Any) -> None:
    out = scenario(lab, "affinity", "--seconds", "3")
    pin = out["pinned_to"]
    assert out["cpus_seen"] == {"waker": [pin], "hog": [pin]}
    assert out["boosted_dispatches"] > 0
    assert out["health"] == "running"


@both_kernels
@pytest.mark.parametrize("sleeper", ["unboosted", "boosted"])
def test_a_boosted_task_leaves_the_cpu_of_a_waker_bound_there(lab: Any, sleeper: str) -> None:
    """A boosted engine that wakes a thread pinned to CPU 0 in the middle of each burst, started on CPU 0 and
    free to move: it goes to another CPU, where it preempts a hog, instead of making the thread wait for
    the rest of every burst (docs/scheduler.md, "A boosted waker leaves a bound waker's CPU"); the same
    when the thread is boosted at a weaker level (never worse off for being boosted). Without find_unbound
    the engine stayed on CPU 0, its default pick, at most wake-ups on 7.3."""
    out = scenario(lab, "bound-steer", *([sleeper] if sleeper == "boosted" else []), "--seconds", "2")
    print("bound steer:", json.dumps(out))
    assert out["counters"].get("boosted_dispatches", 0) > 0 and out["engine_wakeups"] > 50, out
    # 7.3 without it: 0.78 (with it 0.06); 6.12 moved the engine off CPU 0 by itself (0.0 both ways), so
    # there the outcome is checked and `bound_steers` printed
    assert out["engine_on_cpu0"] <= 0.5, out
    if out["kernel"].startswith("7."):
        assert out["counters"].get("bound_steers", 0) > 0, out
    assert out["health"] == "running"


@both_kernels
def test_a_group_pinned_to_one_cpu_keeps_its_runs_first_millisecond(lab: Any) -> None:
    """hackbench pinned to one CPU (a container whose cpuset is one CPU): its wakers and runs are all bound
    there, and the first-millisecond protection of a run from its own group's wakers must hold for them
    (docs/scheduler.md, "Not its own group's run in its first millisecond"). When a bound waker skipped it
    whatever the run (8110737), 6.12 on a loaded host took 9.7-12.2 s against EEVDF's 0.88-0.90."""
    out = scenario(lab, "pinned-group", timeout=600)
    print("pinned group:", json.dumps(out))
    ratio = statistics.median(out["ours"]) / statistics.median(out["EEVDF"])
    assert ratio <= 3.0, out
    assert out["health"] == "running"


@both_kernels
def test_a_bound_waker_runs_right_after_the_waker_before_it(lab: Any) -> None:
    """Two processes pinned to CPU 0 woken by one timer interrupt (cyclictest's measuring thread and its
    main thread are woken so every other period) beside hogs: the second is admitted behind the first, not
    sent to the fair queue because the first waits in CPU 0's local DSQ (docs/scheduler.md, "A bound waker
    joins the wakers before it"). Before the change `fair_wakeups_queued`, which counts every unboosted
    waker of the guest, read 410 for 411 boundaries on 7.3 and 411 for 408 on 6.12: the second refused at
    every boundary. In this scenario the fair queue then served it next all the same (cyclictest's thread
    waited behind a hog with an older key, the sleeper bench in docs/benchmarks.md), so the gap between
    the two is a guard that the join costs no wait, not the failing-before check."""
    out = scenario(lab, "joint-wake", "--seconds", "2")
    print("joint wake:", json.dumps(out))
    ours = out["ours"]
    assert out["EEVDF"]["boundaries"] > 100 and ours["boundaries"] > 100, out
    assert ours["fair_wakeups_queued"] <= 0.25 * ours["boundaries"], out
    assert ours["apart"] <= out["EEVDF"]["apart"] + 0.05, out
    assert out["health"] == "running"


# EEVDF's own wait in that scenario moved 94-208 us between four boots of 6.12 and 534-794 on 7.3 (1.5x);
# ours read at most 0.82x of it after the change, 6.6-27x before: one 2 s run each is judged at 1.5x
LONE_BUSY_SPREAD = 1.5


@both_kernels
def test_a_sleeper_beside_a_lone_busy_process_waits_no_longer_than_under_eevdf(lab: Any) -> None:
    """A sleeper pinned to CPU 0 beside hogs sharing one session and one busy process alone in its own
    (scenario `lone-busy`), EEVDF then ours, 2 s each: the sleeper's run-queue wait per wake-up under ours
    within EEVDF's own spread of it in the same boot (a ratio; LONE_BUSY_SPREAD), and the wake-up rule
    refusing at most a quarter of its wake-ups. Before the sleeper was floored against the run it would
    cut (docs/scheduler.md), the rule refused 193 of 201 and 242 of 404 of them and the wait was 6.6x
    (7.3) and 27x (6.12) EEVDF's; after, 0-3 refused and 0.15-0.82x."""
    out = scenario(lab, "lone-busy", "--seconds", "2")
    print("lone busy:", json.dumps(out))
    eevdf, ours = out["EEVDF"], out["ours"]
    assert eevdf["wakeups"] > 100 and ours["wakeups"] > 100, out
    assert ours["fair_wakeups_queued"] <= 0.25 * ours["wakeups"], out
    assert ours["wait_us"] <= LONE_BUSY_SPREAD * max(eevdf["wait_us"], 1.0), out
    assert out["health"] == "running"


# cpu.max checks: (key, the cap in fractions of one CPU); each is held to it within 3 points, as EEVDF is.
CPU_MAX_CHECKS = (("capped", 0.2), ("raised", 0.5), ("lowered", 0.1), ("restored", 0.2), ("child_hogs", 0.3))
CPU_MAX_TOLERANCE = 0.03
# Below the cap ours may fall further: its quota is refilled by a BPF timer, which a loaded host delays,
# stretching the period (6.12 in a two-lane make test: 0.460 for the 50 % cap, within 0.03 in the other
# runs). The cap itself, the side users rely on, keeps the 3-point tolerance.
CPU_MAX_SHORTFALL = 0.06
BW_PERIOD_S = 0.1
CPU_MAX_SECONDS = 2.0


@both_kernels
def test_cpu_max_is_enforced(lab: Any) -> None:
    """One boot, every check under EEVDF and then under ours (docs/scheduler.md, "cpu.max"): a hog capped at
    20 %; the cap raised, lowered and restored while it runs (measured from one period after each write); a
    parent's cap binding two hogs in a child without one; 50 capped cgroups at once; on ours also the capped
    hog boosted to the top priority (the cap wins), and a 1 s period under a 1 s watchdog (no ejection).
    6.12 passes no cpu.max to a BPF scheduler: its object reads it from the cgroup's task_group. On 7.3 the
    6.13 object (6.13-6.16) does the same, checked by loading it there. Before the task_group reader, 6.12
    gave a hog capped at 20 % 0.98 of a CPU under ours."""
    out = scenario(lab, "cpu-max", "--seconds", str(CPU_MAX_SECONDS))
    eevdf, ours = out["eevdf"], out["ours"]
    print("cpu.max (EEVDF, ours):", json.dumps({k: (round(eevdf.get(k, -1), 3), round(v, 3))
                                                for k, v in ours.items() if isinstance(v, float)}))
    assert out["health"] == "running" and out["state"]["state"] == "enabled", out
    assert out["counters"]["cgroups_untracked"] == 0, out
    # made before the load: its limit comes with cgroup_init (6.17: its arguments; before: the task_group)
    assert abs(out["before_load"] - 0.2) <= CPU_MAX_TOLERANCE, out
    six_twelve = lab.kernel.version.startswith("6.12")
    assert ("task_group" if six_twelve else "passed by the kernel") in out["source"], out
    for key, cap in CPU_MAX_CHECKS:
        assert abs(eevdf[key] - cap) <= CPU_MAX_TOLERANCE, (key, eevdf)
    for key, cap in (*CPU_MAX_CHECKS, ("boosted", 0.2)):
        assert cap - CPU_MAX_SHORTFALL <= ours[key] <= cap + CPU_MAX_TOLERANCE, (key, ours)
    assert ours["boost_entries"], ours
    # A quota under one tick (3 ms of each 100 ms), the hog alone. By schedstat EEVDF delivers it and ours
    # reads 0.002-0.026, but for ours schedstat misses run time (docs/scheduler.md, cpu.max: sched_switch
    # timestamps showed 0.029-0.032 held in windows schedstat read 0.015-0.023), so ours is held to EEVDF
    # by work done, each against its own rate without a limit, and boosted against unboosted by the same
    # measure: a boost never costs a limited task its quota.
    print("3 % quota by work (EEVDF, ours, ours boosted):", eevdf["small_by_work"], ours["small_by_work"],
          ours["boosted_small_by_work"])
    assert abs(eevdf["small"] - 0.03) <= 0.01, eevdf
    # The limit holds on both kernels: no more work than the quota allows, boosted or not.
    assert ours["small_by_work"] <= 0.03 + 0.012 and ours["boosted_small_by_work"] <= 0.03 + 0.012, ours
    # The rest is calibrated on 7.3 (seven runs, docs/scheduler.md). On 6.12 in a two-lane make test (the
    # guest at half its quiet speed) schedstat read 0.051 for ours while work done was 0.022, and boosted
    # work 0.013 against unboosted 0.022; quiet, 0.031 and 0.018 against 0.017: there the sub-tick quota
    # measures the host, not the scheduler.
    if not six_twelve:
        assert ours["small"] <= 0.03 + 0.012 and ours["boosted_small"] <= 0.03 + 0.012, ours
        # By work done, seven runs on 2026-12-02 gave ours against EEVDF 0.69-1.16 and boosted against
        # unboosted 0.73-1.12; four on the noisier 2026-12-05 (a make test, three alone) 0.60-1.05 and
        # 0.67-1.87, EEVDF itself 0.018-0.043 under the 0.03 quota. Five more on 2026-12-05 evening (two in
        # clean-clone make tests, three alone on a quiet host): ours against EEVDF 0.28, 1.53, 1.17, 0.50,
        # 0.68, boosted against unboosted 0.49 (make test), 0.77, 0.78, 1.62, EEVDF itself 0.017-0.036: a
        # threshold of half failed two make tests and one quiet run of five. The measure swings with the
        # host by more than 2x, so these catch a quota that starves the task (boosted or not: next to
        # nothing done), not a 2x difference.
        assert 0.2 * eevdf["small_by_work"] <= ours["small_by_work"], (eevdf, ours)
        assert 0.2 * ours["small_by_work"] <= ours["boosted_small_by_work"], ours
    # 50 cgroups at 3 % each: none over its cap, all of them run, and together no more than the caps allow.
    # Not compared with EEVDF's total: under TCG it gives them less than their caps (1.01-1.38 of 1.5
    # CPUs). Before the per-CPU stop timer (runs ended only at ticks) a quiet machine gave ours 1.64-1.67
    # and up to 0.043 for one cgroup; with it 1.42 and 0.033. The time the emulator stopped a vCPU is run
    # time of the hog it ran, which no limit can hold back (measured by a SCHED_FIFO sleeper per CPU): a
    # two-lane make test once read 0.085 for one cgroup (2026-12-06, 6.12), alone 0.030-0.031 in four runs.
    # One cgroup's hog sits on one CPU, so it gains at most one CPU's stalls; the total gains them all. The
    # scenario measures again while stalls took a tenth of the window, so they can never excuse caps
    # ignored altogether (2 CPUs of hogs against the 1.575 allowed).
    stalls = ours["many_stalls_ms"]
    print("50 cgroups: the most one got, stalls per CPU (ms):", ours["many_max"], stalls)
    assert sum(stalls) / 1e3 < STALLED_WINDOW * CPU_MAX_SECONDS, ("three windows the host stalled", stalls)
    stolen = sum(stalls) / 1e3 / CPU_MAX_SECONDS
    assert ours["many_max"] <= 0.03 + CPU_MAX_TOLERANCE + max(stalls) / 1e3 / CPU_MAX_SECONDS, ours
    assert ours["many_min"] > 0, ours
    # A window of W seconds holds at most ceil(W / period) + 1 periods' quota of each cgroup (it can open
    # just before one refill and close just after another): 50 x 3 ms x 21 over 2 s, 1.575 CPUs. Measured
    # 1.42 on a quiet machine and 1.539 once in a two-lane make test; 1.64-1.67 before the stop timer.
    periods = math.ceil(CPU_MAX_SECONDS / BW_PERIOD_S) + 1
    assert ours["many_total"] <= 50 * 0.003 * periods / CPU_MAX_SECONDS + stolen, ours
    assert out["counters"]["bw_parked"] > 0 and out["counters"]["bw_released"] > 0, out["counters"]
    # the stop timer ended runs (its first version was cancelled in stopping, which on kernels before the
    # 7.x timer rework also dropped its callback: every start after the first failed)
    assert out["counters"]["bw_stops"] > 0, out["counters"]
    # A 1 s period and 1 % quota under a 1 s watchdog: no ejection, and at most four ticks (4 ms at 250 Hz)
    # per second beyond the quota (docs/scheduler.md: no task is parked over 250 ms).
    print("1 s period, 1 % quota (EEVDF, ours):", eevdf["long_period"], out["ours_long_period"])
    print("counters:", {k: v for k, v in out["counters"].items() if k.startswith("bw_")})
    print("counters under a 3 % quota, unboosted and boosted:", ours["small_counters"],
          ours["boosted_small_counters"])
    assert out["health_long_period"] == "running", out
    assert out["ours_long_period"] <= 0.01 + 0.016 + CPU_MAX_TOLERANCE, out
    if six_twelve:
        return
    reread = out["reread"]
    print("cpu.max read from task_group by the 6.13 object on 7.3:", json.dumps(reread))
    assert reread["health"] == "running" and "task_group" in reread["source"], reread
    assert reread["counters"]["cgroups_untracked"] == 0, reread
    for key, cap in (("capped", 0.2), ("raised", 0.5), ("child_hogs", 0.3), ("before_load", 0.2)):
        assert abs(reread[key] - cap) <= CPU_MAX_TOLERANCE, (key, reread)


@both_kernels
def test_bad_input_refused_and_full_map_reported(lab: Any) -> None:
    out = scenario(lab, "bad-input")
    for name in ("priority", "slice_low", "slice_high"):
        assert out[name].startswith("refused:"), out
    assert out["held_after_bad"] == 0  # the good entry of each refused batch was not written either
    assert out["full"]["upserted"] == 4 and out["full"]["map_full"] == 2
    assert all("map is full (4 entries)" in m for m in out["full"]["messages"])
    assert out["held_after_full"] == 4
    assert out["gone"] == "TaskGoneError"


@both_kernels
def test_ejection_is_noticed_with_the_kernels_reason_and_restart_works(lab: Any) -> None:
    out = scenario(lab, "ejection")
    assert out["dropped"] == ["CAP_SYS_ADMIN"]  # loaded and reloaded without it, as the agent does
    assert out["health"] == "ejected"
    assert "sysrq" in out["reason"]
    assert out["exit_kind"] == 67  # SCX_EXIT_SYSRQ
    assert out["restarted"] == {"state": "enabled", "ops": "gthulhu"}
    assert out["health_restarted"] == "running"
    assert out["final"]["state"] == "disabled"
