"""The run-queue probe in the sched_ext lab VM, where BCC compiles against the lab kernel's headers.

One measurement (tests/vm/guest_probe.py run --agent, ~10 s under `stress-ng --cpu 8`) serves three
tests: the real agent runs with the sched_ext backend and local intents (the `probe_boost` twin boosted
at priority 5, its `probe_plain` twin and the spawner's threads unboosted), and the probe's filter follows
the agent's matches (ListMatches over its gRPC socket) as threads appear and exit. Then the CLI runs once
against an ad-hoc regex with no agent and no intent, as people would before writing a policy, beside a
SCHED_FIFO twin (what people do instead of a policy) and an ordinary one. Last, the agent runs its own
continuous probe (`probe.enabled`) and Debian's prometheus reads the dashboard's heatmap from it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.vm.lab import Lab

# Booting, compiling, starting the agent and the measurement take 10-15 minutes on a busy host (TCG).
pytestmark = [pytest.mark.vm, pytest.mark.timeout(2400)]

DURATION = 10


def headers_visible(lab: Lab) -> None:
    """BCC needs /lib/modules/$(uname -r)/build; fail with the reason if the lab does not provide it."""
    r = lab.run("test -f /lib/modules/$(uname -r)/build/include/generated/autoconf.h "
                "&& test -f /lib/modules/$(uname -r)/source/include/linux/kconfig.h")
    assert r.returncode == 0, "the lab guest has no kernel headers at /lib/modules/$(uname -r)/{build,source}"


@pytest.fixture(scope="module")
def measured(lab_session: Lab) -> dict[str, Any]:
    lab_session.ensure_alive()
    headers_visible(lab_session)
    cmd = [lab_session.venv_python, "tests/vm/guest_probe.py", "run", "--agent", "--duration", str(DURATION),
           "--hogs", "8"]
    r = lab_session.run(cmd, timeout=2000)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in out, out
    print(json.dumps({k: v for k, v in out.items() if k != "agent_log_tail"}, indent=1))
    print(out.get("agent_log_tail", ""))
    return out


def _thread(out: dict[str, Any], comm: str) -> dict[str, Any]:
    rows = [t for t in out["probe"]["threads"] if t["comm"] == comm]
    assert len(rows) == 1, (comm, out["probe"]["threads"])
    return rows[0]


def _tid(out: dict[str, Any], tid: int) -> dict[str, Any]:
    rows = [t for t in out["probe"]["threads"] if t["tid"] == tid]
    assert len(rows) == 1, (tid, out["probe"]["threads"])
    return rows[0]


def test_the_agents_boost_shows_as_a_far_lower_p99_wait(measured: dict[str, Any]) -> None:
    """The boosted twin (priority 5 through the agent's intent and the sched_ext scheduler) against its
    unboosted twin, both engine-step loops beside 8 CPU hogs: the probe must show the boost working."""
    boost, plain = _thread(measured, "probe_boost"), _thread(measured, "probe_plain")
    print(f"p99 wait: boosted {boost['p99_us']:.0f} us, plain {plain['p99_us']:.0f} us")
    assert boost["count"] > 50 and plain["count"] > 50, (boost, plain)
    assert boost["p99_us"] * 4 < plain["p99_us"], (boost, plain)
    # the same per intent, as the probe's table and the agent's histogram metric show it
    by_intent = {row["intent"]: row for row in measured["probe"]["intents"]}
    assert boost["intent"] != plain["intent"], (boost, plain)
    assert by_intent[boost["intent"]]["p99_us"] * 4 < by_intent[plain["intent"]]["p99_us"], by_intent


def test_summed_waits_agree_with_schedstat(measured: dict[str, Any]) -> None:
    """Both count completed waits over the same interval: the probe with bpf_ktime_get_ns, schedstat's
    run_delay with the run queue's clock. For a wakeup that preempts the running task (a boosted twin),
    the kernel skips the clock update at the next switch (rq_clock_skip_update), so run_delay leaves out
    the time until the switch and the probe sees more: compared per thread for the unboosted twin, and in
    the sum of both. Within 25 %: in two-lane `make test` runs on a loaded host the probe read 16-18 % more
    than schedstat (9.40 against 8.12 s, 6.56 against 5.57 s), within 15 % on a quiet one."""
    stat = measured["schedstat_wait_ns"]
    plain, boost = _thread(measured, "probe_plain"), _thread(measured, "probe_boost")
    theirs_plain, theirs_boost = stat[str(plain["tid"])], stat[str(boost["tid"])]
    assert theirs_plain > 0 and theirs_boost is not None
    assert abs(plain["sum_ns"] - theirs_plain) <= 0.25 * theirs_plain, (plain["sum_ns"], theirs_plain)
    ours, theirs = plain["sum_ns"] + boost["sum_ns"], theirs_plain + theirs_boost
    assert abs(ours - theirs) <= 0.25 * theirs, (ours, theirs)


def test_filter_follows_thread_creation_and_exit(measured: dict[str, Any]) -> None:
    spawned = measured["spawner"]
    flt = measured["probe"]["filter"]
    for comm, key in (("probe_spawn", "spawn_tid"), ("probe_late", "late_tid")):
        row = _tid(measured, spawned[key])
        assert row["comm"] == comm
        assert row["added_s"] > 0, "created after the probe started"
        assert row["count"] > 0, "measured once added"
        assert row["removed_s"] is not None and row["removed_s"] > row["added_s"], "removed after exit"
        assert row["tid"] not in flt["tids_at_end"]
    twins = sorted(_thread(measured, c)["tid"] for c in ("probe_boost", "probe_plain"))
    assert sorted(flt["tids_at_end"]) == twins
    assert flt["map_full_errors"] == 0


def test_cli_shows_a_boosted_twin_waiting_far_less(lab_session: Lab) -> None:
    """`gthulhu-node probe --regex` with no agent and no intent, beside 8 CPU hogs: a table per thread,
    where the SCHED_FIFO twin's p99 wait is well below its ordinary twin's."""
    lab_session.ensure_alive()
    r = lab_session.run([lab_session.venv_python, "tests/vm/guest_probe.py", "cli", "--duration", "5"],
                        timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    print(r.stdout)
    assert "regex:^probe_" in r.stdout
    header = next(line.split() for line in r.stdout.splitlines() if line.startswith("TID"))
    rows = {cells[2]: dict(zip(header, cells, strict=True)) for line in r.stdout.splitlines()
            if (cells := line.split())[2:3] in (["probe_boost"], ["probe_plain"])}
    assert set(rows) == {"probe_boost", "probe_plain"}
    boost, plain = rows["probe_boost"], rows["probe_plain"]
    assert int(boost["COUNT"]) > 50 and int(plain["COUNT"]) > 50
    assert float(boost["P99_US"]) * 4 < float(plain["P99_US"]), (boost, plain)


@pytest.mark.lab_seconds(540)  # 9 min measured: the agent, then BCC compiling, under TCG
def test_compare_against_the_real_agent_and_probe(lab_session: Lab) -> None:
    """`gthulhu-node compare` as docs/probe.md's recipe runs it, with the real agent (sched_ext) and the
    BCC probe, an engine-step worker beside 8 CPU hogs: both sides measured in alternating windows, and the
    side with the intent on waits less."""
    lab_session.ensure_alive()
    r = lab_session.run([lab_session.venv_python, "tests/vm/guest_probe.py", "compare", "--duration", "16",
                         "--window", "2"], timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    print(json.dumps(doc["sides"]))
    assert len(doc["windows"]) == 8 and {w["on"] for w in doc["windows"]} == {True, False}, doc
    on, off = doc["sides"]["on"], doc["sides"]["off"]
    assert on["threads"] == off["threads"] == 1, doc
    assert on["waits"] > 50 and off["waits"] > 50, doc
    # p90 and mean, not p99: 8 s a side hold about 900 waits, so a side's p99 is its ten longest, and under
    # TCG those are the emulator's stalls of 3-12 ms on either side (CI of 1844f1d: p99 6.66 ms on against
    # 6.54 off, while p90 was 0.24 against 0.95 ms and the mean 0.29 against 0.47).
    assert on["p90_us"] < off["p90_us"] and on["mean_us"] < off["mean_us"], doc



@pytest.mark.lab_seconds(120)  # 84-93 s measured beside a kernel build (2026-12-02)
def test_the_agents_continuous_probe_feeds_the_dashboards_histogram(lab_session: Lab) -> None:
    """`gthulhu-node run` with `probe.enabled`, as the service runs it (CAP_SYS_ADMIN dropped at start),
    beside CPU hogs: the probe attaches, and Debian's prometheus, scraping the agent, answers the
    dashboard's heatmap query with non-zero buckets, and counts waits for the boosted twin's intent. Before
    the probe used raw tracepoints it could not attach without CAP_SYS_ADMIN (docs/probe.md)."""
    lab_session.ensure_alive()
    headers_visible(lab_session)
    r = lab_session.run([lab_session.venv_python, "tests/vm/guest_probe.py", "agent-probe", "--hogs", "2"],
                        timeout=1500)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    assert out["cap_sys_admin_held"] is False, out
    assert out["probe_up"] == ["gthulhu_node_probe_up 1.0"], out
    assert len(out["bcc_programs"]) == 3, out
    assert len(out["heatmap_queries"]) == 1, out
    assert out["heatmap_nonzero_buckets"][0] > 0, out
    boosted = [v for k, v in out["waits_by_intent"].items() if k.endswith("boost")]
    assert boosted and boosted[0] > 0, out
    assert out["agent_alive"] is True, out
