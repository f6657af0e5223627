"""The sleeper benchmark's reading of cyclictest's histogram (tests/vm/sleeper_bench.py): the p99 the lab
test and `make bench` compare ours with EEVDF by."""

from __future__ import annotations

import pytest

from tests.vm.sleeper_bench import parse_histogram


def histogram(counts: dict[int, int], avg: int, top: int, overflows: int = 0) -> str:
    lines = ["# /dev/cpu_dma_latency set to 0us", "# Histogram"]
    lines += [f"{bucket:06d} {counts.get(bucket, 0):09d}" for bucket in range(0, 200)]
    lines += [f"# Total: {sum(counts.values()):09d}", "# Min Latencies: 00010", f"# Avg Latencies: {avg:05d}",
              f"# Max Latencies: {top:05d}", f"# Histogram Overflows: {overflows:05d}",
              "# Histogram Overflow at cycle number:", "# Thread 0:"]
    return "\n".join(lines) + "\n"


def test_p99_is_the_bucket_where_99_percent_of_the_wake_ups_are_reached() -> None:
    out = parse_histogram(histogram({50: 980, 120: 15, 150: 5}, avg=52, top=150))
    assert out == {"avg_us": 52.0, "p50_us": 50.0, "p99_us": 120.0, "max_us": 150.0, "samples": 1000.0}


def test_overflows_count_at_the_maximum() -> None:
    # 20 of 1,000 wake-ups past the last bucket: the p99 is among them, read as the maximum
    out = parse_histogram(histogram({50: 980}, avg=900, top=45000, overflows=20))
    assert out["p99_us"] == 45000.0 and out["samples"] == 1000.0


def test_output_without_a_summary_is_an_error_not_zero() -> None:
    with pytest.raises(ValueError, match="no cyclictest summary"):
        parse_histogram("cyclictest: failed to set policy\n")
    with pytest.raises(ValueError, match="measured nothing"):
        parse_histogram(histogram({}, avg=0, top=0))


TRACE = """\
 <idle>-0 [001] d.h2.   100.000100: local_timer_entry: vector=236
 stress-ng-cpu-90   [000] dNh2.   100.001000: sched_wakeup: comm=cyclictest pid=77 prio=120 target_cpu=000
stress-ng-cpu-90 [000] d..2. 100.001050: sched_switch: prev_comm=stress-ng-cpu prev_pid=90 prev_prio=120 \
prev_state=R+ ==> next_comm=cyclictest next_pid=77 next_prio=120
 stress-ng-cpu-91   [001] d.h2.   100.004000: local_timer_entry: vector=236
 stress-ng-cpu-90   [000] dNh2.   100.006000: sched_wakeup: comm=cyclictest pid=77 prio=120 target_cpu=000
 stress-ng-cpu-91   [001] d.h2.   100.007000: local_timer_entry: vector=236
 stress-ng-cpu-90   [000] d.h2.   100.008000: local_timer_entry: vector=236
stress-ng-cpu-90 [000] d..2. 100.008050: sched_switch: prev_comm=stress-ng-cpu prev_pid=90 prev_prio=120 \
prev_state=R ==> next_comm=cyclictest next_pid=77 next_prio=120
"""


def test_a_wake_up_that_ran_only_after_a_tick_of_its_cpu_counts_as_waiting() -> None:
    from tests.vm.sleeper_bench import waited_ticks

    # the first wake-up preempted at once; the second ran after CPU 0's tick (CPU 1's ticks do not count)
    assert waited_ticks(TRACE, 77) == {"wakeups_traced": 2.0, "waited_a_tick": 0.5}
    assert waited_ticks(TRACE, 78)["wakeups_traced"] == 0.0
