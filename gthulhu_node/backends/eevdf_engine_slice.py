"""The eevdf backend's own engine thread's slice request: short, so it reacts as soon as it wakes.

The proc connector wakes the engine with a sync wakeup, which places it on the CPU of the thread that
renamed itself or forked; with the default slice it waits there until that thread's slice ends at the next
tick (4 ms at HZ=250) unless the thread sleeps first. With a shorter slice the kernel lets it preempt at
once (PREEMPT_SHORT) and picks it first after any preemption. Its weight (nice) is left alone: the agent's
share of the CPU does not grow, only its latency falls. docs/eevdf.md, reaction time.
"""

from __future__ import annotations

import os
import threading

import structlog

from gthulhu_node.backends.eevdf_policy import clamp_slice
from gthulhu_node.backends.eevdf_proc import GONE
from gthulhu_node.backends.sched_attr import FAIR_POLICIES, SchedAttr, SchedAttrSyscalls

log = structlog.get_logger(__name__)


class EngineSlice:
    """The calling (engine) thread's slice request: set once per thread, dropped at stop."""

    def __init__(self, slice_ns: int) -> None:
        """`slice_ns` 0: never (tests and tools that call the backend from their own threads)."""
        self.slice_ns = slice_ns
        self._calls: SchedAttrSyscalls | None = None
        self._base_slice_ns = 0
        # The engine thread's tid once seen, and whether it carries our slice request (to drop at stop).
        self._tid = 0
        self._set = False
        self.failures = 0  # slice requests the kernel refused (the backend counts them in `errors`)

    def start(self, calls: SchedAttrSyscalls, base_slice_ns: int) -> None:
        """The started backend's syscalls, and the base slice a thread without a request shows."""
        self._calls, self._base_slice_ns = calls, base_slice_ns

    def protect(self) -> None:
        """Give the calling thread the short slice request, once (on every apply and tick: cheap)."""
        if self.slice_ns <= 0:
            return
        tid = threading.get_native_id()
        if tid == self._tid:
            return
        self.release()
        self._tid = tid
        calls = self._calls
        assert calls is not None, "protect() after start()"
        try:
            before = calls.get(tid)
            if before.policy not in FAIR_POLICIES or before.runtime_ns != self._base_slice_ns:
                return  # real-time, or a slice someone chose: not ours to change
            calls.set(tid, SchedAttr(before.policy, before.nice, self.slice_ns, before.reset_on_fork))
        except OSError as exc:
            self.failures += 1
            log.warning("eevdf_engine_slice_failed", tid=tid, error=exc.strerror)
            return
        self._set = True
        log.info("eevdf_engine_slice", tid=tid, slice_ns=self.slice_ns)

    def release(self) -> None:
        """Drop the engine thread's slice request if it still has ours (at stop; a new engine thread)."""
        tid, ours = self._tid, self._set
        self._tid, self._set = 0, False
        if not ours or not os.path.exists(f"/proc/self/task/{tid}"):
            return  # nothing written, or the thread ended (and its tid is not ours any more)
        calls = self._calls
        assert calls is not None, "a slice set means started"
        try:
            now = calls.get(tid)
            if now.runtime_ns == clamp_slice(self.slice_ns):
                calls.set(tid, SchedAttr(now.policy, now.nice, 0, now.reset_on_fork))
        except OSError as exc:
            if exc.errno not in GONE:
                log.warning("eevdf_engine_slice_restore_failed", tid=tid, error=exc.strerror)
