"""The pipe trace's reading of a tracefs text (tests/vm/pipe_trace.py): what issue 40's item 3 says about
where a round trip's time goes rests on it, so it is checked on a trace written by hand."""

from __future__ import annotations

import pytest

from tests.vm import wake_trace
from tests.vm.pipe_trace import split

A, B = 301, 302


def line(ts_us: float, cpu: int, pid: int, event: str, fields: str) -> str:
    comm = "perf" if pid else "<idle>"
    return f"{comm:>16}-{pid:<7} [{cpu:03d}] d..2. {ts_us / 1e6:.6f}: {event}: {fields}"


def switch(ts: float, cpu: int, prev: int, nxt: int) -> str:
    names = {0: "swapper/" + str(cpu), A: "perf", B: "perf"}
    return line(ts, cpu, prev, "sched_switch", f"prev_comm={names[prev]} prev_pid={prev} prev_prio=120 "
                f"prev_state={'S' if prev else 'R'} ==> next_comm={names[nxt]} next_pid={nxt} next_prio=120")


def wake(ts: float, cpu: int, waker: int, wakee: int, target: int) -> list[str]:
    fields = f"comm=perf pid={wakee} prio=120 target_cpu={target:03d}"
    return [line(ts, cpu, waker, "sched_waking", fields), line(ts + 2, cpu, waker, "sched_wakeup", fields)]


def ping_pong(loops: int) -> str:
    """A on CPU 0 and B on CPU 1, each round trip 40 us: A runs 5 us, wakes B (2 us to queue, B runs 8 us
    later), A blocks 3 us after waking it; then the same from B to A."""
    out: list[str] = [switch(0, 0, 0, A)]
    t = 0.0
    for _ in range(loops):
        out += wake(t + 5, 0, A, B, 1)
        out += [switch(t + 10, 0, A, 0), switch(t + 15, 1, 0, B)]
        out += wake(t + 25, 1, B, A, 0)
        out += [switch(t + 30, 1, B, 0), switch(t + 40, 0, 0, A)]
        t += 40
    return "\n".join(out) + "\n"


def test_a_round_trip_splits_into_the_time_neither_one_or_both_of_the_pair_ran() -> None:
    out = split(list(wake_trace.parse(ping_pong(100))), 100)
    assert out["traced_round_trip_us"] == pytest.approx(40.0)
    # per round trip: both off 10-15 and 30-40 (15 us), both on none, one the rest (25 us)
    assert out["per_round_trip_us"]["neither"] == pytest.approx(15.0)
    assert out["per_round_trip_us"]["one"] == pytest.approx(25.0)
    assert out["per_round_trip_us"].get("both", 0.0) == pytest.approx(0.0)
    assert out["wakeups"] == 200 and out["still_on_cpu"] == 0.0
    assert out["queue"]["p50"] == pytest.approx(2.0)
    assert out["where"]["other_cpu"] == 1.0 and out["where"]["target_was_idle"] == 1.0


def test_a_wakee_still_on_its_cpu_is_counted_apart_not_timed_to_its_next_switch_in() -> None:
    text = "\n".join([switch(0, 0, 0, A), switch(1, 1, 0, B), *wake(5, 0, A, B, 1), switch(9, 0, A, 0),
                      *wake(12, 1, B, A, 0), switch(14, 0, 0, A)]) + "\n"
    out = split(list(wake_trace.parse(text)), 1)
    assert out["still_on_cpu"] == 0.5  # B was running when A woke it
    assert out["wakeups"] == 1 and out["to_run"]["p50"] == pytest.approx(0.0)
