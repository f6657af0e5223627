"""Load, attach, watch and detach the gthulhu sched_ext scheduler.

The scheduler is attached by registering its struct_ops map (`.struct_ops`, not `.struct_ops.link`, which
Debian 12's libbpf 1.1.2 does not know). That attach is not link-based: when the agent dies without
detaching (SIGKILL), the scheduler keeps running with its last entries and no owner. The next start takes
over by detaching that stale instance (deleting its struct_ops map element by id) and loading a fresh one
with empty maps, so no stale entry survives; the reconciler's first full scan refills the maps. A lock file
held for the agent's lifetime tells a stale instance (lock free) from a live agent (lock held). Finding the
stale instance by id needs CAP_SYS_ADMIN, so the agent does it first thing (`take_over_stale`) and then
gives that capability up; loading, and reloading after an ejection, need CAP_BPF and CAP_PERFMON only.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import platform
import re
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import structlog

from gthulhu_node.backends.base import BackendError, BackendUnavailable, SchedulerRefused
from gthulhu_node.scheduler import libbpf
from gthulhu_node.scheduler.layout import (
    STAT_COUNTERS,
    GthulhuBss,
    GthulhuCounters,
    GthulhuSettings,
    GthulhuTaskStats,
)

log = structlog.get_logger(__name__)

SCHED_NAME = "gthulhu"
OPS_MAP = "gthulhu_ops"
SCHED_EXT = Path("/sys/kernel/sched_ext")
KERNEL_BTF = Path("/sys/kernel/btf/vmlinux")
LOCK_PATH = Path("/run/gthulhu-node/scheduler.lock")
SLEEPABLE_PROGRAMS = ("gthulhu_init",)
ATTACH_TIMEOUT_S = 30.0
#: enum scx_exit_kind: a runtime error the kernel found, and its watchdog's runnable-task stall
SCX_EXIT_ERROR, SCX_EXIT_ERROR_STALL = 1024, 1026
#: an SCX_EXIT_ERROR's message when the kernel ejected for a host-wide stall: an RCU CPU stall ("RCU CPU
#: stall detected!"; 7.x "RCU CPU stall on CPUs (...)"), a soft or a hard lockup
HOST_STALL = re.compile(r"RCU CPU stall|lockup")
#: loads tried when the kernel ejects the scheduler while it is being enabled, and the pause between them
LOAD_ATTEMPTS = 3
LOAD_RETRY_PAUSE_S = 1.0
#: fair queues the scheduler creates at most (MAX_DOMAINS in bpf/state.bpf.h): more NUMA nodes share them
MAX_DOMAINS = 64
#: scheduler.fair_queues: one unboosted queue per NUMA node, or one for the whole host
FAIR_QUEUE_MODES = ("per_node", "single")


@dataclass(frozen=True, slots=True)
class LoadSettings:
    """What is fixed before load (config.SchedulerConfig sets them; these are its defaults)."""

    default_slice_ns: int = 5_000_000
    boost_share_percent: int = 75
    boost_window_ns: int = 100_000_000
    map_capacity: int = 65_536
    watchdog_timeout_ms: int = 0  # 0: the kernel's default
    agent_tgid: int = 0  # 0: the agent's own threads are not protected
    bpf_object: Path | None = None
    fair_queues: str = "per_node"  # FAIR_QUEUE_MODES
    verifier_stats: bool = False  # record each program's verifier statistics (LoadedScheduler.verifier_insns)


def sched_ext_state(root: Path = SCHED_EXT) -> tuple[str, str]:
    """(state, ops name) as the kernel reports them; ops is "" when no scheduler is loaded."""
    state = (root / "state").read_text().strip()
    try:
        ops = (root / "root" / "ops").read_text().strip()
    except OSError:
        ops = ""
    if state == "disabled":
        ops = ""
    return state, ops


def check_support(root: Path = SCHED_EXT, btf: Path = KERNEL_BTF) -> None:
    """Raise BackendUnavailable with what is missing when this kernel cannot run the scheduler."""
    release = os.uname().release
    if not root.is_dir():
        raise BackendUnavailable(
            f"kernel {release} has no sched_ext ({root} is missing: CONFIG_SCHED_CLASS_EXT is not set); "
            "the sched_ext backend needs Linux 6.12 or later built with it"
        )
    if not btf.is_file():
        raise BackendUnavailable(f"kernel {release} exposes no BTF ({btf} is missing: CONFIG_DEBUG_INFO_BTF)")
    if os.geteuid() != 0:
        raise BackendUnavailable("loading a sched_ext scheduler needs root (CAP_BPF and CAP_PERFMON)")


def kfunc_flavour(btf: Path = KERNEL_BTF) -> str:
    """Which object fits this kernel: '6.17' when its sched_ext_ops has cgroup_set_bandwidth (the object that
    enforces cpu.max sets it, and libbpf 1.1.2 refuses a member the kernel lacks); else '6.13' when it has
    the renamed kfuncs (scx_bpf_dsq_insert); else '6.12'."""
    data = btf.read_bytes()
    if b"\0scx_bpf_dsq_insert\0" not in data:
        return "6.12"
    try:
        members = ops_members(btf)
    except libbpf.LibbpfError as exc:
        # a refusal, so that `backend: auto` falls back as it does when the load itself fails
        raise SchedulerRefused(
            f"cannot read struct sched_ext_ops from the kernel's BTF ({btf}): {exc}") from exc
    return "6.17" if BANDWIDTH_OP in members else "6.13"


BANDWIDTH_OP = "cgroup_set_bandwidth"
#: the object of each flavour, before .<arch>.bpf.o
OBJECT_STEMS = {"6.17": "gthulhu-6.17", "6.13": "gthulhu", "6.12": "gthulhu-6.12"}


def ops_members(btf: Path = KERNEL_BTF) -> set[str]:
    """The members of the kernel's struct sched_ext_ops."""
    with libbpf.parsed_btf(btf) as kernel:
        return {name for name, _, _ in kernel.struct_members("sched_ext_ops")}


def _sets_bandwidth_op(path: Path, flavour: str) -> bool:
    """Whether the object's ops table has cgroup_set_bandwidth: by its BTF, since an override
    (scheduler.bpf_object) need not be the object its flavour names."""
    try:
        return BANDWIDTH_OP in ops_members(path)
    except libbpf.LibbpfError:
        return flavour == "6.17"


def enforces_cpu_max(flavour: str) -> bool:
    """Whether the object of this flavour enforces cpu.max: every one does, the 6.17 object from what the
    kernel passes it (ops.cgroup_set_bandwidth), the older ones from the cgroup's task_group, where those
    kernels keep cpu.max for the fair class (read every 10 ms; docs/scheduler.md, "cpu.max")."""
    return flavour in OBJECT_STEMS


def cpu_max_source(passed_by_kernel: bool) -> str:
    """Where an object takes cpu.max from, for status: the 6.17 object from ops.cgroup_set_bandwidth."""
    if passed_by_kernel:
        return "passed by the kernel, 6.17 or later"
    return "read from the kernel's task_group every 10 ms, kernel before 6.17"


_OBJECT_NAME = re.compile(r"gthulhu(?:-6\.1[27])?\.(\w+)\.bpf\.o")


def packaged_objects() -> Path:
    """The package's folder of prebuilt objects: `gthulhu[-6.12|-6.17].<arch>.bpf.o`, <arch> as
    platform.machine() names it (x86_64, aarch64), each built against its architecture's vmlinux.h."""
    return Path(str(resources.files("gthulhu_node") / "data"))


def object_path(flavour: str, override: Path | None = None, machine: str | None = None) -> Path:
    """The object for this kernel's kfunc names and this machine's architecture (or `override`)."""
    if override is not None:
        return override
    machine = machine or platform.machine()
    stem = OBJECT_STEMS[flavour]
    data = packaged_objects()
    path = data / f"{stem}.{machine}.bpf.o"
    if path.is_file():
        return path
    built = sorted({m.group(1) for p in data.glob("*.bpf.o") if (m := _OBJECT_NAME.fullmatch(p.name))})
    if machine not in built:
        raise BackendUnavailable(
            f"no sched_ext scheduler object for this architecture ({machine}): the package carries "
            f"{', '.join(built) or 'none'} (docs/arm64.md)"
        )
    raise BackendUnavailable(f"{path} is missing: build it with `make -C bpf`")


def possible_cpus(path: Path = Path("/sys/devices/system/cpu/possible")) -> int:
    """nr_cpu_ids: the highest possible CPU plus one. The scheduler's per-CPU array gets that many entries,
    so every CPU the kernel can ever bring online has one (hotplug included); there is no compiled-in cap."""
    text = path.read_text().strip()
    last = text.split(",")[-1].split("-")[-1]
    return int(last) + 1


def cpu_capacities(nr_cpus: int, root: Path = Path("/sys/devices/system/cpu")) -> list[int]:
    """Each CPU's capacity as the kernel sees it (`cpuN/cpu_capacity`, 1024 for the most capable; arm64,
    arm and riscv report it, from the device tree's capacity-dmips-mhz or ACPI's CPPC). Where a host reports
    none (x86) every CPU is 1024; a possible CPU with no file (not present yet) counts as the most capable
    reported, so it is never avoided by mistake once hot-added."""
    found: dict[int, int] = {}
    for cpu in range(nr_cpus):
        try:
            found[cpu] = int((root / f"cpu{cpu}" / "cpu_capacity").read_text().strip())
        except (OSError, ValueError):
            continue
    top = max(found.values(), default=1024)
    return [found.get(cpu, top) for cpu in range(nr_cpus)]


def parse_cpulist(text: str) -> list[int]:
    """The CPUs of a kernel cpulist ("0-3,8,10-11"; empty for none)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


def node_cpus(node: Path) -> set[int]:
    """A NUMA node's CPUs: its `cpulist` (the online ones, on x86 and arm64) and its `cpuN` links (every
    present CPU, online or not, so a CPU offline when the agent starts is still put in its node)."""
    cpus = {int(link.name[3:]) for link in node.glob("cpu[0-9]*")}
    with contextlib.suppress(OSError, ValueError):  # the links alone then
        cpus.update(parse_cpulist((node / "cpulist").read_text()))
    return cpus


def cpu_domains(nr_cpus: int, root: Path = Path("/sys/devices/system/node")) -> list[int]:
    """Each CPU's fair-queue domain: its NUMA node, numbered densely over the nodes that have CPUs (a
    memory-only node, such as a GPU's or CXL memory, gets no queue), folded into MAX_DOMAINS. A CPU no node
    lists, and every CPU of a host without NUMA nodes in sysfs, is in domain 0."""
    nodes: list[tuple[int, list[int]]] = []
    for path in root.glob("node[0-9]*"):
        cpus = sorted(c for c in node_cpus(path) if c < nr_cpus)
        if cpus:
            nodes.append((int(path.name.removeprefix("node")), cpus))
    domains = [0] * nr_cpus
    for index, (_, cpus) in enumerate(sorted(nodes)):
        for cpu in cpus:
            domains[cpu] = index % MAX_DOMAINS
    return domains


def _runs(capacities: list[int]) -> str:
    """'0-3:1024,4-7:512' for the log: a 20-CPU GB10's ten and ten, not twenty numbers."""
    parts: list[str] = []
    start = 0
    for cpu in range(1, len(capacities) + 1):
        if cpu == len(capacities) or capacities[cpu] != capacities[start]:
            span = f"{start}" if cpu - 1 == start else f"{start}-{cpu - 1}"
            parts.append(f"{span}:{capacities[start]}")
            start = cpu
    return ",".join(parts)


def elf_section(elf: bytes, name: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian section."""
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        base = shoff + i * shentsize
        sh_name = struct.unpack_from("<I", elf, base)[0]
        sh_offset, sh_size = struct.unpack_from("<QQ", elf, base + 0x18)
        return sh_name, sh_offset, sh_size

    strtab = header(shstrndx)[1]
    for i in range(shnum):
        sh_name, off, size = header(i)
        end = elf.index(b"\0", strtab + sh_name)
        if elf[strtab + sh_name : end].decode() == name:
            return off, size
    raise BackendError(f"BPF object has no {name} section")


def patch_ops(elf: bytes, *, timeout_ms: int | None = None, name: str | None = None) -> bytes:
    """The object with sched_ext_ops fields changed. libbpf 1.1.2 has no API to edit struct_ops data
    before load, so the value is written into the `.struct_ops` section (which holds only our ops) at the
    offset the object's own BTF gives. `name` exists for tests that need a scheduler that is not ours."""
    probe = libbpf.BpfObject(elf, SCHED_NAME)
    try:
        members = {m: (off, size) for m, off, size in probe.btf().struct_members("sched_ext_ops")}
    finally:
        probe.close()
    sec_off, sec_size = elf_section(elf, ".struct_ops")
    patched = bytearray(elf)
    if timeout_ms is not None:
        field_off, size = members["timeout_ms"]
        if size != 4 or field_off + size > sec_size:
            raise BackendError("unexpected sched_ext_ops.timeout_ms layout in the BPF object")
        struct.pack_into("<I", patched, sec_off + field_off, timeout_ms)
    if name is not None:
        field_off, size = members["name"]
        raw = name.encode()
        if len(raw) >= size or field_off + size > sec_size:
            raise BackendError(f"scheduler name {name!r} does not fit sched_ext_ops.name")
        patched[sec_off + field_off : sec_off + field_off + size] = raw.ljust(size, b"\0")
    return bytes(patched)


class _Lock:
    """An flock held while this process owns the scheduler."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)


def _wait(done: Callable[[str, str], bool], timeout: float, root: Path) -> tuple[str, str]:
    """Poll sched_ext's (state, ops) until `done(state, ops)` or `timeout`; the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        state, ops = sched_ext_state(root)
        if done(state, ops) or time.monotonic() > deadline:
            return state, ops
        time.sleep(0.05)


def wait_state(want: str, timeout: float, root: Path = SCHED_EXT) -> tuple[str, str]:
    return _wait(lambda state, _ops: state == want, timeout, root)


def wait_gone(timeout: float, root: Path = SCHED_EXT) -> tuple[str, str]:
    """Wait until no scheduler of ours holds sched_ext: disabled, or another scheduler enabled (one that
    took the slot after ours was ejected; waiting for "disabled" then lasted the whole timeout)."""
    return _wait(lambda state, ops: state == "disabled" or (state == "enabled" and not _is_ours(ops)),
                 timeout, root)


def detach_stale(root: Path = SCHED_EXT) -> int:
    """Unregister every loaded struct_ops map of ours (left by an agent that died); returns how many."""
    count = 0
    for fd in libbpf.struct_ops_map_fds(OPS_MAP):
        try:
            key = ctypes.c_uint32(0)
            with contextlib.suppress(OSError):
                count += libbpf.map_delete(fd, key)
        finally:
            os.close(fd)
    wait_gone(ATTACH_TIMEOUT_S, root)
    return count


class LoadedScheduler:
    """The scheduler while it is loaded: its maps and the handle that detaches it."""

    def __init__(self, obj: libbpf.BpfObject, link: libbpf.Link, lock: _Lock, flavour: str,
                 cpu_max_passed: bool = False) -> None:
        self.obj = obj
        self.flavour = flavour
        #: the object takes cpu.max from ops.cgroup_set_bandwidth (else from the cgroup's task_group)
        self.cpu_max_passed = cpu_max_passed
        self._link = link
        self._lock = lock
        self.tid_map_fd = obj.map("tid_map").fd
        self.tgid_map_fd = obj.map("tgid_map").fd
        self.capacity = obj.map("tid_map").max_entries
        self._bss_fd = _internal_map(obj, ".bss").fd
        self._counters_fd = obj.map("counters").fd
        self._count_prog = obj.program("gthulhu_count_entries")
        # struct task_ctx is the scheduler's own (not in gthulhu.h): its size and where its `stats` member
        # sits come from the object's BTF, so fields added before `stats` move nothing here
        self._task_ctxs_fd = obj.map("task_ctxs").fd
        # (size, offset of stats), or why not: only `explain` needs it, so it never fails the load
        self._task_ctx_layout: tuple[int, int] | str
        try:
            btf = obj.btf()
            members = {n: off for n, off, _ in btf.struct_members("task_ctx")}
            self._task_ctx_layout = (btf.struct_size("task_ctx"), members["stats"])
        except Exception as exc:
            self._task_ctx_layout = f"the scheduler object's BTF has no task_ctx.stats ({exc!r})"
        # per program, when loaded with LoadSettings.verifier_stats
        self.verifier_insns: dict[str, int | None] = {}

    def counters(self) -> dict[str, int]:
        """The event counters, summed over the CPUs' slots."""
        totals = dict.fromkeys(STAT_COUNTERS, 0)
        for slot in libbpf.percpu_lookup(self._counters_fd, ctypes.c_uint32(0), GthulhuCounters):
            for name in STAT_COUNTERS:
                totals[name] += int(getattr(slot, name))
        return totals

    def task_stats(self, pidfd: int) -> GthulhuTaskStats | None:
        """The per-task counters of the task a pidfd names (task storage maps take a pidfd as their key
        from user space); None when the scheduler holds no context for it."""
        if isinstance(self._task_ctx_layout, str):
            raise OSError(errno.ENOTSUP, self._task_ctx_layout)
        size, start = self._task_ctx_layout
        value = (ctypes.c_uint8 * size)()
        if not libbpf.map_lookup(self._task_ctxs_fd, ctypes.c_int(pidfd), value):
            return None
        return GthulhuTaskStats.from_buffer_copy(bytes(value)[start:start + ctypes.sizeof(GthulhuTaskStats)])

    def bss(self, refresh_counts: bool = True) -> GthulhuBss:
        """Gauges and exit info as the scheduler holds them now."""
        if refresh_counts:
            self._count_prog.test_run()
        value = GthulhuBss()
        libbpf.map_lookup(self._bss_fd, ctypes.c_uint32(0), value)
        return value

    def detach(self) -> None:
        """Unregister the scheduler and free everything (safe to call twice, or after an ejection)."""
        try:
            with contextlib.suppress(OSError):
                self._link.destroy()
            wait_gone(ATTACH_TIMEOUT_S)
        finally:
            self.obj.close()
            self._lock.release()


def _internal_map(obj: libbpf.BpfObject, section: str) -> libbpf.BpfMap:
    try:
        return obj.map(section)
    except OSError:
        return obj.map(SCHED_NAME[:8] + section)


def _is_ours(ops: str) -> bool:
    return ops.split("_")[0] == SCHED_NAME


def take_over_stale(root: Path = SCHED_EXT, lock_path: Path = LOCK_PATH) -> int:
    """Detach a scheduler of ours that no live agent owns (its agent was killed); returns how many maps.

    The agent calls this at start, before it gives up CAP_SYS_ADMIN (gthulhu_node/privileges.py): finding
    the stale instance's map by id is the one step that needs it. Nothing happens when no scheduler or
    another one is loaded (load() refuses that one) or when a live agent holds the lock.
    """
    if not root.is_dir():
        return 0
    state, ops = sched_ext_state(root)
    if state == "disabled" or not _is_ours(ops):
        return 0
    lock = _Lock(lock_path)
    if not lock.try_acquire():
        return 0
    try:
        return _detach_stale_logged(root, ops)
    finally:
        lock.release()


def _detach_stale_logged(root: Path, ops: str) -> int:
    stale = detach_stale(root)
    log.warning("scheduler_stale_detached", ops=ops, maps=stale)
    state, ops = sched_ext_state(root)
    if state != "disabled":
        raise BackendUnavailable(
            f"could not detach the stale scheduler {ops} (state {state}); finding it needs CAP_SYS_ADMIN, "
            "which the agent holds only while it starts: restart the agent"
        )
    return stale


def not_enabled(state: str, ops: str, kind: int, reason: str, msg: str) -> SchedulerRefused:
    """The error for a scheduler that was not enabled once attached, from its exit callback's record: an
    ejection for a host-wide stall (the kernel's watchdog, or an SCX_EXIT_ERROR naming an RCU CPU stall or
    a lockup) is tried again; anything else (our scx_bpf_error, ops.init failing, an invalid dispatch:
    the same on every attempt; an unregistration) is a refusal."""
    message = f"scheduler did not stay enabled (state {state}, ops {ops!r}): {reason} {msg}".strip()
    if kind == SCX_EXIT_ERROR_STALL or (kind == SCX_EXIT_ERROR and HOST_STALL.search(msg)):
        return EjectedWhileLoading(message, kind)
    return SchedulerRefused(message)


class EjectedWhileLoading(SchedulerRefused):
    """The kernel enabled the scheduler and ejected it before the load returned, for a host-wide stall
    (`not_enabled`). It ejects on an RCU CPU stall "that may not be caused by the current BPF
    scheduler" (its own comment), while enabling as while enabled: in the lab (7.3, make test of
    2026-12-07) khugepaged, preempted inside an RCU read-side section beside eight hogs, blocked a grace
    period for 21 s before the enable had finished, and the next load of the same scheduler went well."""

    def __init__(self, message: str, kind: int) -> None:
        super().__init__(message)
        self.kind = kind


def load(settings: LoadSettings, root: Path = SCHED_EXT, lock_path: Path = LOCK_PATH) -> LoadedScheduler:
    """Load and attach the scheduler; raise BackendUnavailable with a clear reason when it cannot be. A
    load the kernel ejected for a host-wide stall is tried again, `LOAD_ATTEMPTS` times in all: a host
    event must not cost the host its scheduler (`backend: auto` would fall back for good), while a
    scheduler that the kernel keeps ejecting still fails after that many loads."""
    attempt = 1
    while True:
        try:
            return _load_once(settings, root, lock_path)
        except EjectedWhileLoading as exc:
            if attempt >= LOAD_ATTEMPTS:
                raise
            log.warning("scheduler_ejected_while_loading", error=str(exc), exit_kind=exc.kind,
                        attempt=attempt, attempts=LOAD_ATTEMPTS, action="loading it again")
            attempt += 1
            time.sleep(LOAD_RETRY_PAUSE_S)


def _load_once(settings: LoadSettings, root: Path, lock_path: Path) -> LoadedScheduler:
    check_support(root)
    lock = _Lock(lock_path)
    if not lock.try_acquire():
        raise BackendUnavailable(f"another gthulhu-node agent holds {lock_path}; it owns the scheduler")
    try:
        state, ops = sched_ext_state(root)
        if state != "disabled":
            if not _is_ours(ops):
                raise BackendUnavailable(
                    f"another sched_ext scheduler ({ops or state}) is loaded; refusing to displace it"
                )
            _detach_stale_logged(root, ops)
        return _load_locked(settings, lock, root)
    except BaseException:
        lock.release()
        raise


def _refused(message: str, messages: Iterable[str]) -> SchedulerRefused:
    """The refusal with libbpf's last words: the line that names the cause (a missing member or kfunc, the
    verifier's complaint) goes into the message, all of them into `details`."""
    details = tuple(messages)
    cause = next((line.removeprefix("libbpf: ") for line in reversed(details)
                  if not line.startswith(("libbpf: failed to load object", "-- END", "processed "))), "")
    return SchedulerRefused(f"{message} ({cause})" if cause else message, details)


def _load_locked(settings: LoadSettings, lock: _Lock, root: Path) -> LoadedScheduler:
    flavour = kfunc_flavour()
    path = object_path(flavour, settings.bpf_object)
    elf = path.read_bytes()
    if settings.watchdog_timeout_ms:
        elf = patch_ops(elf, timeout_ms=settings.watchdog_timeout_ms)
    obj = libbpf.BpfObject(elf, SCHED_NAME)
    try:
        for name in ("tid_map", "tgid_map"):
            obj.map(name).set_max_entries(settings.map_capacity)
        nr_cpus = possible_cpus()
        obj.map("cpu_ctxs").set_max_entries(nr_cpus)
        obj.map("cpu_capacity").set_max_entries(nr_cpus)
        obj.map("cpu_domain").set_max_entries(nr_cpus)
        capacities = cpu_capacities(nr_cpus)
        domains = cpu_domains(nr_cpus) if settings.fair_queues == "per_node" else [0] * nr_cpus
        rodata = _internal_map(obj, ".rodata")
        if len(rodata.initial_value()) != ctypes.sizeof(GthulhuSettings):
            raise BackendUnavailable(".rodata of the BPF object does not match struct gthulhu_settings")
        if len(_internal_map(obj, ".bss").initial_value()) != ctypes.sizeof(GthulhuBss):
            raise BackendUnavailable(".bss of the BPF object does not match struct gthulhu_bss")
        values = GthulhuSettings(
            default_slice_ns=settings.default_slice_ns,
            boost_window_ns=settings.boost_window_ns,
            boost_share_percent=settings.boost_share_percent,
            agent_tgid=settings.agent_tgid,
            nr_cpus=nr_cpus,
            asym_capacity=int(len(set(capacities)) > 1),
            nr_domains=max(domains) + 1,
        )
        rodata.set_initial_value(bytes(values))
        for prog in SLEEPABLE_PROGRAMS:
            obj.program(prog).add_flags(libbpf.BPF_F_SLEEPABLE)
        recorded = obj.programs() if settings.verifier_stats else []
        for program in recorded:
            program.record_stats()
        with libbpf.captured_messages() as messages:
            try:
                obj.load()
            except OSError as exc:
                raise _refused(f"the kernel refused the scheduler ({path.name}): {exc}", messages) from exc
            if values.asym_capacity:  # read only then: a symmetric host's map stays zeroes
                caps_fd = obj.map("cpu_capacity").fd
                for cpu, capacity in enumerate(capacities):
                    libbpf.map_update(caps_fd, ctypes.c_uint32(cpu), ctypes.c_uint32(capacity))
            if values.nr_domains > 1:  # likewise: one domain needs no map
                domain_fd = obj.map("cpu_domain").fd
                for cpu, domain in enumerate(domains):
                    libbpf.map_update(domain_fd, ctypes.c_uint32(cpu), ctypes.c_uint32(domain))
            try:
                link = obj.map(OPS_MAP).attach_struct_ops()
            except OSError as exc:
                raise _refused(f"attaching the scheduler failed: {exc}", messages) from exc
        # the attach returns once the kernel enabled it: "disabled" now is an ejection, not a wait
        state, ops = _wait(lambda state, _ops: state in ("enabled", "disabled"), ATTACH_TIMEOUT_S, root)
        loaded = LoadedScheduler(obj, link, lock, flavour, _sets_bandwidth_op(path, flavour))
        loaded.verifier_insns = {p.name: p.verified_insns() for p in recorded}
        if state != "enabled" or ops != SCHED_NAME:
            info = loaded.bss(refresh_counts=False).exit_info
            loaded.detach()
            raise not_enabled(state, ops, int(info.kind), info.reason.decode(errors="replace"),
                              info.msg.decode(errors="replace"))
    except BaseException:
        obj.close()
        raise
    log.info(
        "scheduler_loaded",
        ops=ops,
        kfuncs=flavour,
        object=str(path),
        capacity=settings.map_capacity,
        cpus=nr_cpus,
        capacities=_runs(capacities) if len(set(capacities)) > 1 else "uniform",
        fair_queues=values.nr_domains,
        timeout_ms=settings.watchdog_timeout_ms,
    )
    return loaded
