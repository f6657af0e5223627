"""Which cgroups on this node have a CPU limit (cgroup v2 `cpu.max`), and telling the operator whether it
holds.

Why: while our sched_ext scheduler runs, the kernel's CFS bandwidth control does not apply, so the
scheduler enforces `cpu.max` itself (every Kubernetes CPU limit, every `docker run --cpus`): from Linux 6.17
as the kernel passes it, before from the cgroup's task_group, where the kernel keeps it
(docs/scheduler.md, "cpu.max"). It can miss a cgroup: its cgroup map full, or a kernel that keeps no
`cpu.max` there. The agent counts the limited cgroups so status, metrics and the log say whether the limits
hold before an operator relies on one.

The walk is bounded (`max_cgroups`) and tolerates cgroups that vanish while it runs (ENOENT, ENODEV). A
cgroup without `cpu.max` (the cpu controller not enabled for it, the root) has no limit. Anything else that
cannot be read or parsed is counted, never read as "no limit"; a root that cannot be read, or is not a
cgroup v2 hierarchy (cgroup v1 keeps CPU limits in `cpu.cfs_quota_us`, not counted here), makes the count
unknown (None), never 0.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import structlog

from gthulhu_node.lifecycle import Health
from gthulhu_node.workers import Flag, WorkerThread, WorkQueue

log = structlog.get_logger(__name__)

DEFAULT_ROOT = Path("/sys/fs/cgroup")
MAX_CGROUPS = 100_000
EXAMPLES = 3
# The cgroup (or its cpu.max) went away between listing and reading: normal on a busy node.
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV})


@dataclass(frozen=True, slots=True)
class CpuMaxScan:
    """One walk of the cgroup tree. `limited` is None when the root could not be read (`error` says why)."""

    limited: int | None
    visited: int = 0
    examples: tuple[str, ...] = ()  # up to EXAMPLES limited cgroups, relative to the root
    errors: int = 0  # cgroups whose listing or cpu.max could not be read or parsed
    first_error: str = ""
    capped: bool = False  # the walk stopped at max_cgroups: `limited` is a lower bound
    error: str = ""


def parse_cpu_max(text: str) -> bool:
    """True when `cpu.max` ("QUOTA PERIOD" or "max PERIOD") sets a quota. Raises ValueError otherwise."""
    fields = text.split()
    if len(fields) != 2 or not fields[1].isdigit() or not (fields[0] == "max" or fields[0].isdigit()):
        raise ValueError(f"not 'QUOTA PERIOD' or 'max PERIOD': {text.strip()[:60]!r}")
    return fields[0] != "max"


def scan_cpu_max(root: Path = DEFAULT_ROOT, *, max_cgroups: int = MAX_CGROUPS) -> CpuMaxScan:
    """Walk the cgroup v2 tree under `root` and count the cgroups whose `cpu.max` sets a quota."""
    try:
        if not os.path.isfile(root / "cgroup.controllers"):
            return CpuMaxScan(None, error=f"{root} is not a cgroup v2 hierarchy (no cgroup.controllers; "
                                          "cgroup v1 CPU limits, cpu.cfs_quota_us, are not counted)")
        top = list(os.scandir(root))
    except OSError as exc:
        return CpuMaxScan(None, error=f"{root}: {exc.strerror or exc}")
    limited, visited, errors = 0, 0, 0
    examples: list[str] = []
    first_error = ""
    pending = [e for e in top if _is_dir(e)]
    while pending:
        if visited >= max_cgroups:
            return CpuMaxScan(limited, visited, tuple(examples), errors, first_error, capped=True)
        entry = pending.pop()
        visited += 1
        path = Path(entry.path)
        try:
            with open(path / "cpu.max") as f:
                has_quota = parse_cpu_max(f.read())
        except OSError as exc:
            has_quota = False
            if exc.errno not in _GONE_ERRNOS:
                errors += 1
                first_error = first_error or f"{path}/cpu.max: {exc.strerror or exc}"
        except ValueError as exc:
            has_quota = False
            errors += 1
            first_error = first_error or f"{path}/cpu.max: {exc}"
        if has_quota:
            limited += 1
            if len(examples) < EXAMPLES:
                examples.append(str(path.relative_to(root)))
        try:
            pending.extend(e for e in os.scandir(path) if _is_dir(e))
        except OSError as exc:
            if exc.errno not in _GONE_ERRNOS:
                errors += 1
                first_error = first_error or f"{path}: {exc.strerror or exc}"
    return CpuMaxScan(limited, visited, tuple(examples), errors, first_error)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False  # gone between listing and looking


def describe(scan: CpuMaxScan | None, enforced: bool, backend: str, by_scheduler: str = "") -> str:
    """The status line: how many cgroups are limited and whether the limit holds with this backend, and
    who holds it: our scheduler (`by_scheduler` says where it takes cpu.max from, "" when it is not what
    holds it) or the kernel (any other backend, or the sched_ext backend while its scheduler is not
    running)."""
    if scan is None:
        return "not scanned yet"
    if scan.limited is None:
        return f"unknown: the cgroup tree could not be read ({scan.error})"
    count = f"at least {scan.limited}" if scan.capped else str(scan.limited)
    text = f"{count} cgroups limited"
    if enforced and by_scheduler:
        text += f"; enforced by the sched_ext scheduler (cpu.max {by_scheduler})"
    elif enforced and backend == "sched_ext":
        text += "; enforced by the kernel while the sched_ext scheduler is not running"
    elif enforced:
        text += f"; enforced by the kernel ({backend} backend)"
    else:
        text += f"; {'may NOT be' if scan.limited else 'a cpu.max set now may NOT be'} enforced while the " \
                "sched_ext scheduler runs (cgroups_untracked > 0: the cgroup map was full or the kernel " \
                "keeps no cpu.max where the scheduler reads it; docs/scheduler.md)"
    if scan.capped:
        text += f"; walk stopped at {scan.visited} cgroups"
    if scan.errors:
        text += f"; {scan.errors} cgroups unreadable (first: {scan.first_error})"
    return text


@dataclass(frozen=True, slots=True)
class CgroupLimitsStats:
    """What metrics read (metrics.py owns the names)."""

    limited: int | None = None  # None: not scanned yet, or the root could not be read
    enforced: bool = True
    capped: bool = False
    errors: int = 0  # scans whose root could not be read, plus cgroups that could not be read: monotonic
    scans: int = 0


class CpuMaxWatch:
    """A component: scans at start, then every `interval_s` on its own thread (`cgroup-limits`), never
    on the engine's.

    `enforced()` says whether the running backend leaves `cpu.max` to the kernel. While it does not, one
    warning `cgroup_cpu_max_not_enforced` is logged at the first scan that finds limited cgroups, and
    again only after a scan found none (the count went from 0 to more)."""

    name = "cgroup-limits"

    def __init__(self, root: Path, interval_s: float, enforced: Callable[[], bool],
                 *, max_cgroups: int = MAX_CGROUPS) -> None:
        self.root = root
        self.interval_s = interval_s
        self.enforced = enforced
        self.max_cgroups = max_cgroups
        self._lock = threading.Lock()
        self._last: CpuMaxScan | None = None
        self._errors = 0
        self._scans = 0
        self._warned = False
        self._rescans = WorkerThread("cgroup-limits", self._run)

    def start(self) -> None:
        """The first scan here, so the first status and the start's log already carry it (it is bounded
        by max_cgroups); the rescans on the thread."""
        self.scan()
        self._rescans.start()

    def stop(self) -> None:
        self._rescans.stop()

    def health(self) -> Health:
        last = self.latest()
        if last is not None and last.limited is None:
            return Health(False, last.error)
        return Health(True)

    def latest(self) -> CpuMaxScan | None:
        with self._lock:
            return self._last

    def stats(self) -> CgroupLimitsStats:
        with self._lock:
            last, errors, scans = self._last, self._errors, self._scans
        return CgroupLimitsStats(None if last is None else last.limited, self.enforced(),
                                 last is not None and last.capped, errors, scans)

    def _run(self, stop: Flag) -> None:
        """The `cgroup-limits` thread: a rescan every interval until stopped."""
        WorkQueue(period_s=self.interval_s).serve(stop, self._rescan)

    def _rescan(self) -> None:
        try:
            self.scan()
        except Exception:
            log.exception("cgroup_scan_failed")

    def scan(self) -> CpuMaxScan:
        """One walk now (the thread's work; tests call it directly), then the warning if one is due."""
        started = time.monotonic()
        result = scan_cpu_max(self.root, max_cgroups=self.max_cgroups)
        with self._lock:
            previous, self._last = self._last, result
            self._scans += 1
            self._errors += result.errors + (result.limited is None)
        if result.limited is None:
            if previous is None or previous.error != result.error:  # once, not every interval
                log.error("cgroup_scan_unreadable", root=str(self.root), error=result.error)
            return result
        if result.errors:
            log.warning("cgroup_scan_errors", errors=result.errors, first=result.first_error)
        if result.capped:
            log.warning("cgroup_scan_capped", visited=result.visited, limited_at_least=result.limited)
        if result.limited == 0:
            self._warned = False
        elif not self._warned and not self.enforced():
            self._warned = True
            log.warning("cgroup_cpu_max_not_enforced", limited=result.limited, examples=list(result.examples),
                        capped=result.capped, scan_s=round(time.monotonic() - started, 3),
                        action="the sched_ext scheduler could not track every cgroup (its counter "
                               "cgroups_untracked): cgroup cpu.max (CPU limits of containers) may not hold; "
                               "see docs/scheduler.md")
        return result
