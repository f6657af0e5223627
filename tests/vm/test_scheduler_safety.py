"""The scheduler's safety guarantees on real kernels (docs/scheduler.md, "Bounded wait and the reserve"):
no task is worse off for being boosted, every task runs within the stated bound, priorities order waits,
and no host event (CPU hotplug, cpusets, more possible than online CPUs) ejects the scheduler.

Guest side: tests/vm/safety_workloads.py. The watchdog is lowered to 2 s in every scenario, so a stall
ejects the scheduler and the health/state assertions fail.
"""

from __future__ import annotations

import json
import statistics
from typing import Any

import pytest

from tests.vm import matrix, scenarios

# Their own guests (one per kernel), so they run in the other lane beside the rest of the scheduler suite.
pytestmark = [pytest.mark.vm, pytest.mark.lab_guest("safety")]
both_kernels = pytest.mark.parametrize("lab", matrix.BOTH_KERNELS, indirect=True)
SCRIPT = "tests/vm/safety_workloads.py"
ENABLED = {"state": "enabled", "ops": "gthulhu"}
LONGEST_WAIT_MS = 1000  # a boosted mix's longest wait, whatever the watchdog
# The strongest level's mean wait over the weakest's, median of five rounds: 0.79, 0.81, 0.79, 0.84 and
# 0.89 in five runs (2026-12-05, 7.3, load average 6: beside another lab guest and a kernel build), single
# rounds 0.61-1.45. The bound says what users rely on, a stronger boost never waits longer, 0.11 above
# the worst median measured; the same runs read the other way round (weakest over strongest) give 1.12-1.27.
PRIORITY_ORDER_MARGIN = 1.0


def scenario(lab: Any, name: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    data = scenarios.run(lab, SCRIPT, name, *args, timeout=timeout)
    print(f"{name}: {json.dumps(data)}")  # the figures docs/scheduler.md quotes (pytest -s shows them)
    return data


def assert_still_ours(out: dict[str, Any]) -> None:
    assert out["health"] == "running" and out["state"] == ENABLED, out


@pytest.mark.lab_seconds(150)  # measured 2026-12-01 (--durations)
@both_kernels
def test_a_low_priority_boost_is_never_worse_than_no_boost(lab: Any) -> None:
    # Before the reserve and the deadline order: the priority-5 thread got 0.15 s of 45 s (0.3 % of a
    # CPU) while an unboosted one got at least a quarter of a CPU.
    out = scenario(lab, "inversion", "--seconds", "3")  # both cases beside the stall sleeper since 5d46fce
    assert_still_ours(out)
    # Then, with the reserve given by `served` against vtime_now alone: 0.12 / 0.15 boosted against
    # 0.21 / 0.22 unboosted (6.12 / 7.3). With only boosted tasks runnable vtime_now stood still, every
    # `served` sat at the same lead past it, and the reserve went by deadline order to a priority-20
    # thread. The reserve's own clock (reserve_now) keeps the least-served task in front.
    assert out["boosted"]["low_share"] >= 0.9 * out["unboosted"]["low_share"], out


@pytest.mark.lab_seconds(60)
def test_a_low_priority_boost_is_not_worse_off_after_a_boosted_only_phase(lab: Any) -> None:
    # The reserve's clock (reserve_now) runs on while only boosted tasks are runnable, the fair pool's
    # (vtime_now) stands still; unboosted tasks that came later then won every reserve turn until their
    # vtime caught up, about as long as the boosted-only phase lasted.
    out = scenario(lab, "after_boosted_phase", "4", "--seconds", "3")
    assert_still_ours(out)
    assert out["boosted"]["low_share"] >= 0.9 * out["unboosted"]["low_share"], out


@pytest.mark.lab_seconds(250)  # measured 2026-12-01 (--durations)
def test_random_mixes_bounded_waits_and_never_worse_off(lab: Any) -> None:
    out = scenario(lab, "mixed", "1,2,3,4", "--seconds", "3", timeout=900)
    assert_still_ours(out)
    worst: list[float] = []  # per seed, the least boosted/unboosted ratio of any of its boosted threads
    for seed, res in out["seeds"].items():
        waits = [w for w in res["max_wait_ms"] if w is not None]
        assert waits, (seed, res)
        # The stated bound (docs/scheduler.md), with the time the emulator did not run the guest added:
        # the bound excludes what no guest scheduler can help, and under TCG on a loaded machine the
        # guest loses the host CPU for tens of ms at a time (the run measures it, see measure_stalls).
        # Before that was measured, the two-lane run of 2026-12-01 had an unboosted spinner wait 877 ms
        # against a bound of 433 ms, so the test asserted only half the watchdog.
        stalled = res["emulator_stalls"]["total_ms"]
        assert max(waits) <= res["bound_ms"] + stalled, (seed, res)
        assert max(waits) < LONGEST_WAIT_MS, (seed, res)
        assert res["compare"], (seed, res)
        worst.append(min(c["boosted"] / max(c["unboosted"], 1e-3) for c in res["compare"]))
    # Each boosted thread, not only the lowest and the highest priority as before (2026-12-02); and no
    # seed's worst thread far off (the median alone would let one seed's thread starve).
    assert statistics.median(worst) >= 0.9, (worst, out)
    assert min(worst) >= 0.5, (worst, out)


def test_stronger_levels_wait_no_longer_within_budget(lab: Any) -> None:
    """The strongest boost level waits no longer than the weakest (as the agent ranks them, not by their
    numbers), within budget beside unboosted hogs. Per round, the ratio of the two levels' mean waits (exact:
    the probe's sum and count); the median of five rounds. It once compared the pooled p99 of levels 20
    and 5 directly: on a loaded 2-core machine all four levels fell within 13.4-16.2 ms and one round read
    15.53 against 15.16 (issue 37), a coin toss. PRIORITY_ORDER_MARGIN is the measured spread."""
    out = scenario(lab, "priorities", "5", "--seconds", "3", timeout=900)
    assert_still_ours(out)
    strongest, weakest = str(out["strongest"]), str(out["weakest"])
    assert min(out["counts"].values()) >= 150, out
    ratios = [r["mean_ms"][strongest] / r["mean_ms"][weakest] for r in out["rounds"]]
    print(f"[priorities] mean wait strongest/weakest per round: {[round(x, 2) for x in ratios]}", flush=True)
    assert statistics.median(ratios) <= PRIORITY_ORDER_MARGIN, (ratios, out)


def _fraction(t: dict[str, int]) -> float:
    return t["took"] / max(t["runs"], 1)


def _head_start_not_at_every_wake_up(out: dict[str, Any]) -> None:
    """The level-10 task does not preempt the hog at every wake-up, as it did before issue 39. A loaded
    host missed it once (329 of 331, 6.12, make test of 2026-12-07; its twin 375 of 401): that task got
    less CPU than its twin (1.34 s of 3 against 1.50) and so was behind the hog at nearly every wake-up,
    where 40 runs of both kernels the same morning read 0.64-0.81 against the twin's 0.63-0.82."""
    assert _fraction(out["head_over_hog"]) < 0.99, out


@pytest.fixture
def scale(lab: Any, request: pytest.FixtureRequest) -> dict[str, Any]:
    """The `scale` scenario, run once per kernel for the two tests that read it, and once more (a
    LabRerun warning) when the level-10 task preempted at every wake-up."""

    def run() -> dict[str, Any]:
        out = scenario(lab, "scale", "5", "--seconds", "3", timeout=300)
        assert_still_ours(out)
        assert out["lost_a"] == 0, out
        return out

    return scenarios.once_per_guest(
        request, "scale",
        lambda: scenarios.once_more_on_failure(run, _head_start_not_at_every_wake_up,
                                               "the head-start task preempting at every wake-up"))


@pytest.mark.lab_seconds(25)  # 22.8 s (7.3) and 23.3 s (6.12) measured 2026-12-05 (--durations)
@both_kernels
def test_priority_scale_from_sched_switch(scale: dict[str, Any]) -> None:
    """Upstream's direction (issue 39), from sched_switch traces in one boot: a waking level 1 preempts a
    running level 5, never the reverse (but for a race, below); every level 1-9 preempts an unboosted
    hog; level 10 waits less per turn than level 20, by more than the rounds' spread. On the scheduler
    before issue 39 (20 the strongest) level 5 preempted level 1 and never the reverse, and levels 10-20
    preempted like any boost."""
    out = scale
    assert_still_ours(out)
    assert out["lost_a"] == 0, out
    assert out["l1_over_l5"]["took"] >= 10, out
    # Never the reverse, but for a race: 0-2 of 492-640 runs in 40 runs of both kernels in two lanes
    # (2026-12-07), 9 of them over 0, with and without the same-group rule alike; not traced to its cause
    # (docs/scheduler.md, "The priority scale's one wrong-way preemption"). Before issue 39 this was the
    # direction that preempted, and the reverse never did.
    assert out["l5_over_l1"]["took"] <= 0.01 * out["l5_over_l1"]["runs"], out
    for level, t in out["over_hog"].items():
        # ran before the hog resumed, and preempted (its own count: a head insert over weaker work)
        assert t["runs"] >= 50 and t["took"] >= 10 and t["preempted"] >= 10, (level, out)
    ratios = [r["wait_ms"]["10"] / r["wait_ms"]["20"] for r in out["rounds"]]
    print(f"[scale] wait(10)/wait(20) per round: {[round(x, 2) for x in ratios]}", flush=True)
    assert len(ratios) >= 5
    # below 1 beyond the spread: the median plus half the range of the rounds stays under 1
    assert statistics.median(ratios) + (max(ratios) - min(ratios)) / 2 < 1.0, (ratios, out)


@both_kernels
def test_head_start_preempts_a_hog_no_more_often_than_its_twin(scale: dict[str, Any]) -> None:
    """A level-10 task (the head-start tier: CPU share, not a place ahead at wake-up) beside a hog preempts
    it no more often than its unboosted twin does. The scheduler before issue 39 preempted at every
    wake-up (1.00 against the twin's 0.80).

    Known limit (docs/scheduler.md, the head-start tier): with the other host core busy, 6.12's level-10
    task preempted the hog at 0.80-0.95 of its wake-ups, its twin at 0.65-0.84 (4 of 9 runs and 2 of 2
    make test runs over the room, by at most 0.24; on a quiet host 0.70 against 0.69). Only that
    comparison, within a ceiling of 0.3 over the twin, reports an expected failure (XFAIL, with the
    figures); every other check here, and the fixture's (not at every wake-up, once more on a miss),
    fails the test."""
    out = scale
    assert_still_ours(out)
    head, twin = out["head_over_hog"], out["twin_over_hog"]
    print(f"[scale] wake-ups that preempted the hog: head {head}, twin {twin}; CPU s (task, hog): head "
          f"{out.get('head_cpu_s')}, twin {out.get('twin_cpu_s')}", flush=True)
    assert head["runs"] >= 50 and twin["runs"] >= 50, out
    # not at every wake-up, as before issue 39: the fixture holds it (_head_start_not_at_every_wake_up)
    # Each task's own count: 0.81 against 0.80 (7.3), 0.71 against 0.71 (6.12) on a quiet host since the
    # lead of two slices (2026-12-06; with one, 0.85/0.80, 0.78/0.72, once 0.88/0.73: docs/scheduler.md).
    # The room, a tenth of its wake-ups, is the noise between two phases of a few seconds
    assert _fraction(head) <= _fraction(twin) + 0.3, out  # beyond the known limit's worst (0.24)
    if _fraction(head) > _fraction(twin) + 0.1:
        pytest.xfail(f"known limit (docs/scheduler.md): the level-10 task preempted the hog at "
                     f"{_fraction(head):.2f} of its wake-ups, its twin at {_fraction(twin):.2f} (room 0.1)")


@both_kernels
def test_cpu_hotplug_under_load_does_not_eject_the_scheduler(lab: Any) -> None:
    # Before ops.cpu_online/cpu_offline: "BPF scheduler gthulhu disabled (unregistered from the main
    # kernel)" at the first offline.
    out = scenario(lab, "hotplug", "--threads", "20", "--seconds", "3", timeout=600)
    assert_still_ours(out)
    assert out["cycles"] == 20 and out["left_enabled"] == [], out
    assert out["dmesg_disabled"] == [], out
    assert out["entries_intact"] and out["entries"] == 3, out
    assert out["counters"]["hotplug_events"] == 40, out
    shares = out["shares_after"]
    assert shares["boosted"] > 1.2 * shares["twin"], out  # measured 1.38-1.74x


@pytest.mark.lab_guest("")  # the shared 8-vCPU guest: a second one would only add a boot
@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_cpu_hotplug_on_8_cpus_over_2_numa_nodes(lab: Any) -> None:
    # Function only on 8 emulated CPUs over the machine's 2 cores: no ejection, entries intact.
    out = scenario(lab, "hotplug", "--threads", "5", "--seconds", "2", timeout=600)
    assert_still_ours(out)
    assert out["cycles"] == 5 and out["left_enabled"] == [] and out["dmesg_disabled"] == [], out
    assert out["entries_intact"] and out["counters"]["hotplug_events"] == 10, out


@pytest.mark.lab_guest("")  # the shared 8-vCPU guest
@pytest.mark.parametrize("lab", matrix.WIDE, indirect=True)
def test_a_task_queued_for_a_cpu_going_offline_runs_on_the_other_node(lab: Any) -> None:
    """A task allowed on one CPU of node 0 and on node 1, queued in node 0's fair queue for that CPU, when
    the CPU goes offline: node 0 has no other CPU for it, and node 1's CPUs neither pull from node 0 (not
    more crowded) nor steal (their own queue never empties). A reviewer's reading was that it would wait
    there until the watchdog ejected the scheduler, the offline write blocked meanwhile. Measured on
    2026-12-05 (24 offlines over three runs, the scheduler as it is): no ejection, each offline 0.19-0.43 s
    (one 1.39 s), the task on node 1 afterwards every time. The kernel moves the task off the CPU going
    down without our dispatch, so no re-homing pass was added; this holds that it stays so."""
    out = scenario(lab, "stranded", "--threads", "8", timeout=600)
    assert out["left_enabled"] == [] and out["dmesg_disabled"] == [], out
    assert_still_ours(out)
    assert out["cycles"] == 8, out
    node1 = set(out["nodes"][1])
    assert all(cpu in node1 for cpu in out["victim_cpus_after"]), out


@both_kernels
def test_a_higher_boost_takes_a_cpu_from_unboosted_work_not_from_a_lesser_boost(lab: Any) -> None:
    """A level-1 thread (20 before issue 39) waking every 5 ms, last run on the CPU a level-5 engine (10
    before) is bound to, beside a hog per CPU. Before 2026-12-05 a boosted waker preempted whatever its
    default pick ran that was less important, a lesser boost included, though another CPU ran only a
    hog: the engine was switched out at 15-48 % of the strong thread's runs on 7.3 (95-211 of ~640 in
    three 5 s runs, 302 of 631 in a fourth), 7.7 % on 6.12 (63 of 822), and waited while the hogs ran
    on. A waker now preempts a boosted task only when no CPU it may use runs just unboosted work: 2-7 of
    ~650 on 7.3, 3-4 of ~833 on 6.12. Then 9-22 of ~630 on 7.3 (2026-12-06), 9-17 of them while the other
    CPU ran a hog: the engine, waking at the tick the level-1 thread was handed to CPU 0 and had not yet
    run, was inserted at the head of CPU 0's local DSQ before it, so the thread waited through the
    engine's burst. A boosted waker now goes to the head of a local DSQ only before weaker work
    (goes_first, docs/scheduler.md): 0 of 661 (7.3), 0 of 850 (6.12)."""

    def run() -> dict[str, Any]:
        out = scenario(lab, "lesser_boost", "--seconds", "5")
        assert_still_ours(out)
        assert out["lost"] == 0, out
        return out

    def bounds(out: dict[str, Any]) -> None:
        assert out["waker_runs"] >= 300, out
        # The rule's own breach: the engine switched out for the waker while another CPU ran something
        # unboosted (every switch traced; the agent's threads count as boosted). 9-17 of ~630 before the
        # fix (7.3), 0-3 after in eight runs over both kernels.
        assert out["while_another_cpu_ran_unboosted"] <= 0.01 * out["waker_runs"], out

    scenarios.once_more_on_failure(run, bounds, "the level-1 waker sparing the level-5 engine")


@both_kernels
def test_a_cpuset_confined_boost_leaves_the_cpus_reserve_to_unboosted_tasks(lab: Any) -> None:
    # Two boosted threads, each under its own 75 %, filled the CPU together: the node-wide guard saw
    # 2 CPUs and never acted, so the unboosted tasks there got only the per-CPU floor's single ticks.
    out = scenario(lab, "cpuset", "--seconds", "4")
    assert_still_ours(out)
    assert out["unboosted_total"] >= 0.25 * 0.9, out
    assert out["boosted_total"] >= 0.5, out


@pytest.mark.lab_guest("")  # its own shape, so its own guest in any case
@pytest.mark.parametrize("lab", matrix.SPARSE, indirect=True)
def test_more_possible_than_online_cpus(lab: Any) -> None:
    # Before: the node-wide guard budgeted 75 % of the *possible* CPUs (64 here), so it never acted with
    # 2 online. Now the guard is per CPU, and the per-CPU array has one entry per possible CPU (no
    # compiled-in cap: it was 512).
    out = scenario(lab, "cpuset", "--seconds", "4")
    assert (out["possible"], out["online"], out["nr_cpus"]) == ("0-63", "0-1", 64), out
    assert_still_ours(out)
    assert out["unboosted_total"] >= 0.25 * 0.9, out
    assert out["boosted_total"] >= 0.5, out


@both_kernels
def test_rt_tasks_waking_often_do_not_eject_the_scheduler(lab: Any, request: pytest.FixtureRequest) -> None:
    # Before: on 7.3, "disabled (reenqueue limit)": ops.cpu_release handed the local DSQ back at every
    # RT wakeup, and a per-CPU kworker that our enqueue put straight back there was re-enqueued 257 times
    # without running.
    # An RT task that never sleeps, on 6.12: the kernel itself ejects any sched_ext scheduler once a
    # per-CPU kthread of that CPU has waited past the watchdog ("kworker/1:2[62] failed to run for
    # 44.568s" with the default 30 s), since 6.12 serves sched_ext tasks neither through RT throttling
    # nor through a deadline server (7.x has ext_server). A task bound to that CPU cannot be helped by
    # any BPF scheduler there, so that phase runs on 7.x only (docs/scheduler.md, "No ops.cpu_release").
    phases = ["ticker"] if request.node.callspec.params["lab"].startswith("6.12/") else ["ticker", "rt_hog"]
    out = scenario(lab, "rt_ticker", ",".join(phases), "--seconds", "4")
    for phase in phases:
        res = out[phase]
        assert_still_ours(res)
        assert res["left_enabled"] == [] and res["dmesg_disabled"] == [], (phase, out)
        assert min(res["shares"]) > 0.01, (phase, out)  # every hog ran beside the RT tasks


@pytest.mark.lab_seconds(500)  # 280 s measured 2026-12-01 before prometheus and the probe came in
@pytest.mark.timeout(1500)
def test_repeated_ejections_end_in_the_eevdf_backend_not_a_reload_loop(lab: Any) -> None:
    # Before the limit the engine reloaded forever (backoff capped at 60 s).
    out = scenario(lab, "ejections", "--threads", "5", timeout=1400)
    assert out["agent_alive"], out
    assert out["state_after"] == {"state": "disabled", "ops": ""}, out
    agent = out["status"]["agent"]
    assert agent["backend"] == "eevdf" and "given up" in agent["backendReason"], out
    assert "3 ejections within 300 s" in agent["backendReason"], out
    assert "gthulhu_node_sched_ext_given_up 1.0" in out["metric_lines"], out
    assert len(out["log_given_up"]) == 1, out
    applied = [i for i in out["status"]["intents"] if i["key"].split("/")[-1] == "ej"]
    assert applied and applied[0]["state"] == "INTENT_STATE_APPLIED", out
    # Debian's prometheus, run in the guest, scraped this agent (sched_ext backend, then eevdf): every
    # selector of the dashboard and the rules has series but those this agent cannot have
    # (SELECTORS_ONLY_ON_THE_HOST: tests/host/test_prometheus.py covers them).
    absent = out["selectors_without_series"]
    assert [s for s in absent if not s.startswith(SELECTORS_ONLY_ON_THE_HOST)] == [], out
    # RepeatedEjections never fired before the scenario waited for prometheus's first scrape: the first
    # ejection came before it, so prometheus saw the counter go 1 -> 3.
    assert out["scraped_before_first_ejection"], out
    assert out["alerts"]["GthulhuNodeSchedulerRepeatedEjections"], out
    # The Ejected alert against this agent: at the first ejection another scheduler held the slot, so the
    # agent stayed ejected (each reload refused, never displacing it) until the alert fired; then it reloaded.
    # Before the intruder, the ejected state lasted only until the reload (0.5 s), often less than one 2 s
    # scrape, and the alert fired in some runs only. Its own `for: 1m` is covered by promtool's unit test.
    held = out["held"]
    assert held["attached"] and held["state"] == {"state": "enabled", "ops": "intruder"}, out
    assert held["ejected_alert"] and held["not_running_alert"] and held["reload_failures"] >= 2, out
    assert held["state_at_release"] == {"state": "enabled", "ops": "intruder"}, out
    assert any("(intruder)" in line for line in out["log_reload_failed"]), out
    assert out["sysrq"][1]["state_before"] == "enabled", out  # the agent took the slot back


# What the ejections scenario's agent does not export: it has no REST listener, no Failed intent and no
# refused gRPC call (the host test has all three), and no BCC probe: with the probe compiling in its agent
# beside the ejections, the scenario ran past 1,400 s under TCG in a two-lane run. The run-queue
# histogram's selector is checked against prometheus and an agent running its own probe in
# tests/vm/test_probe.py (test_the_agents_continuous_probe_feeds_the_dashboards_histogram).
SELECTORS_ONLY_ON_THE_HOST = ("gthulhu_node_rest_", 'gthulhu_node_intents{state="failed"}',
                              "gthulhu_node_api_errors_total",
                              "gthulhu_node_runqueue_wait_latency_seconds_bucket")
