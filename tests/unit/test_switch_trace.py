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
