"""The pipe trace's reading of a tracefs text (tests/vm/pipe_trace.py): what issue 40's item 3 says about
where a round trip's time goes rests on it, so it is checked on traces written by hand."""

from __future__ import annotations

import pytest

from tests.vm import wake_trace
from tests.vm.pipe_trace import split

A, B, OTHER = 301, 302, 77


def line(ts_us: float, cpu: int, pid: int, event: str, fields: str) -> str:
    comm = "perf" if pid else "<idle>"
    return f"{comm:>16}-{pid:<7} [{cpu:03d}] d..2. {ts_us / 1e6:.6f}: {event}: {fields}"


def switch(ts: float, cpu: int, prev: int, nxt: int) -> str:
    def name(pid: int) -> str:
        return {0: f"swapper/{cpu}", OTHER: "kworker"}.get(pid, "perf")

    return line(ts, cpu, prev, "sched_switch", f"prev_comm={name(prev)} prev_pid={prev} prev_prio=120 "
                f"prev_state={'S' if prev else 'R'} ==> next_comm={name(nxt)} next_pid={nxt} next_prio=120")


def wake(ts: float, cpu: int, waker: int, wakee: int, target: int) -> list[str]:
    fields = f"comm=perf pid={wakee} prio=120 target_cpu={target:03d}"
    return [line(ts, cpu, waker, "sched_waking", fields), line(ts + 2, cpu, waker, "sched_wakeup", fields)]


def ping_pong(loops: int) -> str:
    """A on CPU 0 and B on CPU 1 from t = 1,000 us, each round trip 40 us: A wakes B at +5 (B runs at +15,
    10 us after the waking), A blocks at +10; B wakes A at +25, blocks at +30, A runs at +40. A kworker
    runs on CPU 1 while both ends are off it; perf's start-up and exit lie outside the round trips."""
    out: list[str] = [switch(200, 1, 0, OTHER), switch(210, 1, OTHER, 0), switch(1000, 0, 0, A)]
    t = 1000.0
    for _ in range(loops):
        out += wake(t + 5, 0, A, B, 1)
        out += [switch(t + 10, 0, A, 0), switch(t + 15, 1, 0, B)]
        out += wake(t + 25, 1, B, A, 0)
        out += [switch(t + 30, 1, B, 0), switch(t + 31, 1, 0, OTHER), switch(t + 33, 1, OTHER, 0),
                switch(t + 40, 0, 0, A)]
        t += 40
    out += [switch(t + 300, 0, A, 0), switch(t + 900, 1, 0, OTHER)]  # the exit, and after it
    return "\n".join(out) + "\n"


def test_a_round_trip_splits_into_the_time_neither_one_or_both_ends_ran() -> None:
    out = split(list(wake_trace.parse(ping_pong(100))))
    # from the first waking (+5) to the last switch-in (100 x 40): 3,995 us over 100 round trips
    assert out["traced_round_trip_us"] == pytest.approx(39.95)
    per = out["per_round_trip_us"]
    assert per["neither"] + per["one"] + per.get("both", 0.0) == pytest.approx(out["traced_round_trip_us"])
    # off: 10-15 and 30-40 of each 40 us (the kworker is not an end); the first trip starts at +5
    assert per["neither"] == pytest.approx(15.0)
    assert out["wakeups"] == 200 and out["still_on_cpu"] == 0.0
    # A -> B: waking +5, wakeup +7, running +15; B -> A: +25, +27, +40. A runs 5 us before it wakes B,
    # B 10 before it wakes A
    assert out["queue"]["mean"] == pytest.approx(2.0) and out["to_run"]["mean"] == pytest.approx(10.5)
    assert out["wake_to_run_other"]["mean"] == pytest.approx(12.5) and "wake_to_run_same" not in out
    assert out["run_to_wake"]["mean"] == pytest.approx(7.5)
    assert out["where"]["other_cpu"] == 1.0 and out["where"]["target_was_idle"] == 1.0


def test_overlapping_ends_count_as_both_and_a_same_cpu_wake_up_is_told_apart() -> None:
    text = "\n".join([
        switch(0, 0, 0, A), switch(0.5, 1, 0, OTHER),
        *wake(5, 0, A, B, 1), switch(9, 1, OTHER, B),  # B runs on CPU 1 from 9, A still runs until 12
        switch(12, 0, A, 0),
        *wake(20, 1, B, A, 1), switch(24, 1, B, A),  # B wakes A on its own CPU and blocks: A runs there
    ]) + "\n"
    out = split(list(wake_trace.parse(text)))
    per = out["per_round_trip_us"]
    # from 5 to 24: both 9-12 (3 us), one 5-9 and 12-24 (16 us); one round trip
    assert per["both"] == pytest.approx(3.0) and per["one"] == pytest.approx(16.0)
    assert out["where"] == {"other_cpu": 0.5, "same_cpu": 0.5, "target_was_busy": 1.0}
    assert out["wake_to_run_same"]["p50"] == pytest.approx(4.0)


def test_a_wakee_still_on_its_cpu_is_counted_apart_not_timed_to_its_next_switch_in() -> None:
    text = "\n".join([switch(0, 0, 0, A), switch(1, 1, 0, B), *wake(5, 0, A, B, 1), switch(9, 0, A, 0),
                      *wake(12, 1, B, A, 0), switch(14, 0, 0, A)]) + "\n"
    out = split(list(wake_trace.parse(text)))
    assert out["still_on_cpu"] == 0.5  # B was running when A woke it
    assert out["wakeups"] == 1 and out["to_run"]["p50"] == pytest.approx(0.0)
