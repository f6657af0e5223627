/* SPDX-License-Identifier: GPL-2.0 */
/*
 * Layouts shared by the gthulhu scheduler (gthulhu.bpf.c and its parts) and the agent
 * (gthulhu_node/scheduler/layout.py): every struct here is a map value, .rodata or .bss the agent reads or
 * writes, and nothing else is. Python never knows an offset by hand: tests/unit/test_scheduler_header.py
 * checks its ctypes mirrors against this header, tests/host/test_scheduler_layout.py against the BTF of
 * every compiled object. Only fixed-size types; every struct is padded explicitly.
 */
#ifndef GTHULHU_H
#define GTHULHU_H

#ifndef __VMLINUX_H__
typedef unsigned int u32;
typedef int s32;
typedef unsigned long long u64;
typedef long long s64;
#endif

#define GTHULHU_PRIORITY_MAX 20
#define GTHULHU_EXIT_REASON_LEN 128
#define GTHULHU_EXIT_MSG_LEN 1024

/* Value of both strategy maps (key: u32 TID in tid_map, u32 TGID in tgid_map). */
struct gthulhu_entry {
	u64 start_time; /* clock ticks since boot of the task the key names (/proc/<pid>/stat field 22) */
	u64 slice_ns;   /* 0: the default slice */
	u32 priority;   /* the contract's: 0 no boost; 1-9 preempt tier, 10-20 head start; lower is stronger */
	u32 pad;
};

/* Fixed before load (.rodata). */
struct gthulhu_settings {
	u64 default_slice_ns;
	u64 boost_window_ns;
	u32 boost_share_percent; /* of one CPU per task, and of all CPUs for all boosted tasks together */
	u32 agent_tgid;          /* the agent's own process: boosted above every intent (0: off) */
	u32 nr_cpus;             /* possible CPUs (nr_cpu_ids): the per-CPU array has this many entries */
	u32 asym_capacity;       /* CPUs differ in capacity (cpu_capacity map): boosted tasks seek the big ones */
	u32 nr_domains;          /* fair queues, one per NUMA node (cpu_domain map): 1 on a single-node host */
	u32 pad;
};

/*
 * Events since load, counted per CPU (map `counters`, one slot per possible CPU): a count on the scheduling
 * path never writes a cache line another CPU writes. The agent sums the slots.
 */
struct gthulhu_counters {
	u64 tid_hits;           /* lookups answered by a TID entry */
	u64 tgid_hits;          /* lookups answered by a TGID entry */
	u64 misses;             /* lookups with no (valid) entry: fair scheduling */
	u64 stale_entries;      /* entries whose start time did not match the task: ignored and deleted */
	u64 boosted_dispatches; /* boosted tasks queued to run */
	u64 fair_dispatches;    /* unboosted tasks queued to run */
	u64 direct_dispatches;  /* waking tasks that found an idle CPU */
	u64 preemptions;        /* a waking boosted task preempted an unboosted one */
	u64 fair_preemptions;   /* wake-ups (and cut runs) that preempted by the unboosted wake-up rule */
	u64 demotions;          /* a boosted task exceeded its share and runs unboosted until the window ends */
	u64 throttled_windows;  /* a CPU's boosted run time exceeded its share: it serves the reserve first */
	u64 exit_deleted_tid;   /* TID entries removed because their task exited */
	u64 exit_deleted_tgid;  /* TGID entries removed because their whole process exited */
	u64 agent_boosts;       /* the agent's own threads queued as boosted */
	u64 reserve_boosted;    /* boosted tasks that were served a CPU's reserve turn (behind the fair pool) */
	u64 hotplug_events;     /* CPUs that went online or offline while the scheduler ran */
	u64 bw_parked;          /* tasks held back: their cgroup or an ancestor used its cpu.max quota */
	u64 bw_released;        /* parked tasks moved back to their queue */
	u64 bw_stops;           /* runs ended by the stop timer when their cgroup's budget ran out */
	u64 bw_stops_stale;     /* stop timers that fired after their run had ended (nothing done) */
	u64 capacity_placements; /* boosted tasks sent to a more capable CPU (heterogeneous CPUs only) */
	u64 cgroups_untracked;  /* cgroups not tracked (map full) or whose cpu.max is not found */
	u64 domain_pulls;       /* unboosted tasks a CPU took from a more crowded node's fair queue */
	u64 domain_steals;      /* unboosted tasks a CPU took from another node's queue, its own being empty */
	u64 victim_scans;       /* boosted wakers that found no unboosted CPU and scanned for a lesser boost */
	u64 fair_wakeups_queued; /* unboosted wake-ups (and cut runs) the wake-up rule found no CPU for */
	u64 fair_wakeups_held;  /* those that found one while boosted tasks waited in BOOST_DSQ (they go first) */
	u64 fair_preemptions_credit; /* of fair_preemptions, wake-ups only the crowded-group credit allowed */
	u64 bound_steers;       /* boosted wakers sent off a CPU where a task bound to it waited for boosted work */
};

/* Current sizes (.bss), refreshed by the count_entries program and on each tick of CPU 0. */
struct gthulhu_gauges {
	u64 live_tid_entries;   /* entries in tid_map */
	u64 live_tgid_entries;  /* entries in tgid_map */
};

/* Why the kernel stopped the scheduler, copied by ops.exit (kind: enum scx_exit_kind, 0 while running). */
struct gthulhu_exit_info {
	s64 kind;
	s64 exit_code;
	char reason[GTHULHU_EXIT_REASON_LEN];
	char msg[GTHULHU_EXIT_MSG_LEN];
};

/*
 * What the scheduler did with one task since it was loaded (a member of its task_ctx, found by BTF; task
 * storage map `task_ctxs`): `explain` reads it back with a pidfd as the key.
 */
struct gthulhu_task_stats {
	u64 boosted_runs; /* runs started boosted: preempt tier, or head start (ops.running) */
	u64 demotions;    /* times the guard demoted it: over its share of a boost window */
	u64 preemptions;  /* times it was put on a busy CPU to preempt its task: waking, re-placed, moved */
};

/* The whole .bss: one variable, so its layout is this struct's. */
struct gthulhu_bss {
	struct gthulhu_gauges gauges;
	struct gthulhu_exit_info exit_info;
};

#endif /* GTHULHU_H */
