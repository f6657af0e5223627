"""This process's Linux capabilities: read them per thread, and give some up for good.

Linux keeps the capability sets (effective, permitted, inheritable, bounding, ambient) per thread: capset(2)
and PR_CAPBSET_DROP change the calling thread only, and a new thread starts with a copy of its creator's
sets. A drop therefore covers the whole process only when it is made while the process has one thread:
every thread started afterwards (Python's, and the C threads grpcio starts) descends from that one and
inherits the reduced sets. No call can change another thread's sets, so `drop` refuses to run in a
process that already has a second thread instead of leaving that thread holding what the others gave up.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gthulhu_node.errors import Unsupported

# Bit numbers from <linux/capability.h>, in order.
NAMES = (
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL",
    "CAP_SETGID", "CAP_SETUID", "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK", "CAP_IPC_OWNER", "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN", "CAP_SYS_BOOT",
    "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN",
    "CAP_SYSLOG", "CAP_WAKE_ALARM", "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
)
CAP_SETPCAP = NAMES.index("CAP_SETPCAP")
CAP_SYS_ADMIN = NAMES.index("CAP_SYS_ADMIN")
CAP_SYS_NICE = NAMES.index("CAP_SYS_NICE")
CAP_PERFMON = NAMES.index("CAP_PERFMON")
CAP_BPF = NAMES.index("CAP_BPF")

_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words per set
_PR_CAPBSET_DROP = 24
_STATUS_FIELDS = {"CapInh": "inheritable", "CapPrm": "permitted", "CapEff": "effective",
                  "CapBnd": "bounding", "CapAmb": "ambient"}


class DropRefused(Unsupported):
    """The capabilities could not be dropped from the whole process; nothing was changed, or (the kernel
    refused a step) the message says what is still held."""


@dataclass(frozen=True, slots=True)
class CapSets:
    """One thread's sets as bit masks (bit n = capability n)."""

    effective: int
    permitted: int
    inheritable: int
    bounding: int
    ambient: int

    def holds(self, caps: int) -> int:
        """Which of `caps` this thread can still use or pass on (effective, permitted, inheritable,
        ambient); the bounding set only limits what an exec could grant."""
        return (self.effective | self.permitted | self.inheritable | self.ambient) & caps


@dataclass(frozen=True, slots=True)
class Dropped:
    """What `drop` did: `dropped` held in the permitted set before, `bounding` removed from the bounding
    set too (needs CAP_SETPCAP), `after` the sets read back from the kernel."""

    dropped: int
    bounding: int
    after: CapSets


def bit(cap: int) -> int:
    return 1 << cap


def mask(caps: Iterable[int]) -> int:
    out = 0
    for cap in caps:
        out |= bit(cap)
    return out


def names(bits: int) -> tuple[str, ...]:
    """Capability names of a mask, lowest bit first; unknown (newer) bits as CAP_<n>."""
    return tuple(NAMES[n] if n < len(NAMES) else f"CAP_{n}" for n in range(64) if bits >> n & 1)


def parse_status(text: str) -> CapSets:
    """The Cap* lines of a /proc/.../status file."""
    values = dict.fromkeys(_STATUS_FIELDS.values(), 0)
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in _STATUS_FIELDS:
            values[_STATUS_FIELDS[key]] = int(value.strip(), 16)
    return CapSets(**values)


def current(status: Path = Path("/proc/thread-self/status")) -> CapSets:
    """The calling thread's sets."""
    return parse_status(status.read_text())


def threads(task_dir: Path = Path("/proc/self/task")) -> dict[int, CapSets]:
    """Every thread's sets, by TID (a thread that exits while being read is left out)."""
    out: dict[int, CapSets] = {}
    for name in os.listdir(task_dir):
        try:
            out[int(name)] = parse_status((task_dir / name / "status").read_text())
        except FileNotFoundError:
            continue
    return out


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(call: str, ret: int) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise DropRefused(f"{call}: {os.strerror(err)}")


def drop(caps: Iterable[int], task_dir: Path = Path("/proc/self/task")) -> Dropped:
    """Remove `caps` from this process for good: from the effective, permitted and inheritable sets (and
    so from the ambient set), and from the bounding set when CAP_SETPCAP allows it.

    Must be called while the process has a single thread (see the module docstring); raises DropRefused
    otherwise, or when the kernel refuses, or when a capability is still held afterwards.
    """
    want = mask(caps)
    tasks = os.listdir(task_dir)
    if len(tasks) != 1:
        raise DropRefused(
            f"the process has {len(tasks)} threads: capabilities are per thread, so they must be dropped "
            "before the first other thread starts"
        )
    libc = _libc()
    before = current()
    bounding = 0
    if before.effective & bit(CAP_SETPCAP):
        for cap in range(64):
            if want & before.bounding & bit(cap):
                zero = ctypes.c_ulong(0)
                ret = libc.prctl(ctypes.c_int(_PR_CAPBSET_DROP), ctypes.c_ulong(cap), zero, zero, zero)
                _check("prctl(PR_CAPBSET_DROP)", ret)
                bounding |= bit(cap)
    header = _Header(_VERSION_3, 0)
    data = (_Data * 2)()
    _check("capget", libc.capget(ctypes.byref(header), data))
    for word in range(2):
        keep = ~(want >> (32 * word)) & 0xFFFFFFFF
        data[word].effective &= keep
        data[word].permitted &= keep
        data[word].inheritable &= keep
    # The kernel clears from the ambient set whatever leaves the permitted or inheritable set.
    _check("capset", libc.capset(ctypes.byref(header), data))
    after = current()
    if after.holds(want):
        raise DropRefused(f"still held after capset: {' '.join(names(after.holds(want)))}")
    return Dropped(dropped=before.permitted & want, bounding=bounding, after=after)
