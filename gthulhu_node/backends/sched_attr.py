"""The `sched_setattr(2)` / `sched_getattr(2)` system calls, per thread, through ctypes.

glibc has no wrappers for them, so they go through `syscall(2)` with the architecture's numbers. Only the
fields a fair-class (SCHED_OTHER / SCHED_BATCH) thread uses are exposed: policy, the reset-on-fork flag,
nice and `sched_runtime`, which since Linux 6.12 is the thread's slice request to EEVDF (what `chrt -T`
sets). Measured on 6.18: the kernel clamps a requested slice to 100 us - 100 ms without an error, and
`sched_getattr` reports the thread's effective slice in `sched_runtime` (the base slice when it has no
request of its own), so reading back is the only way to know what the kernel made of a request.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import threading
from dataclasses import dataclass

from gthulhu_node.workers import run_in_thread

SCHED_OTHER = 0
SCHED_FIFO = 1
SCHED_RR = 2
SCHED_BATCH = 3
SCHED_IDLE = 5
SCHED_DEADLINE = 6
FAIR_POLICIES = frozenset({SCHED_OTHER, SCHED_BATCH})
POLICY_NAMES = {
    SCHED_OTHER: "SCHED_OTHER",
    SCHED_FIFO: "SCHED_FIFO",
    SCHED_RR: "SCHED_RR",
    SCHED_BATCH: "SCHED_BATCH",
    SCHED_IDLE: "SCHED_IDLE",
    SCHED_DEADLINE: "SCHED_DEADLINE",
}

SCHED_FLAG_RESET_ON_FORK = 0x01

NICE_MIN = -20
NICE_MAX = 19
# The range EEVDF clamps a slice request into (kernel/sched/syscalls.c, __setparam_fair).
KERNEL_SLICE_MIN_NS = 100_000
KERNEL_SLICE_MAX_NS = 100_000_000

# (sched_setattr, sched_getattr) per architecture; the kernel's syscall tables.
_SYSCALLS = {
    "x86_64": (314, 315),
    "aarch64": (274, 275),
    "arm64": (274, 275),
    "riscv64": (274, 275),
    "ppc64le": (355, 356),
    "s390x": (345, 346),
}


class _SchedAttr(ctypes.Structure):
    """struct sched_attr, SCHED_ATTR_SIZE_VER1 (56 bytes, with the utilization clamps)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
        ("sched_util_min", ctypes.c_uint32),
        ("sched_util_max", ctypes.c_uint32),
    ]


@dataclass(frozen=True, slots=True)
class SchedAttr:
    """What this project reads and writes of one thread's scheduling attributes."""

    policy: int
    nice: int
    runtime_ns: int  # SCHED_OTHER/BATCH: the slice (request, or the base slice when none was made)
    reset_on_fork: bool = False
    rt_priority: int = 0  # only meaningful for SCHED_FIFO/RR; reported so a refusal can say why

    @property
    def policy_name(self) -> str:
        return POLICY_NAMES.get(self.policy, str(self.policy))

    def same_settings(self, other: SchedAttr) -> bool:
        """Whether two reads show the same settings (what "someone else changed it" is judged by)."""
        return (
            self.policy == other.policy
            and self.nice == other.nice
            and self.runtime_ns == other.runtime_ns
            and self.reset_on_fork == other.reset_on_fork
        )


class SchedAttrSyscalls:
    """The real system calls. A class (not functions) so unit tests can hand a backend a fake kernel."""

    def __init__(self) -> None:
        numbers = _SYSCALLS.get(platform.machine())
        if numbers is None:
            raise OSError(errno.ENOSYS, f"sched_setattr: unknown syscall number on {platform.machine()}")
        self._nr_set, self._nr_get = numbers
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = self._libc.syscall
        self._syscall.restype = ctypes.c_long

    def get(self, tid: int) -> SchedAttr:
        """sched_getattr(tid). Raises OSError (ESRCH when the thread is gone)."""
        raw = _SchedAttr()
        rc = self._syscall(
            ctypes.c_long(self._nr_get),
            ctypes.c_int(tid),
            ctypes.byref(raw),
            ctypes.c_uint(ctypes.sizeof(raw)),
            ctypes.c_uint(0),
        )
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sched_getattr({tid}): {os.strerror(err)}")
        return SchedAttr(
            policy=raw.sched_policy,
            nice=raw.sched_nice,
            runtime_ns=raw.sched_runtime,
            reset_on_fork=bool(raw.sched_flags & SCHED_FLAG_RESET_ON_FORK),
            rt_priority=raw.sched_priority,
        )

    def set(self, tid: int, attr: SchedAttr) -> None:
        """sched_setattr(tid) for a fair policy. `runtime_ns` 0 drops the thread's own slice request."""
        if attr.policy not in FAIR_POLICIES:
            raise ValueError(f"only SCHED_OTHER/SCHED_BATCH are written here, not {attr.policy_name}")
        raw = _SchedAttr(
            size=ctypes.sizeof(_SchedAttr),
            sched_policy=attr.policy,
            sched_flags=SCHED_FLAG_RESET_ON_FORK if attr.reset_on_fork else 0,
            sched_nice=attr.nice,
            sched_runtime=attr.runtime_ns,
        )
        rc = self._syscall(
            ctypes.c_long(self._nr_set), ctypes.c_int(tid), ctypes.byref(raw), ctypes.c_uint(0)
        )
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"sched_setattr({tid}): {os.strerror(err)}")


@dataclass(frozen=True, slots=True)
class Probe:
    """What a throwaway thread of our own found out about this kernel's EEVDF."""

    ok: bool
    reason: str
    base_slice_ns: int = 0


PROBE_SLICE_NS = 2_000_000


def probe(syscalls: SchedAttrSyscalls | None = None) -> Probe:
    """Try a slice request and a nice change on a thread created for the purpose, then let it exit.

    The test is behavioural, not a version check: before 6.12 the kernel accepts `sched_runtime` for
    SCHED_OTHER but ignores it, and sched_getattr does not report it back. The thread also measures the
    base slice (what a thread with no request of its own gets), needed to restore "no request" exactly.
    """
    result: list[Probe] = []

    def run() -> None:
        try:
            calls = syscalls or SchedAttrSyscalls()
            me = threading.get_native_id()
            before = calls.get(me)
            calls.set(me, SchedAttr(SCHED_OTHER, before.nice, 0))
            base = calls.get(me).runtime_ns
            calls.set(me, SchedAttr(SCHED_OTHER, max(NICE_MIN, before.nice - 1), PROBE_SLICE_NS))
            after = calls.get(me)
        except OSError as exc:
            hint = " (needs root or CAP_SYS_NICE)" if exc.errno == errno.EPERM else ""
            result.append(Probe(False, f"sched_setattr failed: {exc.strerror}{hint}"))
            return
        if after.runtime_ns != PROBE_SLICE_NS:
            result.append(
                Probe(False, f"kernel {platform.release()} ignores SCHED_OTHER slice requests (needs 6.12+)")
            )
        elif after.nice != max(NICE_MIN, before.nice - 1):
            result.append(Probe(False, "kernel did not apply a nice change through sched_setattr"))
        else:
            result.append(
                Probe(True, f"kernel {platform.release()} honours slice requests (EEVDF)", base_slice_ns=base)
            )

    run_in_thread("eevdf-check", run)
    return result[0] if result else Probe(False, "probe thread failed")
