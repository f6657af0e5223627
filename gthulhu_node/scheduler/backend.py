"""SchedExtBackend: the agent's map writer for the gthulhu sched_ext scheduler.

Entries go into two BPF hash maps (TID-keyed and TGID-keyed) whose values carry the task's start time;
the scheduler ignores and deletes an entry whose start time is not its task's, and deletes the entries of
exiting tasks itself. One race is left to the writer: a write landing after the task's exit. So every
upsert is followed by a check of /proc: if the task is gone (or a zombie, or its id now names another task),
the entry is deleted again and the key reported as TaskGoneError. Either the task was alive at the check,
and its later exit deletes the entry, or it was not, and the check does: no entry outlives its task.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Protocol

import structlog

from gthulhu_node.backends.base import (
    ApplyResult,
    Backend,
    BackendError,
    BackendHealth,
    BackendState,
    BackendUnavailable,
    Entry,
    EntryKey,
    KeyKind,
    MapFullError,
    TaskGoneError,
    check_entry,
)
from gthulhu_node.scheduler import libbpf
from gthulhu_node.scheduler.layout import STAT_GAUGES, TASK_STATS, GthulhuEntry
from gthulhu_node.scheduler.loader import (
    SCHED_EXT,
    SCHED_NAME,
    LoadedScheduler,
    LoadSettings,
    cpu_max_source,
    enforces_cpu_max,
    load,
    sched_ext_state,
    wait_state,
)
from gthulhu_node.tasks.procfs import parse_stat, read_stat

log = structlog.get_logger(__name__)

# pidfd_open's flag for a thread that leads no process (Linux 6.9+); the kernel defines it as O_EXCL
PIDFD_THREAD = getattr(os, "PIDFD_THREAD", os.O_EXCL)


def task_start_time(pid: int, proc: Path = Path("/proc")) -> int | None:
    """Field 22 of the task's own stat, or None when it is gone or a zombie (its exit already ran)."""
    try:
        data = read_stat(pid, pid, proc)
    except OSError:
        return None
    if data is None or data[data.rindex(b")") + 2 :][:1] in (b"Z", b"X"):
        return None
    return parse_stat(data)[1]


class SchedulerSettings(Protocol):
    """The load-time settings this backend reads: config.SchedulerConfig has them, and so has the
    loader's LoadSettings (the defaults). A protocol, so the scheduler never imports the configuration."""

    @property
    def bpf_object(self) -> Path | None: ...
    @property
    def default_slice_ns(self) -> int: ...
    @property
    def boost_share_percent(self) -> int: ...
    @property
    def boost_window_ns(self) -> int: ...
    @property
    def map_capacity(self) -> int: ...
    @property
    def watchdog_timeout_ms(self) -> int: ...
    @property
    def fair_queues(self) -> str: ...


class SchedExtBackend(Backend):
    """Strategies as entries of the gthulhu scheduler's maps, in the kernel."""

    name = "sched_ext"

    def __init__(
        self,
        config: SchedulerSettings | None = None,
        *,
        protect_agent: bool = True,
        proc: Path = Path("/proc"),
        sched_ext_root: Path = SCHED_EXT,
    ) -> None:
        cfg: SchedulerSettings = config if config is not None else LoadSettings()
        self._settings = LoadSettings(
            default_slice_ns=cfg.default_slice_ns,
            boost_share_percent=cfg.boost_share_percent,
            boost_window_ns=cfg.boost_window_ns,
            map_capacity=cfg.map_capacity,
            watchdog_timeout_ms=cfg.watchdog_timeout_ms,
            agent_tgid=os.getpid() if protect_agent else 0,
            bpf_object=cfg.bpf_object,
            fair_queues=cfg.fair_queues,
        )
        self._proc = proc
        self._root = sched_ext_root
        self._sched: LoadedScheduler | None = None
        self._ejected_reason = ""

    @property
    def capacity(self) -> int:
        return self._settings.map_capacity

    @property
    def enforces_cpu_max(self) -> bool:
        """Whether the loaded object enforces cpu.max (every one does; `cpu_max_source` says from where).
        For every cgroup only while its counter `cgroups_untracked` is 0, which the Agent reads from the
        engine's frame: this property is read on any thread, and reading the scheduler's maps here could
        race the engine thread's detach."""
        sched = self._sched  # once: the engine thread may drop it meanwhile
        return sched is not None and enforces_cpu_max(sched.flavour)

    @property
    def cpu_max_source(self) -> str:
        """Where the loaded object takes cpu.max from (status): the kernel's callback or task_group."""
        sched = self._sched
        return cpu_max_source(sched.cpu_max_passed) if sched is not None else ""

    def start(self) -> None:
        if self._sched is not None:
            return
        self._sched = load(self._settings, self._root)
        self._ejected_reason = ""

    def stop(self) -> None:
        if self._sched is None:
            return
        sched, self._sched = self._sched, None
        sched.detach()
        log.info("scheduler_unloaded")

    def _loaded(self) -> LoadedScheduler:
        if self._sched is None:
            raise BackendUnavailable("the sched_ext scheduler is not loaded")
        return self._sched

    def _fd(self, key: EntryKey) -> int:
        sched = self._loaded()
        return sched.tid_map_fd if key.kind is KeyKind.TID else sched.tgid_map_fd

    def apply(self, upserts: Mapping[EntryKey, Entry], deletes: Iterable[EntryKey]) -> ApplyResult:
        for key, entry in upserts.items():
            check_entry(key, entry)
        delete_keys = list(deletes)
        self._loaded()
        result = ApplyResult()
        written: list[tuple[EntryKey, Entry]] = []
        for key, entry in upserts.items():
            error = self._write(key, entry)
            if error is None:
                written.append((key, entry))
            else:
                result.failed[key] = error
        for key, entry in written:
            if task_start_time(key.id, self._proc) == entry.start_time:
                result.upserted += 1
                continue
            self._delete_if(key, entry.start_time)
            result.failed[key] = TaskGoneError(f"{key}: the task exited (or its id was reused)")
        for key in delete_keys:
            try:
                libbpf.map_delete(self._fd(key), ctypes.c_uint32(key.id))
                result.deleted += 1
            except OSError as exc:
                result.failed[key] = BackendError(f"{key}: delete failed: {exc.strerror}")
        return result

    def _write(self, key: EntryKey, entry: Entry) -> BackendError | None:
        value = GthulhuEntry(start_time=entry.start_time, slice_ns=entry.slice_ns, priority=entry.priority)
        try:
            libbpf.map_update(self._fd(key), ctypes.c_uint32(key.id), value)
        except OSError as exc:
            if exc.errno == errno.E2BIG:
                return MapFullError(f"{key}: the {key.kind.value} map is full ({self.capacity} entries)")
            return BackendError(f"{key}: write failed: {exc.strerror}")
        return None

    def _delete_if(self, key: EntryKey, start_time: int) -> None:
        """Delete the entry only if it is still the one written (another write may have replaced it)."""
        value = GthulhuEntry()
        fd = self._fd(key)
        if libbpf.map_lookup(fd, ctypes.c_uint32(key.id), value) and value.start_time == start_time:
            libbpf.map_delete(fd, ctypes.c_uint32(key.id))

    def read_back(self) -> dict[EntryKey, Entry]:
        sched = self._loaded()
        out: dict[EntryKey, Entry] = {}
        for kind, fd in ((KeyKind.TID, sched.tid_map_fd), (KeyKind.TGID, sched.tgid_map_fd)):
            for key in list(libbpf.map_keys(fd, ctypes.c_uint32)):
                value = GthulhuEntry()
                if libbpf.map_lookup(fd, ctypes.c_uint32(key), value):
                    out[EntryKey(kind, key)] = Entry(value.priority, value.slice_ns, value.start_time)
        return out

    def read_keys(self, keys: Iterable[EntryKey]) -> dict[EntryKey, Entry]:
        """One map lookup per key (read_back walks both maps)."""
        out: dict[EntryKey, Entry] = {}
        for key in keys:
            value = GthulhuEntry()
            if libbpf.map_lookup(self._fd(key), ctypes.c_uint32(key.id), value):
                out[key] = Entry(value.priority, value.slice_ns, value.start_time)
        return out

    def task_stats(self, threads: Iterable[tuple[int, int, int]]) -> dict[int, dict[str, int] | str]:
        """Each thread's counters from its task_ctx (task storage, looked up with a pidfd as the key)."""
        sched = self._loaded()
        return {tid: _task_stats(sched, tid, tgid, start, self._proc) for tid, tgid, start in threads}

    @property
    def boosted_tgid(self) -> int:
        """The agent's own process while the scheduler protects it (`protect_agent`): lookup_strategy
        gives its threads AGENT_RANK when neither map holds an entry for them."""
        return self._settings.agent_tgid

    def health(self) -> BackendHealth:
        if self._sched is None:
            return BackendHealth(BackendState.STOPPED, self._ejected_reason)
        try:
            state, ops = sched_ext_state(self._root)
        except OSError as exc:
            state, ops = f"unreadable ({exc.strerror})", ""
        if state == "enabled" and ops == SCHED_NAME:
            return BackendHealth(BackendState.RUNNING)
        if state == "disabling":
            # the kernel is tearing it down; the exit callback records the reason before `disabled`
            state, ops = wait_state("disabled", 2.0, self._root)
        info = self._sched.bss(refresh_counts=False).exit_info
        reason = " ".join(
            part
            for part in (info.reason.decode(errors="replace"), info.msg.decode(errors="replace"))
            if part
        )
        self._ejected_reason = reason or f"sched_ext state {state}, ops {ops!r}"
        return BackendHealth(BackendState.EJECTED, self._ejected_reason)

    def exit_kind(self) -> int:
        """The kernel's enum scx_exit_kind from the scheduler's exit callback (0 while it runs)."""
        return int(self._loaded().bss(refresh_counts=False).exit_info.kind)

    def counters(self) -> dict[str, int]:
        if self._sched is None:
            return {}
        return self._sched.counters()

    def gauges(self) -> dict[str, int]:
        """Live entries per map, counted exactly now (docs/scheduler.md, "Entries")."""
        if self._sched is None:
            return {}
        gauges = self._sched.bss().gauges
        return {name: int(getattr(gauges, name)) for name in STAT_GAUGES}


def _task_stats(sched: LoadedScheduler, tid: int, tgid: int, start_time: int, proc: Path = Path("/proc")
                ) -> dict[str, int] | str:
    """One thread's counters, or why they cannot be read: a pidfd names a thread that leads no process
    only with PIDFD_THREAD, which older kernels refuse (EINVAL). The pidfd is opened by TID, so the
    thread's start time is checked once it is open: if the caller's thread exited and the kernel gave its
    TID to another one before pidfd_open, the pidfd names that other thread, and its start time shows it
    (after the check the pidfd holds the thread it names, whatever happens to the TID)."""
    flags = 0 if tid == tgid else PIDFD_THREAD
    try:
        pidfd = os.pidfd_open(tid, flags)
    except OSError as exc:
        if exc.errno == errno.EINVAL and flags:
            return ("not available: this kernel cannot open a pidfd for a thread that leads no process "
                    "(PIDFD_THREAD needs Linux 6.9+)")
        if exc.errno == errno.ESRCH:
            return "not available: the thread exited"
        return f"not available: pidfd_open({tid}): {exc.strerror}"
    try:
        if task_start_time(tid, proc) != start_time:
            return "not available: the thread exited"
        stats = sched.task_stats(pidfd)
    except OSError as exc:
        return f"not available: task_ctxs lookup: {exc}"
    finally:
        os.close(pidfd)
    if stats is None:
        return "not available: the scheduler holds no context for this thread"
    return {name: int(getattr(stats, name)) for name in TASK_STATS}
