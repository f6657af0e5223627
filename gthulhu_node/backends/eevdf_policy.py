"""What a strategy becomes under EEVDF: a boost priority as a nice level, a slice as a slice request, and
what sched_getattr will report after that write (the kernel clamps and fills in). Pure arithmetic, no I/O."""

from __future__ import annotations

from gthulhu_node.backends.base import Entry
from gthulhu_node.backends.sched_attr import KERNEL_SLICE_MAX_NS, KERNEL_SLICE_MIN_NS, NICE_MIN, SchedAttr
from gthulhu_node.limits import PRIORITY_MAX, strength

# The weakest boost is nice -5 (about 3x the CPU weight of a nice-0 thread): "boosted" must mean served
# ahead of ordinary threads, and nice -1 (1.25x) would not be noticeable under contention.
NICE_WEAKEST_BOOST = -5


def nice_for_priority(priority: int) -> int:
    """Map a boost priority 1-20 onto nice -20..-5, evenly (rounded), a stronger priority (1 the
    strongest: limits.strength) never a weaker nice.

    Compressed rather than 1:1 (strength s -> nice -s) because the weaker half of a 1:1 map barely changes
    a thread's weight; 20 priorities on 16 nice levels means a few neighbours share a level.
    """
    if not 1 <= priority <= PRIORITY_MAX:
        raise ValueError(f"priority {priority} is not a boost (1-{PRIORITY_MAX})")
    span = NICE_WEAKEST_BOOST - NICE_MIN  # 15 levels below the weakest boost
    steps = (2 * span * (strength(priority) - 1) + (PRIORITY_MAX - 1)) // (2 * (PRIORITY_MAX - 1))
    return NICE_WEAKEST_BOOST - steps


def desired(original: SchedAttr, entry: Entry, base_slice_ns: int) -> SchedAttr:
    """What to write for `entry` on a thread that had `original`: never a weaker nice than its own;
    priority 0 keeps its nice, slice 0 keeps its slice request; reset-on-fork always."""
    nice = original.nice
    if entry.priority > 0:
        nice = min(nice, nice_for_priority(entry.priority))
    runtime = entry.slice_ns if entry.slice_ns else request_of(original, base_slice_ns)
    return SchedAttr(original.policy, nice, runtime, reset_on_fork=True)


def read_back_of(written: SchedAttr, base_slice_ns: int) -> SchedAttr:
    """What sched_getattr will report after writing `written`: the kernel clamps a slice request and
    reports the base slice when there is none (sched_attr.py)."""
    runtime = clamp_slice(written.runtime_ns) if written.runtime_ns else base_slice_ns
    return SchedAttr(written.policy, written.nice, runtime, written.reset_on_fork)


def clamp_slice(runtime_ns: int) -> int:
    """A slice request as the kernel keeps it (100 us - 100 ms)."""
    return min(max(runtime_ns, KERNEL_SLICE_MIN_NS), KERNEL_SLICE_MAX_NS)


def request_of(original: SchedAttr, base_slice_ns: int) -> int:
    """The slice request to write back: 0 (none) when the thread only had the base slice.

    sched_getattr cannot tell "no request" from "a request equal to the base slice"; both are
    restored as no request, which behaves the same until someone changes the base slice.
    """
    return 0 if original.runtime_ns == base_slice_ns else original.runtime_ns
