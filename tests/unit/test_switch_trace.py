"""The sched_switch parser the placement and preemption lab tests read their figures from: a wrong CPU or a
lost run there would make those tests pass or fail on the parser, not on the scheduler. Lines in the
kernel's own format (TP_printk of sched_switch), with the comms that trip naive patterns."""

from __future__ import annotations

import pytest

from tests.vm.switch_trace import Switches

TRACE = """\
# tracer: nop
          <idle>-0       [001] d..2.   100.000000: sched_switch: prev_comm=swapper/1 prev_pid=0 \
prev_prio=120 prev_state=R ==> next_comm=eng [3] x next_pid=42 next_prio=120
     eng [3] x-42      (     42) [001] d..2.   100.005000: sched_switch: prev_comm=eng [3] x prev_pid=42 \
prev_prio=-51 prev_state=R+ ==> next_comm=hog=1 next_pid=7 next_prio=120
           hog=1-7       [000] d..2.   100.006000: sched_switch: prev_comm=hog=1 prev_pid=7 prev_prio=120 \
prev_state=S ==> next_comm=eng [3] x next_pid=42 next_prio=120
     eng [3] x-42      [000] dN.2.   100.009000: sched_switch: prev_comm=eng [3] x prev_pid=42 \
prev_prio=120 prev_state=S ==> next_comm=hog=1 next_pid=7 next_prio=120
"""


def test_run_time_lands_on_the_cpu_of_the_switch_and_preemptions_name_the_next_task() -> None:
    seen = Switches()
    seen.parse(TRACE, {42})
    assert seen.runs[42] == 2
    assert seen.ran[42] == {1: pytest.approx(0.005), 0: pytest.approx(0.003)}
    assert seen.preempted_by[42] == {7: 1}  # the R+ switch; the S one is a sleep
    assert seen.share_on(42, {1}) == 0.625


def test_a_task_running_when_the_trace_starts_is_counted_from_its_first_switch_in() -> None:
    seen = Switches()
    seen.parse(TRACE.split("\n", 2)[2], {42})  # its first switch-in cut off
    assert set(seen.ran[42]) == {0} and seen.runs[42] == 1


def _line(cpu: int, stamp: float, prev: int, state: str, nxt: int, tgid: str = "") -> str:
    tag = f"({tgid:>7}) " if tgid else ""
    return (f"  t-{prev} {tag}[{cpu:03d}] d..2. {stamp:.6f}: sched_switch: prev_comm=t prev_pid={prev} "
            f"prev_prio=120 prev_state={state} ==> next_comm=t next_pid={nxt} next_prio=120")


def test_what_went_ahead_of_a_preempted_task_counts_each_task_once_per_wait() -> None:
    # the hog (7) preempted by 1, then 2 and 1 again run before it resumes: one wait, 1 and 2 once each;
    # on the other CPU, 3 runs meanwhile and is not ahead of it
    trace = "\n".join([
        _line(0, 1.000, 7, "R+", 1), _line(1, 1.0005, 9, "R", 3), _line(0, 1.001, 1, "S", 2),
        _line(0, 1.002, 2, "S", 1), _line(0, 1.003, 1, "S", 7),
        _line(0, 1.010, 7, "R", 2), _line(0, 1.011, 2, "S", 7),  # a second wait: 2 once more
    ])
    seen = Switches()
    seen.parse(trace, {7, 1, 2, 3})
    assert seen.preempted_by[7] == {1: 1, 2: 1}
    assert seen.went_ahead[7] == {1: 1, 2: 2}


def test_beside_names_what_the_other_cpus_ran_and_tgids_come_from_the_switched_out_task() -> None:
    trace = "\n".join([
        _line(1, 1.000, 0, "R", 50, tgid="0"),   # CPU 1 runs 50 (a thread of 49)
        _line(0, 1.001, 9, "R+", 8, tgid="9"),   # 9 preempted by 8 on CPU 0 while CPU 1 runs 50
        _line(1, 1.002, 50, "S", 0, tgid="49"),  # CPU 1 idles
        _line(0, 1.003, 8, "S", 9, tgid="-------"),
        _line(0, 1.004, 9, "R+", 8, tgid="9"),   # preempted again, CPU 1 idle (0)
    ])
    seen = Switches()
    seen.parse(trace, {9, 8})
    assert seen.beside[9][8] == [(50,), (0,)]
    assert seen.tgid[50] == 49 and seen.tgid[9] == 9 and 8 not in seen.tgid  # dashes: not recorded
