"""ctypes mirrors of bpf/gthulhu.h, the one header the scheduler and the agent share.

tests/unit/test_scheduler_header.py compares every struct here, field by field (offset, size), with the
header as the compiler lays it out, and tests/host/test_scheduler_layout.py with the BTF of every compiled
object, so an edit on one side only fails the tests instead of corrupting maps.
"""

from __future__ import annotations

import ctypes

EXIT_REASON_LEN = 128
EXIT_MSG_LEN = 1024


class GthulhuEntry(ctypes.Structure):
    _fields_ = [
        ("start_time", ctypes.c_uint64),
        ("slice_ns", ctypes.c_uint64),
        ("priority", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


class GthulhuSettings(ctypes.Structure):
    _fields_ = [
        ("default_slice_ns", ctypes.c_uint64),
        ("boost_window_ns", ctypes.c_uint64),
        ("boost_share_percent", ctypes.c_uint32),
        ("agent_tgid", ctypes.c_uint32),
        ("nr_cpus", ctypes.c_uint32),
        ("asym_capacity", ctypes.c_uint32),
        ("nr_domains", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
    ]


#: events since load, counted per CPU in the scheduler's `counters` map (SchedExtBackend.counters() sums them)
STAT_COUNTERS = (
    "tid_hits",
    "tgid_hits",
    "misses",
    "stale_entries",
    "boosted_dispatches",
    "fair_dispatches",
    "direct_dispatches",
    "preemptions",
    "fair_preemptions",
    "demotions",
    "throttled_windows",
    "exit_deleted_tid",
    "exit_deleted_tgid",
    "agent_boosts",
    "reserve_boosted",
    "hotplug_events",
    "bw_parked",
    "bw_released",
    "bw_stops",
    "bw_stops_stale",
    "capacity_placements",
    "cgroups_untracked",
    "domain_pulls",
    "domain_steals",
    "victim_scans",
    "fair_wakeups_queued",
    "fair_wakeups_held",
    "fair_preemptions_credit",
    "bound_steers",
)
#: current sizes, not events: they go down as well as up (.bss, exported as gauges, SchedExtBackend.gauges())
STAT_GAUGES = ("live_tid_entries", "live_tgid_entries")


class GthulhuCounters(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in STAT_COUNTERS]


class GthulhuGauges(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in STAT_GAUGES]


#: what the scheduler did with one task (the `stats` member of its task_ctx in the task storage map
#: `task_ctxs`; SchedExtBackend.task_stats() reads it back)
TASK_STATS = ("boosted_runs", "demotions", "preemptions")


class GthulhuTaskStats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in TASK_STATS]


class GthulhuExitInfo(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("exit_code", ctypes.c_int64),
        ("reason", ctypes.c_char * EXIT_REASON_LEN),
        ("msg", ctypes.c_char * EXIT_MSG_LEN),
    ]


class GthulhuBss(ctypes.Structure):
    _fields_ = [("gauges", GthulhuGauges), ("exit_info", GthulhuExitInfo)]


#: struct name in the BPF object -> its mirror (what the layout test walks)
MIRRORS: dict[str, type[ctypes.Structure]] = {
    "gthulhu_entry": GthulhuEntry,
    "gthulhu_settings": GthulhuSettings,
    "gthulhu_counters": GthulhuCounters,
    "gthulhu_gauges": GthulhuGauges,
    "gthulhu_task_stats": GthulhuTaskStats,
    "gthulhu_exit_info": GthulhuExitInfo,
    "gthulhu_bss": GthulhuBss,
}


def fields_of(struct: type[ctypes.Structure]) -> list[tuple[str, int, int]]:
    """(name, byte offset, byte size) of each field, the same shape the BTF reader returns."""
    out = []
    for name, ctype, *_ in struct._fields_:
        descr = getattr(struct, name)
        out.append((name, int(descr.offset), ctypes.sizeof(ctype)))
    return out
