/* SPDX-License-Identifier: GPL-2.0 */
/*
 * The scheduler's state, which every part reads (part of the one compilation unit gthulhu.bpf.c): the
 * queues and limits, the settings the loader writes, the counters, the two clocks, the strategy maps the
 * agent writes, and the per-task, per-cgroup and per-CPU contexts; then the small helpers on them that
 * more than one part uses. The layouts shared with the agent are in gthulhu.h.
 */
#ifndef GTHULHU_STATE_BPF_H
#define GTHULHU_STATE_BPF_H

#define BOOST_DSQ 1
#define THROTTLED_DSQ 3
/*
 * Unboosted tasks queue per domain, a NUMA node (nr_domains(), cpu_domain): domain d's queue is
 * FAIR_DSQ_BASE + d. One global queue made every enqueue and dispatch on every CPU take the same lock.
 */
#define FAIR_DSQ_BASE 16
#define MAX_DOMAINS 64
#define USER_HZ 100
#define PF_EXITING 0x00000004
#define PF_KTHREAD 0x00200000
/*
 * The contract's priority, as an entry holds it and an operator reads it back (upstream Gthulhu's kernel-mode
 * direction: the lower the number, the stronger): 0 no boost; 1-PREEMPT_TIER_LAST the preempt tier, 1 the
 * strongest; PREEMPT_TIER_LAST+1 to GTHULHU_PRIORITY_MAX the head-start tier, 10 the most. strength_of
 * converts it once, where an entry is read; nothing else in the scheduler sees the contract's number.
 */
#define PREEMPT_TIER_LAST 9
/*
 * Inside the scheduler a preempt-tier task carries a rank, the higher the stronger (level 1: 20, level 9:
 * 12; 0: not in the preempt tier), so every comparison of priorities is one of ranks (weaker()).
 * The agent's own threads rank above every intent.
 */
#define AGENT_RANK (GTHULHU_PRIORITY_MAX + 1)
/* Deadline distance between adjacent ranks in BOOST_DSQ: level 9 waits at most 16 ms more than level 1. */
#define BOOST_STEP_NS 2000000ULL
/*
 * Boosted tasks a reserve turn looks at: the queue is in deadline order, so the starved ones are in front.
 * Such bounds are kept by a numbers iterator beside the DSQ iterator, never by a counter: the verifier
 * tracks a counter exactly, so it walks the loop body once per value (dispatch took 495k of its 1M
 * instructions and 6.7 of the scheduler's 8 s load under TCG that way), and an iterator's loop converges.
 */
#define RESERVE_SCAN 16

const volatile struct gthulhu_settings settings = {
	.default_slice_ns = 5000000,
	.boost_window_ns = 100000000,
	.boost_share_percent = 75,
	.nr_cpus = 1,
	.nr_domains = 1,
};

struct gthulhu_bss bss;

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, struct gthulhu_counters);
} counters SEC(".maps");

/* Scheduler-internal state, not part of the layout shared with Python. */
static u64 vtime_now SEC(".data") = 0;
/*
 * The reserve's clock: the key of the last task a reserve turn served (the least one waiting), never
 * going back. vtime_now moves only with unboosted runs; with nothing but boosted tasks runnable it stands
 * still, and every boosted `served` would sit at the same lead past it, leaving the reserve to deadline
 * order instead of to the task served least.
 */
static u64 reserve_now SEC(".data") = 0;

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536); /* set by the loader (config.scheduler.map_capacity) */
	__type(key, u32);
	__type(value, struct gthulhu_entry);
} tid_map SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, u32);
	__type(value, struct gthulhu_entry);
} tgid_map SEC(".maps");

struct task_ctx {
	u64 vtime;        /* fair virtual time, charged for every run */
	u64 started_at;   /* when the current run began */
	u64 window_start; /* start of this task's boost accounting window */
	u64 window_used;  /* boosted run time inside it */
	u64 demoted_until;
	u64 served;       /* like vtime, but leads the pool by up to a window: the reserve's measure */
	u64 group;        /* cgroup id or autogroup counted while runnable (group_is_cgroup says which), 0 none */
	u64 cgid;         /* the task's cgroup as sched_ext reports it (init_task, cgroup_move), 0 the root */
	u64 slice;        /* the slice of the current/queued run, for a prev kept by dispatch */
	u64 cached_slice; /* the strategy select_cpu looked up for the enqueue of the same wakeup */
	u32 cached_prio;  /* the looked-up rank and head start (not yet through the guard) */
	u32 cached_head_start;
	u32 cached;       /* cached_* are valid (set by select_cpu, consumed by enqueue) */
	u32 head_start;   /* percent of the current/queued run's fair charge forgiven (head-start tier), else 0 */
	u64 forgiven;     /* head-start tier: vtime forgiven while vtime + forgiven leads the pool by < 2 slices */
	u32 group_weight; /* what this task added to that group's sum */
	u32 group_share;  /* an autogroup's weight (its nice), 100 for the default */
	u64 bw_mark;      /* the current run is charged to the cgroups' cpu.max budgets up to here */
	u64 parked_at;    /* when it was last parked in THROTTLED_DSQ */
	u32 prio;         /* rank of the current/queued run after the guard (strength_of): 0 fair */
	u32 group_is_cgroup;
	u64 slice_vtime;  /* what a whole slice costs it at its weight, charged in full (last run); 0 before one */
	u64 wake_credit;  /* what a default slice costs it at its weight (last run): its credit at wake-up */
	u32 cut_short;    /* its last run was preempted by a boosted waker before its slice ended */
	u32 woke;         /* its current or next run is its first since it became runnable (ops.runnable) */
	struct gthulhu_task_stats stats; /* explain's per-task counters: the agent finds them by BTF */
};

struct {
	__uint(type, BPF_MAP_TYPE_TASK_STORAGE);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__type(key, int);
	__type(value, struct task_ctx);
} task_ctxs SEC(".maps");

/*
 * Runnable weight of each autogroup (session; key: its struct task_group), so a task is charged as one of
 * the group's tasks: the group gets one share, whatever number of threads it runs. LRU: a group lost to
 * eviction only means its tasks are charged as individuals until they next wake.
 */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, u64);
	__type(value, s64);
} group_weights SEC(".maps");

/*
 * The cgroup tree as sched_ext reports it (ops.cgroup_init/exit/set_weight; only cgroups with the cpu
 * controller), keyed by cgroup id; the root is not kept (its tasks are charged as individuals, as the
 * root level is in EEVDF's terms: entities compared by their weights). `load` is what competes inside the
 * cgroup: the weights of its runnable tasks plus the `contrib` of each child cgroup, which is the child's
 * weight while it has runnable work and 0 otherwise. A change of `load` from zero to positive or back
 * changes the cgroup's own `contrib`, under its lock, and that delta is applied to the parent's `load`
 * in turn, so every parent's load equals its children's contribs once the deltas have landed (they may
 * land in any order; a transient sum is clamped where it is used).
 */
#define CG_MAX_DEPTH 32
/* A run longer than this (18 min) is charged as this long: the charge cannot overflow. */
#define MAX_CHARGED_NS (1ULL << 40)
struct cgroup_ctx {
	struct bpf_spin_lock lock;
	u32 weight;  /* cpu.weight, 1-10000 */
	u32 contrib; /* what it adds to its parent's load: its weight while it has runnable work, else 0 */
	s64 load;    /* runnable weight directly in it: its tasks' and its active children's */
	u64 parent;  /* the parent's id, 0 for a top-level cgroup (a child of the root) */
	/* cpu.max and cpu.max.burst: quota_ns 0 is "max", no limit */
	u64 period_ns;
	u64 quota_ns;
	u64 burst_ns;
	u64 period_end; /* the current period ends here */
	s64 budget;     /* run time left in it: quota per period, up to quota + burst carried, debt down to -quota */
	u64 cgrp;       /* before 6.17: the cgroup, to find its task_group from (bw_reread) */
	u64 tg;         /* before 6.17: its task_group, where the kernel keeps cpu.max; 0 until found */
	u64 bw_read_at; /* when tg's cpu.max was last read */
	u64 tg_misses;  /* walks that found no task_group yet */
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536);
	__type(key, u64);
	__type(value, struct cgroup_ctx);
} cgroups SEC(".maps");

/*
 * Written under its CPU's rq lock (running, stopping, dispatch, hotplug callbacks of that CPU), but for
 * `handed`, a hint that select_cpu and a capacity move also write for a CPU whose lock they do not hold.
 */
struct cpu_ctx {
	u64 last_reserve; /* when this CPU last gave the reserve a turn */
	u64 vtime;        /* full-charge vtime of the unboosted task it runs, floored (twin_vtime) */
	u64 deadline;     /* and its virtual deadline: its full-charge vtime + what its slice costs it */
	u64 run_group;    /* and its group (task_ctx.group), 0 none */
	u64 window_start; /* this CPU's boost accounting window */
	u64 boost_used;   /* boosted run time on this CPU inside it */
	u32 prio;         /* rank of what it runs now: 0 unboosted (head-start tier included) or idle */
	u32 bw_stop_ready; /* bw_stop initialised */
	u32 bw_run;        /* bumped at every running and stopping here: which run is on */
	u32 bw_stop_run;   /* the run bw_stop was armed for */
	u32 offline;       /* between cpu_offline and cpu_online (or offline at init): prio stays ~0 */
	u32 boost_waker;   /* a boosted waker was inserted to preempt the current run (cut_short) */
	u32 handed;        /* the strongest rank handed to its local DSQ since that was last empty */
	u32 run_bound;     /* whether the task it runs may run on this CPU only */
	u32 fair_waker;    /* an unboosted waker was inserted to preempt and nothing has started here since */
	u32 run_on;        /* a run of ours is on (running to stopping): vtime and deadline describe it */
	u64 bw_stop_at;    /* when it was armed to fire: an earlier fire is an older arm's */
	u64 pull_after;    /* a pull from a crowded node found nothing this CPU may run: not again before */
	u64 run_start;     /* when its current run started (running) */
	u64 bound_waited;  /* when a task bound to it last waited there for boosted work (note_bound_wait) */
	struct bpf_timer bw_stop; /* ends a limited task's run when its cgroup's budget does */
};

/* One entry per possible CPU: the loader sets max_entries to nr_cpu_ids, so no CPU is left out. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, struct cpu_ctx);
} cpu_ctxs SEC(".maps");

/* This CPU's slot of the counters (a per-CPU array is looked up without a hash or a lock). */
static __always_inline struct gthulhu_counters *my_counters(void)
{
	u32 key = 0;

	return bpf_map_lookup_elem(&counters, &key);
}

/*
 * Count an event in this CPU's slot. Atomic although no other CPU writes it: a callback in process
 * context (init_task, cgroup_init) can be interrupted on its CPU by one that counts the same event.
 */
#define count(name)                                                  \
	do {                                                         \
		struct gthulhu_counters *__c = my_counters();        \
		if (__c)                                             \
			__sync_fetch_and_add(&__c->name, 1);         \
	} while (0)

static __always_inline u64 ticks(u64 boottime_ns)
{
	return boottime_ns / (1000000000ULL / USER_HZ);
}

/* vtime and deadlines wrap: compare by signed difference, as the kernel's DSQ ordering does. */
static __always_inline bool before(u64 a, u64 b)
{
	return (s64)(a - b) < 0;
}

static __always_inline u64 boost_budget(void)
{
	return settings.boost_window_ns * settings.boost_share_percent / 100;
}

static __always_inline struct task_ctx *ctx_of(struct task_struct *p)
{
	return bpf_task_storage_get(&task_ctxs, p, 0, 0);
}

static __always_inline struct cpu_ctx *cpu_ctx_of(s32 cpu)
{
	u32 key = cpu;

	return bpf_map_lookup_elem(&cpu_ctxs, &key);
}

static __always_inline u32 prio_on(s32 cpu)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	return c ? c->prio : 0;
}

/* Whether boosted tasks used more than their share of this CPU in its current window. */
static __always_inline bool cpu_throttled(struct cpu_ctx *c, u64 now)
{
	return now - c->window_start < settings.boost_window_ns && c->boost_used > boost_budget();
}

/* The reserve's turn on this CPU: it is throttled, or (window - budget) passed since the last turn. */
static __always_inline bool reserve_due(struct cpu_ctx *c, u64 now)
{
	return cpu_throttled(c, now) || now - c->last_reserve >= settings.boost_window_ns - boost_budget();
}

/* Wake an idle CPU the task may run on, so a queued task does not wait for the next tick. */
static __always_inline void kick_idle(struct task_struct *p)
{
	s32 cpu = scx_bpf_pick_idle_cpu(p->cpus_ptr, 0);

	if (cpu >= 0)
		scx_bpf_kick_cpu(cpu, KICK_IDLE);
}

/* A vtime at most `credit` behind the pool: what a sleeper keeps of its time asleep. */
static __always_inline u64 floored_by(u64 vtime, u64 credit)
{
	u64 floor = vtime_now - credit;

	return before(vtime, floor) ? floor : vtime;
}

/* A vtime with a sleeper's floor: at most one default slice of credit. */
static __always_inline u64 floored(u64 vtime)
{
	return floored_by(vtime, settings.default_slice_ns);
}

/* The fair-pool key of an unboosted enqueue. */
static __always_inline u64 fair_vtime(struct task_ctx *tctx)
{
	return floored(tctx->vtime);
}

/*
 * What the unboosted wake-up rule compares for the head-start tier: its vtime with every run charged in
 * full, which never lags its unboosted twin's (it ran at least as much), except that it leads the fair
 * pool by at most two default slices (gthulhu_stopping; after a long sleep both are floored alike). So its
 * discount buys it CPU share, never a preemption its twin would not make. A lead of one slice, as a boosted
 * task's, threw away part of the full charge at most runs of a task wanting more than its twin's share, so
 * it preempted more often than its twin (docs/scheduler.md). With its own (discounted) vtime, or with the
 * discount of its last runs added back up to a slice or a window, a task wanting 60 % of a CPU beside a
 * hog preempted it at every wake-up, its unboosted twin at 81-98 % (lab, 7.3): with twice the weight it
 * keeps up with its demand and its vtime falls behind the pool, where its twin's sits at it.
 */
static __always_inline u64 twin_vtime(struct task_ctx *tctx)
{
	return floored(tctx->vtime + tctx->forgiven);
}

/* What a contract priority asks for, in the scheduler's terms (see PREEMPT_TIER_LAST). */
struct strength {
	u32 rank;       /* preempt tier: GTHULHU_PRIORITY_MAX + 1 - priority (1 -> 20, 9 -> 12); else 0 */
	u32 head_start; /* head-start tier: percent of each run's fair charge forgiven (10 -> 50, 20 -> 5); else 0 */
};

/*
 * The one conversion from the contract's number. The head start is upstream kernel mode's vtime reduction,
 * (190 - 9 p) / 2 percent: 10 gets 50 %, 20 gets 5 %, so a head-start task weighs at most twice what it
 * would unboosted (a share, like a nice level: it cannot starve anyone). A number above the contract's
 * range (never written by the agent) asks for nothing.
 */
static __always_inline struct strength strength_of(u32 priority)
{
	struct strength s = {};

	if (priority >= 1 && priority <= PREEMPT_TIER_LAST)
		s.rank = GTHULHU_PRIORITY_MAX + 1 - priority;
	else if (priority > PREEMPT_TIER_LAST && priority <= GTHULHU_PRIORITY_MAX)
		s.head_start = (190 - 9 * priority) / 2;
	return s;
}

/* Whether rank a is strictly weaker than rank b: a waker preempts only what this says is weaker. */
static __always_inline bool weaker(u32 a, u32 b)
{
	return a < b;
}

/* Nothing waits in the CPU's local DSQ. */
static __always_inline bool local_free(s32 cpu)
{
	return !scx_bpf_dsq_nr_queued(DSQ_LOCAL_ON | cpu);
}

/*
 * A task of rank `prio` goes to the CPU's local DSQ outside dispatch (inserts take effect after the
 * callback, so the DSQ read here is the one before it): the strongest rank handed since it was empty.
 */
static __always_inline void hand(struct cpu_ctx *c, s32 cpu, u32 prio)
{
	if (c && (local_free(cpu) || weaker(c->handed, prio)))
		c->handed = prio;
}

/*
 * Whether a boosted waker of rank `prio` inserted at the head of the CPU's local DSQ goes before nothing
 * of an equal or stronger rank handed there and not yet run (unboosted work counts as the weakest). A
 * level-5 engine waking at the tick a level-1 thread was handed to its CPU, inserted at the head, ran its
 * whole burst first while a hog kept the other CPU.
 */
static __always_inline bool goes_first(struct cpu_ctx *c, s32 cpu, u32 prio)
{
	return c && (local_free(cpu) || weaker(c->handed, prio));
}

/* The deadline a boosted task is queued at in BOOST_DSQ: rank buys a head start, waiting catches up. */
static __always_inline u64 boost_deadline(u32 rank, u64 now)
{
	return now + (u64)(AGENT_RANK - rank) * BOOST_STEP_NS;
}

#endif /* GTHULHU_STATE_BPF_H */
