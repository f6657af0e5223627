// SPDX-License-Identifier: GPL-2.0
/*
 * gthulhu: a sched_ext scheduler whose per-task policy is written by the gthulhu-node agent.
 *
 * Every SCHED_NORMAL task is scheduled here. A task's strategy comes from tid_map (its own thread id),
 * else tgid_map (its process), else the default. Entries carry the start time of the task they were
 * written for, so a reused id never inherits a dead task's strategy.
 *
 *  - priority > 0 (boosted): queued in BOOST_DSQ ahead of unboosted work, earliest deadline first, where
 *    the deadline is the enqueue time plus a step per priority below the top: higher priorities go first,
 *    and a lower one that has waited long enough goes before a fresh higher one (aging). A waking
 *    boosted task preempts a less important one, found through a mask of the CPUs running nothing boosted.
 *  - priority 0 with a slice: fair, with its own slice.
 *  - no entry: fair (weighted vtime) with the default slice. Like the kernel's fair class, the share is
 *    split between task groups (cgroups, or sessions through autogroup) first, then between the group's
 *    runnable tasks. Unboosted tasks queue per NUMA node (one queue on a single-node host), all ordered
 *    by the one vtime clock: a CPU takes from its node's queue, from a more crowded node's when the queues
 *    drift apart by more than a task per CPU, and from any node's when its own is empty.
 *  - every run, boosted or not, is charged to the task's vtime; after a boosted run it may lead the fair
 *    pool by at most one default slice (so a demoted task waits little), and its `served` measure by at
 *    most one window past the later of the fair pool's clock and the reserve's own.
 *  - the reserve: each CPU gives a turn to the task served least, unboosted (by vtime) or boosted (by
 *    served), at least once per (window - budget), and serves nothing else first once boosted tasks used
 *    more than boost_share_percent of it in the current window. A boosted task that the boosted queue
 *    starves is served there as if unboosted: being boosted never costs a task the share it would get
 *    unboosted.
 *  - a boosted task that used more than boost_share_percent of a CPU in its window runs unboosted until
 *    the window ends.
 *  - CPUs of different capacity (big.LITTLE: settings.asym_capacity, capacities in cpu_capacity): a waking
 *    boosted task goes to the most capable CPU it may use that is idle or runs something less important,
 *    and one requeued on a less capable CPU moves to such a CPU if one is more capable. Unboosted tasks
 *    are placed as on any host: nothing keeps the big CPUs free for boosted work that is not there.
 *  - cpu.max (from ops.cgroup_set_bandwidth on 6.17+; before, read from the cgroup's task_group, where the
 *    kernel keeps it for the fair class): each cgroup with a quota has a budget per period, charged at every
 *    tick and stop to it and to every ancestor with a quota. A task whose cgroup or an ancestor has no
 *    budget left is parked in THROTTLED_DSQ, boosted or not (the operator's limit wins),
 *    and a running one is preempted when the budget it started with runs out (a timer per CPU; the kernel
 *    ends slices only at ticks); a timer wakes a CPU when a period ends and its dispatch moves the tasks
 *    whose budget is back to their queue. No task stays parked longer than BW_MAX_PARK_NS: one that would
 *    runs for BW_MIN_RUN_NS, so the watchdog never sees it wait.
 *
 * For many CPUs: counters are per CPU, unboosted queues per node, and the mask of CPUs running nothing
 * boosted changes only when a CPU turns boosted or back (what stays shared: docs/scheduler.md).
 *
 * docs/scheduler.md explains each choice and states the bounded wait.
 */
/* vmlinux.h's ops table is the newest kernel's: ours is declared below (see "The ops table"). */
#define sched_ext_ops sched_ext_ops___vmlinux
#include "vmlinux.h"
#undef sched_ext_ops
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>
#include "gthulhu.h"

char _license[] SEC("license") = "GPL";

/* The sched_ext kfuncs were renamed in 6.13; the build makes one object per naming (see Makefile). */
#ifdef GTHULHU_KFUNCS_6_12
void scx_bpf_dispatch(struct task_struct *p, u64 dsq_id, u64 slice, u64 enq_flags) __ksym;
void scx_bpf_dispatch_vtime(struct task_struct *p, u64 dsq_id, u64 slice, u64 vtime, u64 enq_flags) __ksym;
bool scx_bpf_consume(u64 dsq_id) __ksym;
bool scx_bpf_dispatch_from_dsq(struct bpf_iter_scx_dsq *it__iter, struct task_struct *p, u64 dsq_id,
			       u64 enq_flags) __ksym;
void scx_bpf_dispatch_from_dsq_set_vtime(struct bpf_iter_scx_dsq *it__iter, u64 vtime) __ksym;
bool scx_bpf_dispatch_vtime_from_dsq(struct bpf_iter_scx_dsq *it__iter, struct task_struct *p, u64 dsq_id,
				     u64 enq_flags) __ksym;
#define dsq_insert scx_bpf_dispatch
#define dsq_insert_vtime scx_bpf_dispatch_vtime
#define dsq_move_to_local scx_bpf_consume
#define dsq_move scx_bpf_dispatch_from_dsq
#define dsq_move_set_vtime scx_bpf_dispatch_from_dsq_set_vtime
#define dsq_move_vtime scx_bpf_dispatch_vtime_from_dsq
#else
void scx_bpf_dsq_insert(struct task_struct *p, u64 dsq_id, u64 slice, u64 enq_flags) __ksym;
void scx_bpf_dsq_insert_vtime(struct task_struct *p, u64 dsq_id, u64 slice, u64 vtime, u64 enq_flags) __ksym;
bool scx_bpf_dsq_move_to_local(u64 dsq_id) __ksym;
bool scx_bpf_dsq_move(struct bpf_iter_scx_dsq *it__iter, struct task_struct *p, u64 dsq_id,
		      u64 enq_flags) __ksym;
void scx_bpf_dsq_move_set_vtime(struct bpf_iter_scx_dsq *it__iter, u64 vtime) __ksym;
bool scx_bpf_dsq_move_vtime(struct bpf_iter_scx_dsq *it__iter, struct task_struct *p, u64 dsq_id,
			    u64 enq_flags) __ksym;
#define dsq_insert scx_bpf_dsq_insert
#define dsq_insert_vtime scx_bpf_dsq_insert_vtime
#define dsq_move_to_local scx_bpf_dsq_move_to_local
#define dsq_move scx_bpf_dsq_move
#define dsq_move_set_vtime scx_bpf_dsq_move_set_vtime
#define dsq_move_vtime scx_bpf_dsq_move_vtime
#endif
s32 scx_bpf_create_dsq(u64 dsq_id, s32 node) __ksym;
s32 scx_bpf_select_cpu_dfl(struct task_struct *p, s32 prev_cpu, u64 wake_flags, bool *is_idle) __ksym;
s32 scx_bpf_pick_idle_cpu(const struct cpumask *cpus_allowed, u64 flags) __ksym;
s32 scx_bpf_task_cpu(const struct task_struct *p) __ksym;
s32 scx_bpf_dsq_nr_queued(u64 dsq_id) __ksym;
void scx_bpf_kick_cpu(s32 cpu, u64 flags) __ksym;
bool bpf_cpumask_test_cpu(u32 cpu, const struct cpumask *cpumask) __ksym;
u64 bpf_map_sum_elem_count(const struct bpf_map *map) __ksym;
const struct cpumask *scx_bpf_get_online_cpumask(void) __ksym;
const struct cpumask *scx_bpf_get_idle_cpumask(void) __ksym;
void scx_bpf_put_idle_cpumask(const struct cpumask *cpumask) __ksym;
bool scx_bpf_test_and_clear_cpu_idle(s32 cpu) __ksym;
void scx_bpf_put_cpumask(const struct cpumask *cpumask) __ksym;
int bpf_iter_scx_dsq_new(struct bpf_iter_scx_dsq *it, u64 dsq_id, u64 flags) __ksym;
struct task_struct *bpf_iter_scx_dsq_next(struct bpf_iter_scx_dsq *it) __ksym;
void bpf_iter_scx_dsq_destroy(struct bpf_iter_scx_dsq *it) __ksym;
int bpf_iter_num_new(struct bpf_iter_num *it, int start, int end) __ksym;
int *bpf_iter_num_next(struct bpf_iter_num *it) __ksym;
void bpf_iter_num_destroy(struct bpf_iter_num *it) __ksym;
struct bpf_cpumask *bpf_cpumask_create(void) __ksym;
void bpf_cpumask_release(struct bpf_cpumask *cpumask) __ksym;
void bpf_cpumask_set_cpu(u32 cpu, struct bpf_cpumask *cpumask) __ksym;
void bpf_cpumask_clear_cpu(u32 cpu, struct bpf_cpumask *cpumask) __ksym;
u32 bpf_cpumask_any_and_distribute(const struct cpumask *src1, const struct cpumask *src2) __ksym;

/* A referenced kernel pointer kept in a map value (a BTF type tag the verifier reads). */
#define __kptr __attribute__((btf_type_tag("kptr")))

#define OP(name, args...) SEC("struct_ops/" #name) BPF_PROG(name, ##args)

/*
 * sched_ext's flag and DSQ-id values as the running kernel defines them (CO-RE enum relocations), never
 * as the kernel that vmlinux.h came from did: they have moved between releases.
 */
#define KENUM(type, name) bpf_core_enum_value(enum type, name)
#define DSQ_LOCAL KENUM(scx_dsq_id_flags, SCX_DSQ_LOCAL)
#define DSQ_LOCAL_ON KENUM(scx_dsq_id_flags, SCX_DSQ_LOCAL_ON)
#define ENQ_WAKEUP KENUM(scx_enq_flags, SCX_ENQ_WAKEUP)
#define ENQ_HEAD KENUM(scx_enq_flags, SCX_ENQ_HEAD)
#define ENQ_PREEMPT KENUM(scx_enq_flags, SCX_ENQ_PREEMPT)
#define ENQ_LAST KENUM(scx_enq_flags, SCX_ENQ_LAST)
#define KICK_IDLE KENUM(scx_kick_flags, SCX_KICK_IDLE)
#define KICK_PREEMPT KENUM(scx_kick_flags, SCX_KICK_PREEMPT)
#define TASK_QUEUED KENUM(scx_ent_flags, SCX_TASK_QUEUED)

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
/* The agent's own threads rank above every intent's priority. */
#define AGENT_PRIORITY (GTHULHU_PRIORITY_MAX + 1)
/* Deadline distance between adjacent priorities in BOOST_DSQ: priority 1 waits at most 40 ms more than 20. */
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
	u32 cached_prio;
	u32 cached;       /* cached_* are valid (set by select_cpu, consumed by enqueue) */
	u32 group_weight; /* what this task added to that group's sum */
	u32 group_share;  /* an autogroup's weight (its nice), 100 for the default */
	u64 bw_mark;      /* the current run is charged to the cgroups' cpu.max budgets up to here */
	u64 parked_at;    /* when it was last parked in THROTTLED_DSQ */
	u32 prio;         /* effective priority of the current/queued run: 0 fair */
	u32 group_is_cgroup;
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

/* Written under its CPU's rq lock (running, stopping, dispatch, hotplug callbacks of that CPU). */
struct cpu_ctx {
	u64 last_reserve; /* when this CPU last gave the reserve a turn */
	u64 vtime;        /* vtime of the unboosted task it runs */
	u64 window_start; /* this CPU's boost accounting window */
	u64 boost_used;   /* boosted run time on this CPU inside it */
	u32 prio;         /* what it runs now: 0 unboosted or idle, else the boosted priority */
	u32 bw_stop_ready; /* bw_stop initialised */
	u32 bw_run;        /* bumped at every running and stopping here: which run is on */
	u32 bw_stop_run;   /* the run bw_stop was armed for */
	u32 offline;       /* between cpu_offline and cpu_online (or offline at init): prio stays ~0 */
	u64 bw_stop_at;    /* when it was armed to fire: an earlier fire is an older arm's */
	u64 pull_after;    /* a pull from a crowded node found nothing this CPU may run: not again before */
	struct bpf_timer bw_stop; /* ends a limited task's run when its cgroup's budget does */
};

/* One entry per possible CPU: the loader sets max_entries to nr_cpu_ids, so no CPU is left out. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, struct cpu_ctx);
} cpu_ctxs SEC(".maps");

struct strategy {
	u64 slice;
	u32 prio;
};

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

static __always_inline void take(struct strategy *s, const struct gthulhu_entry *e)
{
	s->prio = e->priority;
	s->slice = e->slice_ns ? e->slice_ns : settings.default_slice_ns;
}

/*
 * TID entry, else TGID entry, else default. An entry written for an earlier task with the same id (its
 * start time differs) is deleted: that is the only way such an entry could be looked up again.
 */
static void lookup_strategy(struct task_struct *p, struct strategy *s)
{
	struct gthulhu_entry *e;
	u32 tid = p->pid, tgid = p->tgid;

	s->prio = 0;
	s->slice = settings.default_slice_ns;

	e = bpf_map_lookup_elem(&tid_map, &tid);
	if (e) {
		if (e->start_time == ticks(p->start_boottime)) {
			take(s, e);
			count(tid_hits);
			return;
		}
		count(stale_entries);
		bpf_map_delete_elem(&tid_map, &tid);
	}
	e = bpf_map_lookup_elem(&tgid_map, &tgid);
	if (e) {
		if (e->start_time == ticks(p->group_leader->start_boottime)) {
			take(s, e);
			count(tgid_hits);
			return;
		}
		count(stale_entries);
		bpf_map_delete_elem(&tgid_map, &tgid);
	}
	count(misses);
	if (settings.agent_tgid && tgid == settings.agent_tgid) {
		s->prio = AGENT_PRIORITY;
		count(agent_boosts);
	}
}

/* One lookup per wakeup: select_cpu's result is kept for the enqueue that follows it. */
static void strategy_of(struct task_struct *p, struct task_ctx *tctx, struct strategy *s)
{
	if (tctx && tctx->cached) {
		tctx->cached = 0;
		s->prio = tctx->cached_prio;
		s->slice = tctx->cached_slice;
		return;
	}
	lookup_strategy(p, s);
}

static __always_inline u64 boost_budget(void)
{
	return settings.boost_window_ns * settings.boost_share_percent / 100;
}

/* The per-task guard: a boosted task over its share of one CPU runs fair until its window ends. */
static u32 effective_prio(struct task_ctx *tctx, u32 prio, u64 now)
{
	if (!prio || before(now, tctx->demoted_until))
		return 0;
	return prio;
}

/* Whether the boosted run in progress has crossed the task's budget for its window. */
static __always_inline bool over_budget(struct task_ctx *tctx, u64 now)
{
	u64 used = tctx->started_at ? now - tctx->started_at : 0;

	if (now - tctx->window_start < settings.boost_window_ns)
		used += tctx->window_used;
	return used > boost_budget();
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

/*
 * The CPUs that run nothing boosted (cpu_ctx.prio 0: an unboosted task, a reserve run, or idle), so a boosted
 * waker finds a CPU to preempt in one cpumask operation instead of a walk over every CPU's context.
 */
struct cpumask_slot {
	struct bpf_cpumask __kptr *mask;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, struct cpumask_slot);
} unboosted_cpus SEC(".maps");

static __always_inline struct bpf_cpumask *unboosted_mask(void)
{
	struct cpumask_slot *slot;
	u32 key = 0;

	slot = bpf_map_lookup_elem(&unboosted_cpus, &key);
	return slot ? slot->mask : NULL;
}

/*
 * What a CPU runs changes (running and stopping, under its rq lock; the hotplug callbacks): the mask is
 * written only when the CPU turns boosted or back, so CPUs switching between unboosted tasks never write
 * its shared cache line. An offline CPU stays at ~0, out of the mask: tasks still stop on a CPU going
 * down after cpu_offline, and a boosted waker must not be sent there.
 */
static __always_inline void set_cpu_prio(s32 cpu, struct cpu_ctx *c, u32 prio)
{
	struct bpf_cpumask *mask;
	bool was_unboosted = !c->prio;

	if (c->offline)
		prio = ~0U;
	c->prio = prio;
	if (was_unboosted == !prio)
		return;
	mask = unboosted_mask();
	if (!mask)
		return;
	if (prio)
		bpf_cpumask_clear_cpu(cpu, mask);
	else
		bpf_cpumask_set_cpu(cpu, mask);
}

/*
 * Each CPU's domain (its NUMA node, numbered densely), written by the agent before attach; max_entries is set
 * to nr_cpu_ids at load. Only read when nr_domains() > 1.
 */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, u32);
} cpu_domain SEC(".maps");

/* Online CPUs per domain: counted by init (the kernel holds CPU hotplug off across it), then kept by the
 * hotplug callbacks. What the fair queues are balanced by. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_DOMAINS);
	__type(key, u32);
	__type(value, s32);
} domain_cpus SEC(".maps");

/* settings.nr_domains, kept within 1..MAX_DOMAINS whatever the loader wrote. */
static __always_inline u32 nr_domains(void)
{
	u32 n = settings.nr_domains;

	return n < 1 ? 1 : n > MAX_DOMAINS ? MAX_DOMAINS : n;
}

static __always_inline u32 domain_of(s32 cpu)
{
	u32 key = cpu, *d;

	if (nr_domains() <= 1)
		return 0;
	d = bpf_map_lookup_elem(&cpu_domain, &key);
	return d && *d < nr_domains() ? *d : 0;
}

static __always_inline u64 fair_dsq(u32 domain)
{
	return FAIR_DSQ_BASE + domain;
}

/* Where an unboosted task queues: the fair queue of the CPU it last ran on or wakes on. */
static __always_inline u64 fair_dsq_of(struct task_struct *p)
{
	return fair_dsq(domain_of(scx_bpf_task_cpu(p)));
}

static __always_inline s64 domain_online(u32 domain)
{
	s32 *n = bpf_map_lookup_elem(&domain_cpus, &domain);

	return n && *n > 0 ? *n : 0;
}

/* Each domain's CPUs, made by init (multi-node hosts only): a boosted waker looks in its own node first. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_DOMAINS);
	__type(key, u32);
	__type(value, struct cpumask_slot);
} domain_masks SEC(".maps");

static __always_inline struct bpf_cpumask *domain_mask(u32 domain)
{
	struct cpumask_slot *slot = bpf_map_lookup_elem(&domain_masks, &domain);

	return slot ? slot->mask : NULL;
}

static __always_inline void domain_cpu_change(s32 cpu, s32 delta)
{
	u32 domain = domain_of(cpu);
	s32 *n = bpf_map_lookup_elem(&domain_cpus, &domain);

	if (n)
		__sync_fetch_and_add(n, delta);
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

/* Whether a CPU runs something less important than prio and its boost share is not spent. */
static __always_inline bool preemptible_for(s32 cpu, u32 prio, u64 now)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	return c && c->prio < prio && !cpu_throttled(c, now);
}

/* CPUs a boosted waker scans for a lesser boost when no other CPU qualifies (find_victim). */
#define VICTIM_SCAN 32

/*
 * An online CPU the task may use that is preemptible_for it; -1 if none. First a CPU running nothing
 * boosted (the unboosted_cpus mask, taken in turn so wakers spread), on the node of `from` (the default
 * pick: the task's cache and memory) if one is, else anywhere; only when none of those qualifies, a
 * lesser boost: `from`'s, else one among the VICTIM_SCAN CPUs after it. An offline CPU's prio is ~0
 * (set_cpu_prio), so it never qualifies.
 */
static s32 find_victim(struct task_struct *p, s32 from, u32 prio, u64 now)
{
	struct bpf_cpumask *unboosted = unboosted_mask(), *node;
	const struct cpumask *online;
	u32 n = settings.nr_cpus;
	struct bpf_iter_num it;
	s32 found = -1, cpu;
	int *i;

	if (unboosted) {
		node = nr_domains() > 1 ? domain_mask(domain_of(from)) : NULL;
		if (node) {
			cpu = bpf_cpumask_any_and_distribute((const struct cpumask *)unboosted,
							     (const struct cpumask *)node);
			if ((u32)cpu < n && preemptible_for(cpu, prio, now) && bpf_cpumask_test_cpu(cpu, p->cpus_ptr))
				return cpu;
		}
		cpu = bpf_cpumask_any_and_distribute((const struct cpumask *)unboosted, p->cpus_ptr);
		if ((u32)cpu < n && preemptible_for(cpu, prio, now))
			return cpu;
	}
	if (preemptible_for(from, prio, now) && bpf_cpumask_test_cpu(from, p->cpus_ptr))
		return from;
	count(victim_scans);
	online = scx_bpf_get_online_cpumask();
	bpf_iter_num_new(&it, 1, n < VICTIM_SCAN ? n : VICTIM_SCAN + 1);
	while ((i = bpf_iter_num_next(&it))) {
		cpu = ((u32)from + (u32)*i) % n;
		if (preemptible_for(cpu, prio, now) && bpf_cpumask_test_cpu(cpu, p->cpus_ptr) &&
		    bpf_cpumask_test_cpu(cpu, online)) {
			found = cpu;
			break;
		}
	}
	bpf_iter_num_destroy(&it);
	scx_bpf_put_cpumask(online);
	return found;
}

/* Each CPU's capacity as the kernel reports it (1024 for the most capable), written by the agent before
 * attach; max_entries is set to nr_cpu_ids at load. Only read when settings.asym_capacity is set. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, u32);
} cpu_capacity SEC(".maps");

static __always_inline u32 capacity_of(s32 cpu)
{
	u32 key = cpu, *cap = bpf_map_lookup_elem(&cpu_capacity, &key);

	return cap ? *cap : 0;
}

/* Heterogeneous CPUs: the tasks that look for the most capable CPU (boosted ones; not the agent's own,
 * whose short bursts would otherwise preempt engines on the big CPUs while a little one idles). */
static __always_inline bool seeks_capacity(struct task_struct *p, u32 prio)
{
	return settings.asym_capacity && prio && p->nr_cpus_allowed > 1 &&
	       !(settings.agent_tgid && p->tgid == settings.agent_tgid);
}

/*
 * The BPF program that runs holds migration disabled for the current task: that one is not the task's.
 * (Kernels that stopped doing so, 6.18+ without PREEMPT_RCU, make a migration-disabled current task read
 * as movable; the kernel then queues it on the global DSQ instead of the remote CPU, which is safe.)
 */
static __always_inline bool migration_disabled(struct task_struct *p)
{
	return p->migration_disabled > (p == bpf_get_current_task_btf() ? 1 : 0);
}

/* What a CPU offers a boosted task, least first: a lesser boost to preempt, nothing boosted, idle. */
enum offer { OFFER_NONE, OFFER_LESSER, OFFER_UNBOOSTED, OFFER_IDLE };

/*
 * The most capable online CPU the task may use that is idle or preemptible_for it, if more capable than
 * `floor`: at equal capacity the best offer wins, then the first from `from` (its cache). An idle one is
 * claimed (*idle set); -1 if none.
 */
static s32 find_capable(struct task_struct *p, s32 from, u32 prio, u32 floor, bool *idle)
{
	const struct cpumask *idle_cpus = scx_bpf_get_idle_cpumask();
	const struct cpumask *online = scx_bpf_get_online_cpumask();
	u32 n = settings.nr_cpus, best_cap = floor, cap;
	enum offer best_offer = OFFER_NONE, offer;
	u64 now = bpf_ktime_get_ns();
	struct bpf_iter_num it;
	s32 best = -1, cpu;
	int *i;

	bpf_iter_num_new(&it, 0, n);
	while ((i = bpf_iter_num_next(&it))) {
		cpu = ((u32)from + (u32)*i) % n;
		cap = capacity_of(cpu);
		/* An offline CPU can stay in the idle mask: its last switch was to its idle task. */
		if (cap < best_cap || (cap == best_cap && (best < 0 || best_offer == OFFER_IDLE)) ||
		    !bpf_cpumask_test_cpu(cpu, p->cpus_ptr) || !bpf_cpumask_test_cpu(cpu, online))
			continue;
		if (bpf_cpumask_test_cpu(cpu, idle_cpus))
			offer = OFFER_IDLE;
		else if (preemptible_for(cpu, prio, now))
			offer = prio_on(cpu) ? OFFER_LESSER : OFFER_UNBOOSTED;
		else
			continue;
		if (cap == best_cap && offer <= best_offer)
			continue;
		best = cpu;
		best_cap = cap;
		best_offer = offer;
	}
	bpf_iter_num_destroy(&it);
	scx_bpf_put_cpumask(online);
	scx_bpf_put_idle_cpumask(idle_cpus);
	/* Another waker may have claimed it since: then it is a target only if preemptible_for us. */
	*idle = best >= 0 && best_offer == OFFER_IDLE && scx_bpf_test_and_clear_cpu_idle(best);
	if (best >= 0 && !*idle && !preemptible_for(best, prio, now))
		return -1;
	return best;
}

/* The fair-pool key of an unboosted enqueue: a sleeper keeps at most one default slice of credit. */
static __always_inline u64 fair_vtime(struct task_ctx *tctx)
{
	u64 floor = vtime_now - settings.default_slice_ns;

	return before(tctx->vtime, floor) ? floor : tctx->vtime;
}

/* The deadline a boosted task is queued at in BOOST_DSQ: priority buys a head start, waiting catches up. */
static __always_inline u64 boost_deadline(u32 prio, u64 now)
{
	return now + (u64)(AGENT_PRIORITY - prio) * BOOST_STEP_NS;
}

/* cpu.max "max", the kernel's RUNTIME_INF: no limit. */
#define BW_UNLIMITED (~0ULL)
/*
 * A parked task waits at most this long, a quarter of the shortest watchdog timeout the agent accepts (1 s),
 * where cpu.max's longest period is 1 s: past it, it runs for BW_MIN_RUN_NS and is parked again (a period
 * of 1 s gets at most four such runs beyond its quota).
 */
#define BW_MAX_PARK_NS 250000000ULL
/* While tasks are parked the timer also fires at least this often: a lost arm delays a release this much. */
#define BW_POLL_NS 10000000ULL
/* Parked tasks one release pass looks at; the rest wait for the next pass, which is due at once. */
#define BW_MAX_PASS 1024
/* The shortest run a cpu.max budget cuts a task's run to (bw_limit_run). */
#define BW_MIN_RUN_NS 200000ULL

/* When the next parked task may go (a period ends, or it has been parked BW_MAX_PARK_NS); 0: none. */
static u64 bw_release_at SEC(".data") = 0;

struct bw_timer {
	struct bpf_timer timer;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, u32);
	__type(value, struct bw_timer);
} bw_timers SEC(".maps");

/* A new limit (quota_ns 0: none) starts a full period now, as writing cpu.max does in the fair class. */
static __always_inline void bw_set(struct cgroup_ctx *cg, u64 period_ns, u64 quota_ns, u64 burst_ns, u64 now)
{
	if (!quota_ns || !period_ns) {
		cg->quota_ns = 0;
		return;
	}
	cg->period_ns = period_ns;
	cg->quota_ns = quota_ns;
	cg->burst_ns = burst_ns;
	cg->budget = quota_ns;
	cg->period_end = now + period_ns;
}

#ifdef GTHULHU_CGROUP_BW
/* 6.17+: the kernel passes microseconds, BW_UNLIMITED for "max". */
static __always_inline void bw_set_us(struct cgroup_ctx *cg, u64 period_us, u64 quota_us, u64 burst_us, u64 now)
{
	bw_set(cg, period_us * 1000, quota_us == BW_UNLIMITED ? 0 : quota_us * 1000,
	       burst_us == BW_UNLIMITED ? 0 : burst_us * 1000, now);
}
#else
/*
 * Before 6.17 the kernel does not pass cpu.max to a BPF scheduler, but it still keeps it where the fair
 * class reads it: the cgroup's task_group, tg->cfs_bandwidth (CONFIG_CFS_BANDWIDTH). Read it from there at
 * cgroup_init, and again when a walk passes the cgroup BW_REREAD_NS after the last read: a change holds
 * within that, where 6.17's callback makes it hold at once.
 */
#define BW_REREAD_NS 10000000ULL
/*
 * task_group always has cfs_bandwidth; its fields exist only with CONFIG_CFS_BANDWIDTH. A CO-RE constant,
 * so on a kernel without them the reads below are dead code the verifier never walks.
 */
#define BW_IN_KERNEL (bpf_core_field_exists(struct cfs_bandwidth, period) && \
		      bpf_core_field_exists(struct cfs_bandwidth, quota) && \
		      bpf_core_field_exists(struct cfs_bandwidth, burst))
/* Reads (BW_REREAD_NS apart, so a second at least) that find no task_group before the cgroup is counted
 * in cgroups_untracked: its css should be linked moments after its cgroup_init. */
#define BW_TG_MISSES 100

/*
 * The cgroup's task_group (its cpu controller's css), 0 if not there yet: the kernel links the css into
 * cgrp->subsys[] only after its css_online, which is what calls our cgroup_init for a new cgroup.
 */
static __always_inline u64 bw_tg_of(u64 cgrp)
{
	u32 cpu_id = bpf_core_enum_value(enum cgroup_subsys_id, cpu_cgrp_id);
	u64 css = 0;

	if ((cpu_id + 1) * sizeof(css) > bpf_core_field_size(struct cgroup, subsys))
		return 0;
	bpf_probe_read_kernel(&css, sizeof(css), (void *)(cgrp + bpf_core_field_offset(struct cgroup, subsys) +
							    cpu_id * sizeof(css)));
	return css ? css - bpf_core_field_offset(struct task_group, css) : 0;
}

/* A cpu.max as the kernel keeps it, in ns; quota 0 is "max". */
struct bw_limit {
	u64 period;
	u64 quota;
	u64 burst;
};

/*
 * The kernel writes period, quota and burst under a lock we cannot take: a read racing a write may see
 * a mix of old and new, which the next read corrects.
 */
static __always_inline void bw_tg_limit(u64 tg_addr, struct bw_limit *l)
{
	struct task_group *tg = (void *)tg_addr;

	if (!BW_IN_KERNEL) {
		l->period = l->quota = l->burst = 0;
		return;
	}
	l->period = BPF_CORE_READ(tg, cfs_bandwidth.period);
	l->quota = BPF_CORE_READ(tg, cfs_bandwidth.quota);
	l->burst = BPF_CORE_READ(tg, cfs_bandwidth.burst);
	if (l->quota == BW_UNLIMITED)
		l->quota = 0;
}

static __always_inline bool bw_differs(struct cgroup_ctx *cg, struct bw_limit *l)
{
	return l->quota != cg->quota_ns || (l->quota && (l->period != cg->period_ns || l->burst != cg->burst_ns));
}
#endif

static void bw_arm(u64 at, u64 now);

/*
 * Before 6.17: read the cgroup's cpu.max again if BW_REREAD_NS have passed. A changed limit makes a
 * release pass due: one raised or removed frees the parked tasks at once.
 */
static __always_inline void bw_reread(struct cgroup_ctx *cg, u64 now)
{
#ifndef GTHULHU_CGROUP_BW
	struct bw_limit l;
	bool changed;

	if (!cg->cgrp || before(now, cg->bw_read_at + BW_REREAD_NS))
		return;
	cg->bw_read_at = now;
	if (!cg->tg) {
		cg->tg = bw_tg_of(cg->cgrp);
		if (!cg->tg) {
			if (++cg->tg_misses == BW_TG_MISSES)
				count(cgroups_untracked);
			return;
		}
	}
	bw_tg_limit(cg->tg, &l);
	bpf_spin_lock(&cg->lock);
	changed = bw_differs(cg, &l);
	if (changed)
		bw_set(cg, l.period, l.quota, l.burst, now);
	bpf_spin_unlock(&cg->lock);
	/* as the 6.17 callback does: a raised or removed limit frees the parked tasks at once */
	if (changed)
		bw_arm(now, now);
#endif
}

/*
 * Start the periods that ended by `now` (caller holds the lock): each adds a quota, and what is left
 * unused carries over up to quota + burst (the kernel's cpu.max.burst).
 */
static __always_inline void bw_roll(struct cgroup_ctx *cg, u64 now)
{
	s64 cap = cg->quota_ns + cg->burst_ns;
	u64 periods;

	if (before(now, cg->period_end))
		return;
	periods = (now - cg->period_end) / cg->period_ns + 1;
	cg->period_end += periods * cg->period_ns;
	cg->budget = periods > 64 ? cap : cg->budget + (s64)(periods * cg->quota_ns);
	if (cg->budget > cap)
		cg->budget = cap;
}

/* What bw_walk returns. */
#define BW_UNTIL 0 /* the latest period end among the cgroups without budget; 0: the task may run */
#define BW_LEFT 1  /* the least budget any of them has left; BW_UNLIMITED: none has a quota */

/*
 * Charge `used` ns to the cgroup and every ancestor with a quota, and say `what` of them. Debt stops at
 * one quota, so no cgroup is held past two periods. Global and not inlined: the verifier checks it once,
 * not at every call (inside the release pass's loop it exceeded the verifier's budget for dispatch).
 */
__attribute__((noinline)) u64 bw_walk(u64 id, u64 used, u64 now, u32 what)
{
	u64 until = 0, left = BW_UNLIMITED;
	struct cgroup_ctx *cg;
	struct bpf_iter_num up;

	if (used > MAX_CHARGED_NS)
		used = MAX_CHARGED_NS;
	/* bounded by an iterator, not a counter: see RESERVE_SCAN */
	bpf_iter_num_new(&up, 0, CG_MAX_DEPTH);
	while (id && bpf_iter_num_next(&up)) {
		cg = bpf_map_lookup_elem(&cgroups, &id);
		if (!cg)
			break;
		bw_reread(cg, now);
		if (cg->quota_ns) {
			bpf_spin_lock(&cg->lock);
			if (cg->quota_ns) {
				bw_roll(cg, now);
				cg->budget -= (s64)used;
				if (cg->budget < -(s64)cg->quota_ns)
					cg->budget = -(s64)cg->quota_ns;
				if (cg->budget <= 0 && before(until, cg->period_end))
					until = cg->period_end;
				if (cg->budget <= 0)
					left = 0;
				else if ((u64)cg->budget < left)
					left = cg->budget;
			}
			bpf_spin_unlock(&cg->lock);
		}
		id = cg->parent;
	}
	bpf_iter_num_destroy(&up);
	return what == BW_LEFT ? left : until;
}

static __always_inline u64 bw_account(u64 id, u64 used, u64 now)
{
	return bw_walk(id, used, now, BW_UNTIL);
}

/* Whether the task's cgroup, or an ancestor, is out of budget. */
static __always_inline bool bw_held(struct task_ctx *tctx, u64 now)
{
	return tctx && tctx->cgid && bw_account(tctx->cgid, 0, now);
}

/* Have the timer fire by `at`, unless it already fires earlier (two CPUs may race: BW_POLL_NS covers it). */
static void bw_arm(u64 at, u64 now)
{
	u64 cur = bw_release_at;
	struct bw_timer *t;
	u32 key = 0;

	if (cur && before(now, cur) && !before(at, cur))
		return;
	bw_release_at = at;
	t = bpf_map_lookup_elem(&bw_timers, &key);
	if (t)
		bpf_timer_start(&t->timer, before(now, at) ? at - now : 0, 0);
}

/* Park a task whose cgroup is out of budget; false if it may run. */
static bool bw_park(struct task_struct *p, struct task_ctx *tctx, u64 slice, u64 enq_flags, u64 now)
{
	u64 until, latest = now + BW_MAX_PARK_NS;

	if (!tctx || !tctx->cgid)
		return false;
	until = bw_account(tctx->cgid, 0, now);
	if (!until)
		return false;
	tctx->parked_at = now;
	dsq_insert(p, THROTTLED_DSQ, slice, enq_flags);
	count(bw_parked);
	bw_arm(before(until, latest) ? until : latest, now);
	return true;
}

/* Charge the current run since the last mark; whether its cgroup (or an ancestor) is now out of budget. */
static __always_inline bool bw_charge(struct task_ctx *tctx, u64 now)
{
	u64 used = tctx->bw_mark ? now - tctx->bw_mark : 0;

	tctx->bw_mark = now;
	return tctx->cgid && bw_account(tctx->cgid, used, now);
}

/* A limited task's budget ran out mid-run: preempt it, so stopping charges it and enqueue parks it. */
static int bw_stop_fired(void *map, u32 *cpu, struct cpu_ctx *c)
{
	/*
	 * The run it was armed for may have ended (the timer is never cancelled), or this is an older arm's
	 * expiry landing after a re-arm (a start under the rq lock may take effect later): not ours to end.
	 */
	if (c->bw_stop_run != c->bw_run || bpf_ktime_get_ns() < c->bw_stop_at) {
		count(bw_stops_stale);
		return 0;
	}
	scx_bpf_kick_cpu(*cpu, KICK_PREEMPT);
	count(bw_stops);
	return 0;
}

/*
 * End the run of a task in a limited cgroup when the budget left does: the kernel ends a slice only at a
 * tick, and charged at ticks a 3 ms quota overran each 100 ms period by up to a tick (4 ms at 250 Hz).
 * Not sooner than BW_MIN_RUN_NS, so a nearly spent budget does not cost a switch every few microseconds;
 * tasks of one cgroup running at once may each use what is left, once.
 *
 * The timer is re-armed, never cancelled: bpf_timer_cancel under the rq lock (IRQs off) fails on 7.x
 * (-EOPNOTSUPP, the cancel is deferred only by a kfunc there), and before that release a cancel also
 * dropped the callback, so later starts failed. A run number tells the callback whether its run is on.
 */
static __always_inline void bw_stop_after(struct cpu_ctx *c, u64 left, u64 slice, u64 now)
{
	if (left >= slice)
		return;
	if (!c->bw_stop_ready) {
		if (bpf_timer_init(&c->bw_stop, &cpu_ctxs, 1 /* CLOCK_MONOTONIC */))
			return;
		bpf_timer_set_callback(&c->bw_stop, bw_stop_fired);
		c->bw_stop_ready = 1;
	}
	if (left < BW_MIN_RUN_NS)
		left = BW_MIN_RUN_NS;
	c->bw_stop_run = c->bw_run;
	c->bw_stop_at = now + left;
	bpf_timer_start(&c->bw_stop, left, 0);
}

/* A run starts (running): arm its stop timer if its cgroups' budget ends before its slice does. */
static __always_inline void bw_limit_run(struct task_ctx *tctx, struct cpu_ctx *c, u64 slice, u64 now)
{
	c->bw_run++;
	if (tctx->cgid)
		bw_stop_after(c, bw_walk(tctx->cgid, 0, now, BW_LEFT), slice, now);
}

/*
 * Dispatch keeps a boosted prev for a new slice, and no `running` comes for it: charge what it ran since
 * the last mark and arm the stop timer for what is left, in one walk of its cgroups. False: out of budget,
 * so it must go (stopping charges the rest, enqueue parks it).
 */
static __always_inline bool bw_keep(struct task_ctx *tctx, struct cpu_ctx *c, u64 slice, u64 now)
{
	u64 used = tctx->bw_mark ? now - tctx->bw_mark : 0;
	u64 left = BW_UNLIMITED;

	tctx->bw_mark = now;
	if (tctx->cgid)
		left = bw_walk(tctx->cgid, used, now, BW_LEFT);
	if (!left)
		return false;
	c->bw_run++;
	bw_stop_after(c, left, slice, now);
	return true;
}

/* The run is over: a stop timer armed for it must not preempt whatever runs next. */
static __always_inline void bw_run_ended(struct cpu_ctx *c)
{
	c->bw_run++;
}

/* Wake idle CPUs so one of them runs the release pass in its dispatch (kfuncs here: any context). */
static int bw_timer_fired(void *map, int *key, struct bw_timer *t)
{
	u64 now = bpf_ktime_get_ns(), at = bw_release_at;
	struct bpf_iter_num it;
	int *i;

	if (!scx_bpf_dsq_nr_queued(THROTTLED_DSQ))
		return 0;
	/*
	 * Parked tasks but no release due: a park raced a release pass (its insert lands when enqueue returns,
	 * after the pass cleared bw_release_at and missed it). Make one due, or the task waits for the watchdog.
	 */
	if (!at) {
		bw_release_at = now;
		at = now;
	}
	bpf_iter_num_new(&it, 0, settings.nr_cpus);
	while ((i = bpf_iter_num_next(&it)))
		scx_bpf_kick_cpu(*i, KICK_IDLE);
	bpf_iter_num_destroy(&it);
	bpf_timer_start(&t->timer, at && before(now, at) && at - now < BW_POLL_NS ? at - now : BW_POLL_NS, 0);
	return 0;
}

/*
 * The release pass (dispatch, once bw_release_at is due): parked tasks whose budget is back, or that were
 * parked BW_MAX_PARK_NS, go to their queue as if enqueued now; the timer is armed for the rest.
 */
static void bw_release(u64 now)
{
	struct bpf_iter_scx_dsq it;
	struct bpf_iter_num pass;
	struct task_struct *p;
	struct task_ctx *tctx;
	u64 next = 0, until, at;
	bool drained = false;

	bw_release_at = 0;
	bpf_iter_scx_dsq_new(&it, THROTTLED_DSQ, 0);
	/* The pass's bound is a numbers iterator, not a counter: see RESERVE_SCAN. */
	bpf_iter_num_new(&pass, 0, BW_MAX_PASS);
	while (bpf_iter_num_next(&pass)) {
		p = bpf_iter_scx_dsq_next(&it);
		if (!p) {
			drained = true;
			break;
		}
		tctx = ctx_of(p);
		until = tctx && tctx->cgid ? bw_account(tctx->cgid, 0, now) : 0;
		if (tctx && until && before(now, tctx->parked_at + BW_MAX_PARK_NS)) {
			at = before(until, tctx->parked_at + BW_MAX_PARK_NS) ? until : tctx->parked_at + BW_MAX_PARK_NS;
			if (!next || before(at, next))
				next = at;
			continue;
		}
		if (tctx && tctx->prio) {
			dsq_move_set_vtime(&it, boost_deadline(tctx->prio, now));
			dsq_move_vtime(&it, p, BOOST_DSQ, 0);
		} else {
			dsq_move_set_vtime(&it, tctx ? fair_vtime(tctx) : vtime_now);
			dsq_move_vtime(&it, p, fair_dsq_of(p), 0);
		}
		/* as an enqueue does: the CPUs the timer woke may have gone idle again before this pass */
		kick_idle(p);
		count(bw_released);
	}
	/* more parked tasks than one pass takes: the next pass is due at once */
	if (!drained && bpf_iter_scx_dsq_next(&it))
		next = now;
	bpf_iter_num_destroy(&pass);
	bpf_iter_scx_dsq_destroy(&it);
	if (next)
		bw_arm(next, now);
}

static __always_inline void bw_release_due(u64 now)
{
	u64 at = bw_release_at;

	if (at && !before(now, at) && scx_bpf_dsq_nr_queued(THROTTLED_DSQ))
		bw_release(now);
}

static s32 bw_init(void)
{
	struct bw_timer *t;
	u32 key = 0;
	s32 ret;

	ret = scx_bpf_create_dsq(THROTTLED_DSQ, -1);
	if (ret)
		return ret;
	t = bpf_map_lookup_elem(&bw_timers, &key);
	if (!t)
		return -2; /* -ENOENT */
	bpf_timer_init(&t->timer, &bw_timers, 1 /* CLOCK_MONOTONIC */);
	bpf_timer_set_callback(&t->timer, bw_timer_fired);
	return 0;
}

/*
 * Boosted wakers go straight to a CPU that runs something less important, so enqueue can insert them into
 * that CPU's local DSQ and preempt: the default pick if it runs nothing boosted, else one that runs
 * nothing boosted, else a lesser boost (find_victim); on big.LITTLE the most capable such CPU.
 */
s32 OP(gthulhu_select_cpu, struct task_struct *p, s32 prev_cpu, u64 wake_flags)
{
	struct task_ctx *tctx = ctx_of(p);
	struct strategy s;
	bool idle = false, placed = false;
	s32 cpu, victim;
	u32 prio;
	u64 now;

	lookup_strategy(p, &s);
	now = bpf_ktime_get_ns();
	prio = tctx ? effective_prio(tctx, s.prio, now) : 0;
	cpu = -1;
	if (seeks_capacity(p, prio) && !bw_held(tctx, now)) {
		cpu = find_capable(p, prev_cpu, prio, 0, &idle);
		placed = cpu >= 0;
		if (placed && capacity_of(cpu) > capacity_of(prev_cpu))
			count(capacity_placements);
	}
	if (cpu < 0)
		cpu = scx_bpf_select_cpu_dfl(p, prev_cpu, wake_flags, &idle);
	/* Over its cgroup's cpu.max: enqueue parks it; the idle CPU claimed for it is woken to idle again. */
	if (idle && bw_held(tctx, now)) {
		scx_bpf_kick_cpu(cpu, KICK_IDLE);
		idle = false;
	}
	/* The default policy claimed an idle CPU for us: run there now, or that CPU idles until kicked. */
	if (idle) {
		if (tctx) {
			tctx->prio = prio;
			tctx->slice = s.slice;
		}
		dsq_insert(p, DSQ_LOCAL, s.slice, 0);
		count(direct_dispatches);
		if (prio)
			count(boosted_dispatches);
		else
			count(fair_dispatches);
		return cpu;
	}
	if (!tctx)
		return cpu;
	tctx->cached_prio = s.prio;
	tctx->cached_slice = s.slice;
	tctx->cached = 1;
	/* A lesser boost on the default pick keeps its CPU while another runs nothing boosted. */
	if (!prio || placed || p->nr_cpus_allowed == 1 || (!prio_on(cpu) && preemptible_for(cpu, prio, now)))
		return cpu;
	victim = find_victim(p, cpu, prio, now);
	return victim >= 0 ? victim : cpu;
}

/*
 * ENQ_LAST comes from put_prev after the CPU has picked what runs next (idle): a task inserted into its
 * local DSQ then waits for the next scheduling event there, and the kernel leaves that event to the BPF
 * scheduler. The kick lands once the CPU is idle and makes it pick the task again.
 */
static __always_inline void insert_last(struct task_struct *p, u64 slice, u64 enq_flags)
{
	dsq_insert(p, DSQ_LOCAL, slice, enq_flags);
	scx_bpf_kick_cpu(scx_bpf_task_cpu(p), KICK_IDLE);
}

/*
 * A boosted task requeued (its slice ended) on a CPU less capable than another it may use that is idle or
 * runs something less important: straight to that CPU's local DSQ, preempting, instead of BOOST_DSQ, from
 * which the CPU that just ran it would take it back. Only while no boosted task waits in BOOST_DSQ (their
 * deadlines come first) and, for a busy target, while nothing waits in its local DSQ (a waker handed to
 * it is not overtaken).
 */
static bool move_to_capable(struct task_struct *p, struct strategy *s, u32 prio, s32 cpu, u64 enq_flags)
{
	bool idle = false;
	s32 to;

	if (!seeks_capacity(p, prio) || migration_disabled(p) || scx_bpf_dsq_nr_queued(BOOST_DSQ))
		return false;
	to = find_capable(p, cpu, prio, capacity_of(cpu), &idle);
	if (to < 0)
		return false;
	if (idle) {
		dsq_insert(p, DSQ_LOCAL_ON | to, s->slice, enq_flags);
		scx_bpf_kick_cpu(to, KICK_IDLE);
	} else if (!scx_bpf_dsq_nr_queued(DSQ_LOCAL_ON | to)) {
		dsq_insert(p, DSQ_LOCAL_ON | to, s->slice, enq_flags | ENQ_PREEMPT | ENQ_HEAD);
		count(preemptions);
	} else {
		return false;
	}
	count(capacity_placements);
	return true;
}

static void enqueue_boosted(struct task_struct *p, struct strategy *s, u32 prio, u64 enq_flags, u64 now)
{
	s32 cpu = scx_bpf_task_cpu(p);
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	count(boosted_dispatches);
	/*
	 * A waking boosted task: local DSQ + ENQ_PREEMPT, so it runs the moment its CPU reschedules instead
	 * of at that CPU's next dispatch. Only wakeups: a task requeued at the end of its slice goes through
	 * BOOST_DSQ, so it never jumps ahead of tasks already handed to this CPU. Only the task's own CPU:
	 * affinity and migration-disabled tasks stay safe. Not on a CPU whose boost share is spent: the
	 * unboosted tasks' turn there must not be cut short.
	 */
	if ((enq_flags & ENQ_WAKEUP) && c && c->prio < prio && !cpu_throttled(c, now) &&
	    bpf_cpumask_test_cpu(cpu, p->cpus_ptr)) {
		dsq_insert(p, DSQ_LOCAL_ON | cpu, s->slice, enq_flags | ENQ_PREEMPT | ENQ_HEAD);
		count(preemptions);
		return;
	}
	if (!(enq_flags & ENQ_WAKEUP) && move_to_capable(p, s, prio, cpu, enq_flags))
		return;
	/* Earliest deadline first: priority buys a head start, waiting catches up with it. */
	dsq_insert_vtime(p, BOOST_DSQ, s->slice, boost_deadline(prio, now), enq_flags);
	kick_idle(p);
}

void OP(gthulhu_enqueue, struct task_struct *p, u64 enq_flags)
{
	struct task_ctx *tctx = ctx_of(p);
	u64 now = bpf_ktime_get_ns(), vtime;
	struct cpu_ctx *c;
	struct strategy s;
	s32 cpu;
	u32 prio;

	strategy_of(p, tctx, &s);
	/* A per-CPU kernel thread (ksoftirqd, kworker/N) can only run there: queue it there, not globally. */
	if ((p->flags & PF_KTHREAD) && p->nr_cpus_allowed == 1) {
		if (tctx) {
			tctx->prio = 0;
			tctx->slice = s.slice;
		}
		dsq_insert(p, DSQ_LOCAL, s.slice, enq_flags);
		count(fair_dispatches);
		return;
	}
	/* ENQ_LAST: nothing else is queued for this CPU, so it keeps the task. */
	if (!tctx) {
		/* vtime-ordered like every insert there: the kernel ejects a scheduler that mixes in FIFO ones */
		if (enq_flags & ENQ_LAST)
			insert_last(p, s.slice, enq_flags);
		else
			dsq_insert_vtime(p, fair_dsq_of(p), s.slice, vtime_now, enq_flags);
		return;
	}
	prio = effective_prio(tctx, s.prio, now);
	tctx->prio = prio;
	tctx->slice = s.slice;
	/* cpu.max before priority: a boosted task in a limited cgroup is held to the limit. */
	if (bw_park(p, tctx, s.slice, enq_flags, now))
		return;
	if (enq_flags & ENQ_LAST) {
		insert_last(p, s.slice, enq_flags);
		return;
	}
	if (prio) {
		enqueue_boosted(p, &s, prio, enq_flags, now);
		return;
	}

	count(fair_dispatches);
	vtime = fair_vtime(tctx);
	/*
	 * Wakeup preemption, as the fair class does it: a waking task that is behind the unboosted task on its
	 * CPU by more than half a default slice runs now, instead of after that task's whole slice. Not while
	 * boosted tasks wait: they go first.
	 */
	cpu = scx_bpf_task_cpu(p);
	c = cpu_ctx_of(cpu);
	if ((enq_flags & ENQ_WAKEUP) && c && !c->prio && before(vtime + settings.default_slice_ns / 2, c->vtime) &&
	    bpf_cpumask_test_cpu(cpu, p->cpus_ptr) && !scx_bpf_dsq_nr_queued(BOOST_DSQ)) {
		dsq_insert(p, DSQ_LOCAL_ON | cpu, s.slice, enq_flags | ENQ_PREEMPT);
		count(fair_preemptions);
		return;
	}
	dsq_insert_vtime(p, fair_dsq(domain_of(cpu)), s.slice, vtime, enq_flags);
	kick_idle(p);
}

/* The least vtime at the head of a fair queue, and that queue's domain; false if every one is empty. */
static bool fair_head(u64 *vtime, u32 *domain)
{
	struct bpf_iter_scx_dsq it;
	struct bpf_iter_num doms;
	struct task_struct *p;
	bool found = false;
	int *d;

	bpf_iter_num_new(&doms, 0, nr_domains());
	while ((d = bpf_iter_num_next(&doms))) {
		if (!scx_bpf_dsq_nr_queued(fair_dsq(*d)))
			continue;
		bpf_iter_scx_dsq_new(&it, fair_dsq(*d), 0);
		p = bpf_iter_scx_dsq_next(&it);
		if (p && (!found || before(p->scx.dsq_vtime, *vtime))) {
			*vtime = p->scx.dsq_vtime;
			*domain = *d;
			found = true;
		}
		bpf_iter_scx_dsq_destroy(&it);
	}
	bpf_iter_num_destroy(&doms);
	return found;
}

/* Unboosted tasks waiting in any domain's queue. */
static bool fair_waiting(void)
{
	struct bpf_iter_num doms;
	bool found = false;
	int *d;

	bpf_iter_num_new(&doms, 0, nr_domains());
	while ((d = bpf_iter_num_next(&doms))) {
		if (scx_bpf_dsq_nr_queued(fair_dsq(*d))) {
			found = true;
			break;
		}
	}
	bpf_iter_num_destroy(&doms);
	return found;
}

/*
 * The domain this CPU should take its next unboosted task from instead of its own: the most crowded one
 * (queued tasks per online CPU) if it is more crowded than this one would be with one task more queued,
 * so queues stay within a task per CPU of each other, as the fair class's load balancing keeps its run
 * queues. A domain with no CPU online and tasks queued is the most crowded of all. `own` if none.
 */
static u32 crowded_domain(u32 own)
{
	s64 own_q = scx_bpf_dsq_nr_queued(fair_dsq(own)), own_c = domain_online(own), q, c, best_q = 0, best_c = 0;
	struct bpf_iter_num doms;
	u32 best = own;
	int *d;

	if (!own_c)
		own_c = 1;
	bpf_iter_num_new(&doms, 0, nr_domains());
	while ((d = bpf_iter_num_next(&doms))) {
		if ((u32)*d == own)
			continue;
		q = scx_bpf_dsq_nr_queued(fair_dsq(*d));
		if (!q)
			continue;
		c = domain_online(*d);
		/* q / c against (own_q + 1) / own_c, and against the most crowded so far, without division */
		if (q * own_c <= (own_q + 1) * c || (best != own && q * best_c <= best_q * c))
			continue;
		best = *d;
		best_q = q;
		best_c = c;
	}
	bpf_iter_num_destroy(&doms);
	return best;
}

/*
 * Move an unboosted task to this CPU: from the most crowded domain if another is (crowded_domain), else
 * from its own domain, else from any other (a CPU never idles while an unboosted task it may run waits).
 */
static bool consume_fair(s32 cpu, struct cpu_ctx *c, u64 now)
{
	u32 n = nr_domains(), own, from;
	struct bpf_iter_num doms;
	bool moved = false;
	int *i;

	if (n <= 1)
		return dsq_move_to_local(fair_dsq(0));
	own = domain_of(cpu);
	from = c && before(now, c->pull_after) ? own : crowded_domain(own);
	if (from != own) {
		if (dsq_move_to_local(fair_dsq(from))) {
			count(domain_pulls);
			return true;
		}
		/*
		 * Crowded with tasks bound away from this CPU (a cpuset on that node): the kernel walked the
		 * whole queue under its lock to find none. Not again for a slice.
		 */
		if (c)
			c->pull_after = now + settings.default_slice_ns;
	}
	if (dsq_move_to_local(fair_dsq(own)))
		return true;
	bpf_iter_num_new(&doms, 1, n);
	while ((i = bpf_iter_num_next(&doms))) {
		if (scx_bpf_dsq_nr_queued(fair_dsq((own + *i) % n)) && dsq_move_to_local(fair_dsq((own + *i) % n))) {
			count(domain_steals);
			moved = true;
			break;
		}
	}
	bpf_iter_num_destroy(&doms);
	return moved;
}

/*
 * A boosted task's claim on the reserve: what it was served, with a sleeper's floor. The floor is taken
 * once per turn: the clocks move under our feet, and both passes over BOOST_DSQ must agree.
 */
static __always_inline u64 reserve_key(struct task_ctx *tctx, u64 floor)
{
	return before(tctx->served, floor) ? floor : tctx->served;
}

/* The later of the two clocks: what `served` leads and sleepers are floored against. */
static __always_inline u64 reserve_clock(void)
{
	return before(vtime_now, reserve_now) ? reserve_now : vtime_now;
}

/*
 * A sleeper's floor on the reserve: one slice behind the fair pool, as a fair wakeup, and at most one
 * window behind the reserve's clock, so a boosted task back from a long sleep does not take every turn
 * until its `served` catches up with a clock that ran on while only boosted tasks were runnable.
 */
static __always_inline u64 reserve_floor(void)
{
	u64 fair = vtime_now - settings.default_slice_ns, reserve = reserve_now - settings.boost_window_ns;

	return before(fair, reserve) ? reserve : fair;
}

/* Whether a reserve turn on `cpu` may take p: moving a task to a CPU it may not use ejects us. */
static __always_inline bool may_take(struct task_struct *p, s32 cpu)
{
	return bpf_cpumask_test_cpu(cpu, p->cpus_ptr) && (!p->migration_disabled || scx_bpf_task_cpu(p) == cpu);
}

/* The least reserve key among the first RESERVE_SCAN boosted tasks this CPU may take. */
static bool least_boosted(s32 cpu, u64 floor, u64 *least)
{
	struct bpf_iter_scx_dsq it;
	struct bpf_iter_num scan;
	struct task_struct *p;
	struct task_ctx *tctx;
	bool found = false;
	u64 key;

	bpf_iter_scx_dsq_new(&it, BOOST_DSQ, 0);
	bpf_iter_num_new(&scan, 0, RESERVE_SCAN);
	while (bpf_iter_num_next(&scan) && (p = bpf_iter_scx_dsq_next(&it))) {
		tctx = ctx_of(p);
		if (!tctx || !may_take(p, cpu))
			continue;
		key = reserve_key(tctx, floor);
		if (!found || before(key, *least)) {
			*least = key;
			found = true;
		}
	}
	bpf_iter_num_destroy(&scan);
	bpf_iter_scx_dsq_destroy(&it);
	return found;
}

/* Move the first boosted task (deadline order) whose reserve key is `key` to this CPU, as unboosted. */
static bool take_boosted(s32 cpu, u64 floor, u64 key)
{
	struct bpf_iter_scx_dsq it;
	struct bpf_iter_num scan;
	struct task_struct *p;
	struct task_ctx *tctx;
	bool moved = false;

	bpf_iter_scx_dsq_new(&it, BOOST_DSQ, 0);
	bpf_iter_num_new(&scan, 0, RESERVE_SCAN);
	while (bpf_iter_num_next(&scan) && (p = bpf_iter_scx_dsq_next(&it))) {
		tctx = ctx_of(p);
		if (!tctx || reserve_key(tctx, floor) != key || !may_take(p, cpu))
			continue;
		if (dsq_move(&it, p, DSQ_LOCAL, 0)) {
			tctx->prio = 0; /* a reserve run: charged as unboosted, preemptible as one */
			moved = true;
			break;
		}
	}
	bpf_iter_num_destroy(&scan);
	bpf_iter_scx_dsq_destroy(&it);
	return moved;
}

/*
 * The reserve's turn: whoever was served least runs, unboosted or boosted (measured by vtime; a boosted
 * task's by `served`). That is how the boosted queue's losers get the reserve they would have had
 * unboosted, and why boosted tasks that got their fill through the boost do not take it.
 */
static bool serve_reserve(s32 cpu, struct cpu_ctx *c, u64 now)
{
	u64 head = 0, least = 0, floor = reserve_floor(), served;
	u32 head_domain = 0;
	bool have_head = fair_head(&head, &head_domain);
	bool have_boosted = scx_bpf_dsq_nr_queued(BOOST_DSQ) && least_boosted(cpu, floor, &least);

	if (have_boosted && (!have_head || before(least, head)) && take_boosted(cpu, floor, least)) {
		count(reserve_boosted);
		served = least;
	} else if (have_head && (dsq_move_to_local(fair_dsq(head_domain)) ||
				 /* nothing there this CPU may run (a cpuset): the next unboosted task it may */
				 (nr_domains() > 1 && consume_fair(cpu, c, now)))) {
		served = head;
	} else if (have_boosted && take_boosted(cpu, floor, least)) {
		/* every unboosted task waiting is bound away from this CPU: the boosted one served least */
		count(reserve_boosted);
		served = least;
	} else {
		return false;
	}
	if (before(reserve_now, served))
		reserve_now = served;
	c->last_reserve = now;
	return true;
}

void OP(gthulhu_dispatch, s32 cpu, struct task_struct *prev)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);
	u64 now = bpf_ktime_get_ns();
	struct task_ctx *tctx;

	bw_release_due(now);
	if (!c) {
		if (!dsq_move_to_local(BOOST_DSQ))
			consume_fair(cpu, NULL, now);
		return;
	}
	/* The reserve's turn: a floor under the boost that no mix of boosted tasks can take away. */
	if (reserve_due(c, now) && serve_reserve(cpu, c, now))
		return;
	if (dsq_move_to_local(BOOST_DSQ))
		return;
	/*
	 * A boosted prev that may go on keeps its CPU (returning empty-handed lets the kernel keep it), with
	 * its own slice: left alone the kernel would refill the default 20 ms. Pulling an unboosted task here
	 * would only park it in this CPU's local DSQ behind prev.
	 */
	if (prev && (prev->scx.flags & TASK_QUEUED)) {
		tctx = ctx_of(prev);
		/* charged, not only looked at: since its last tick prev ran uncharged (stopping comes later) */
		if (tctx && effective_prio(tctx, tctx->prio, now) && !over_budget(tctx, now) &&
		    bw_keep(tctx, c, tctx->slice, now)) {
			prev->scx.slice = tctx->slice;
			return;
		}
	}
	/* the least served of its domain runs: a turn for that domain's tasks (the bound, docs/scheduler.md) */
	if (consume_fair(cpu, c, now))
		c->last_reserve = now;
}

void OP(gthulhu_running, struct task_struct *p)
{
	struct task_ctx *tctx = ctx_of(p);
	struct cpu_ctx *c;
	s32 cpu;

	if (!tctx)
		return;
	tctx->started_at = bpf_ktime_get_ns();
	tctx->bw_mark = tctx->started_at;
	if (!tctx->prio && before(vtime_now, tctx->vtime))
		vtime_now = tctx->vtime;
	cpu = scx_bpf_task_cpu(p);
	c = cpu_ctx_of(cpu);
	if (c) {
		set_cpu_prio(cpu, c, tctx->prio);
		c->vtime = tctx->vtime;
		bw_limit_run(tctx, c, p->scx.slice, tctx->started_at);
	}
}

/*
 * Kernel threads are charged at most like a nice 0 task. khugepaged runs at nice 19 (weight 1 here, so
 * 100x the vtime per run) and holds a process's mmap_lock while it collapses huge pages: starved behind
 * CPU hogs, it stalled every page fault of that process for seconds (docs/scheduler.md).
 */
static __always_inline u64 fair_weight(struct task_struct *p)
{
	u64 weight = p->scx.weight ? p->scx.weight : 100;

	if ((p->flags & PF_KTHREAD) && weight < 100)
		weight = 100;
	return weight;
}

/* Our key for a cgroup: its id; 0 for the root, which is not tracked (see `cgroups`). */
static __always_inline u64 cgroup_key(struct cgroup *cgrp)
{
	if (!cgrp || !BPF_CORE_READ(cgrp, level))
		return 0;
	return BPF_CORE_READ(cgrp, kn, id);
}

/*
 * The task's autogroup (its session's group) if autogroup applies: the task is in the root cgroup (as
 * sched_ext sees it) and the kernel resolved its sched_task_group to a group below the root. Every field is
 * CO-RE guarded: a kernel without them has no autogroups to share by.
 */
static __always_inline struct task_group *autogroup_of(struct task_struct *p, struct task_ctx *tctx)
{
	struct task_group *tg;

	if (tctx->cgid || !bpf_core_field_exists(p->sched_task_group) ||
	    !bpf_core_field_exists(struct task_group, parent) || !bpf_core_field_exists(struct task_group, shares))
		return NULL;
	tg = BPF_CORE_READ(p, sched_task_group);
	if (!tg || !BPF_CORE_READ(tg, parent))
		return NULL;
	return tg;
}

/*
 * Add `delta` to a cgroup's load and carry its activation (load from zero to positive, or back) up the
 * tree as a change of its contrib to its parent's load, level by level.
 */
static void cgroup_add(u64 id, s64 delta)
{
	struct bpf_iter_num levels;
	struct cgroup_ctx *cg;
	s64 before, up;

	bpf_iter_num_new(&levels, 0, CG_MAX_DEPTH); /* not a counter: see RESERVE_SCAN */
	while (id && delta && bpf_iter_num_next(&levels)) {
		cg = bpf_map_lookup_elem(&cgroups, &id);
		if (!cg)
			break;
		up = 0;
		bpf_spin_lock(&cg->lock);
		before = cg->load;
		cg->load += delta;
		if (before <= 0 && cg->load > 0) {
			cg->contrib = cg->weight;
			up = cg->weight;
		} else if (before > 0 && cg->load <= 0) {
			up = -(s64)cg->contrib;
			cg->contrib = 0;
		}
		bpf_spin_unlock(&cg->lock);
		id = cg->parent;
		delta = up;
	}
	bpf_iter_num_destroy(&levels);
}

void OP(gthulhu_runnable, struct task_struct *p, u64 enq_flags)
{
	struct task_ctx *tctx = ctx_of(p);
	struct task_group *tg;
	s64 zero = 0, *sum;
	u64 key;

	if (!tctx || tctx->group)
		return;
	tctx->group_weight = fair_weight(p);
	if (tctx->cgid) {
		tctx->group = tctx->cgid;
		tctx->group_is_cgroup = 1;
		cgroup_add(tctx->cgid, tctx->group_weight);
		return;
	}
	tg = autogroup_of(p, tctx);
	if (!tg)
		return;
	key = (u64)tg;
	sum = bpf_map_lookup_elem(&group_weights, &key);
	if (!sum) {
		bpf_map_update_elem(&group_weights, &key, &zero, BPF_NOEXIST);
		sum = bpf_map_lookup_elem(&group_weights, &key);
		if (!sum)
			return;
	}
	tctx->group = key;
	tctx->group_is_cgroup = 0;
	/* shares are in the kernel's fixed point (nice 0 = 1024 << 10 on 64-bit); ours: nice 0 = 100 */
	tctx->group_share = (BPF_CORE_READ(tg, shares) >> 10) * 100 / 1024 ?: 1;
	__sync_fetch_and_add(sum, (s64)tctx->group_weight);
}

void OP(gthulhu_quiescent, struct task_struct *p, u64 deq_flags)
{
	struct task_ctx *tctx = ctx_of(p);
	s64 *sum;

	if (!tctx || !tctx->group)
		return;
	if (tctx->group_is_cgroup) {
		cgroup_add(tctx->group, -(s64)tctx->group_weight);
	} else {
		sum = bpf_map_lookup_elem(&group_weights, &tctx->group);
		if (sum)
			__sync_fetch_and_add(sum, -(s64)tctx->group_weight);
	}
	tctx->group = 0;
}

/*
 * Weights below are in 1/65536 of a weight point (nice 0 = 100 points). The lightest a task is ever
 * charged as is one point, the weight of a nice 19 task at the top level: at that rate (100x its run time
 * in vtime) the bounded wait of docs/scheduler.md still holds, so deeper compounding (many BestEffort pods:
 * hierarchical weights near 1e-4) gets this floor instead of an unbounded charge.
 */
#define WEIGHT_SHIFT 16
#define WEIGHT_FLOOR (1ULL << WEIGHT_SHIFT)
/*
 * One run costs at most what a task at the floor pays for two default slices (a 5 ms slice runs up to
 * ~11 ms at a 250 Hz tick): a run far longer than its slice (a late tick, a vCPU the host took away) must
 * not push the lightest tasks further back than their weight asks for. Measured in the lab: without it,
 * eight busy threads of a weight-1 cgroup beside four hogs once waited past a 5 s watchdog (TCG guest on a
 * loaded host).
 */
#define MAX_RUN_CHARGE (200ULL * settings.default_slice_ns)

/*
 * A cgroup task's weight in the top level's terms: its weight / its cgroup's load x that cgroup's weight /
 * its parent's load x ... x the top-level cgroup's weight, as EEVDF compounds group entities. The product
 * of fractions is kept with 32 bits below the point (each factor is at most 1, loads are clamped to at
 * least the entity counted in them), then scaled by the top-level weight.
 */
static u64 cgroup_weight(u64 id, u64 weight)
{
	u64 frac = 1ULL << 32, below = weight, load;
	struct bpf_iter_num levels;
	struct cgroup_ctx *cg;

	bpf_iter_num_new(&levels, 0, CG_MAX_DEPTH); /* not a counter: see RESERVE_SCAN */
	while (id && frac && bpf_iter_num_next(&levels)) {
		cg = bpf_map_lookup_elem(&cgroups, &id);
		if (!cg)
			break;
		load = cg->load > 0 ? (u64)cg->load : 0;
		if (load < below)
			load = below;
		frac = frac * below / load;
		below = cg->weight ?: 1;
		id = cg->parent;
	}
	bpf_iter_num_destroy(&levels);
	return (frac * below) >> (32 - WEIGHT_SHIFT);
}

/* The weight a run is charged at (WEIGHT_SHIFT fixed point, at least WEIGHT_FLOOR). */
static u64 effective_weight(struct task_struct *p, struct task_ctx *tctx)
{
	u64 weight = fair_weight(p), eff, sum;
	s64 *s;

	eff = weight << WEIGHT_SHIFT;
	if (tctx->group && tctx->group_is_cgroup) {
		eff = cgroup_weight(tctx->group, tctx->group_weight);
	} else if (tctx->group) {
		s = bpf_map_lookup_elem(&group_weights, &tctx->group);
		if (s && *s >= (s64)tctx->group_weight) {
			sum = (u64)*s;
			eff = ((u64)tctx->group_weight << WEIGHT_SHIFT) * tctx->group_share / sum;
		}
	}
	return eff < WEIGHT_FLOOR ? WEIGHT_FLOOR : eff;
}

/*
 * The vtime a run of `used` ns costs: used / weight, where a grouped task's weight is its part of its
 * groups' shares at every level (effective_weight). Eight hogs in one session then cost eight times what
 * a lone thread in another session pays, as under EEVDF.
 */
static u64 fair_charge(struct task_struct *p, struct task_ctx *tctx, u64 used)
{
	u64 charge;

	if (used > MAX_CHARGED_NS)
		used = MAX_CHARGED_NS;
	charge = used * (100ULL << WEIGHT_SHIFT) / effective_weight(p, tctx);
	return charge < MAX_RUN_CHARGE ? charge : MAX_RUN_CHARGE;
}

/* Charge boosted run time to the task's window and to its CPU's; start the guard when over budget. */
static void charge_boost(struct task_ctx *tctx, struct cpu_ctx *c, u64 used, u64 now)
{
	u64 window = settings.boost_window_ns;

	if (now - tctx->window_start >= window) {
		tctx->window_start = now;
		tctx->window_used = 0;
	}
	tctx->window_used += used;
	if (tctx->window_used > boost_budget() && !before(now, tctx->demoted_until)) {
		tctx->demoted_until = tctx->window_start + window;
		count(demotions);
	}
	if (!c)
		return;
	if (now - c->window_start >= window) {
		c->window_start = now;
		c->boost_used = 0;
	}
	if (c->boost_used <= boost_budget() && c->boost_used + used > boost_budget())
		count(throttled_windows);
	c->boost_used += used;
}

void OP(gthulhu_stopping, struct task_struct *p, bool runnable)
{
	struct task_ctx *tctx = ctx_of(p);
	s32 cpu = scx_bpf_task_cpu(p);
	struct cpu_ctx *c = cpu_ctx_of(cpu);
	u64 now = bpf_ktime_get_ns(), used, lead, charge;

	if (c) {
		set_cpu_prio(cpu, c, 0);
		bw_run_ended(c);
	}
	if (!tctx)
		return;
	/* A task already running when the scheduler was enabled has no start: charge nothing for that run. */
	used = tctx->started_at ? now - tctx->started_at : 0;
	tctx->started_at = 0;
	bw_charge(tctx, now);
	tctx->bw_mark = 0;
	charge = fair_charge(p, tctx, used);
	tctx->vtime += charge;
	tctx->served += charge;
	if (!tctx->prio)
		return;
	charge_boost(tctx, c, used, now);
	lead = reserve_clock() + settings.boost_window_ns;
	if (before(lead, tctx->served))
		tctx->served = lead;
	/*
	 * Boosted runs cost vtime too, so the reserve goes to whoever got least CPU, boosted or not; but a
	 * boosted task leads the fair pool by at most one default slice, so once demoted it waits at most
	 * that long behind it instead of paying for every boosted run it had.
	 */
	lead = vtime_now + settings.default_slice_ns;
	if (before(lead, tctx->vtime))
		tctx->vtime = lead;
}

/*
 * Per tick: end a boosted run that went over its share (a long slice must not outrun the guard) or that
 * holds a throttled CPU while others wait, and end an unboosted run when a boosted task waits, unless it
 * is the reserve's turn.
 */
void OP(gthulhu_tick, struct task_struct *p)
{
	struct task_ctx *tctx = ctx_of(p);
	struct cpu_ctx *c = cpu_ctx_of(scx_bpf_task_cpu(p));
	u64 now = bpf_ktime_get_ns();

	if (bpf_get_smp_processor_id() == 0) {
		bss.gauges.live_tid_entries = bpf_map_sum_elem_count((struct bpf_map *)&tid_map);
		bss.gauges.live_tgid_entries = bpf_map_sum_elem_count((struct bpf_map *)&tgid_map);
	}
	if (!tctx || !c)
		return;
	/* Its cgroup (or an ancestor) used its cpu.max quota: it stops now and enqueue parks it. */
	if (bw_charge(tctx, now)) {
		p->scx.slice = 0;
		return;
	}
	if (tctx->prio) {
		if (over_budget(tctx, now) || (cpu_throttled(c, now) && fair_waiting()))
			p->scx.slice = 0;
	} else if (!reserve_due(c, now) && now - c->last_reserve > tctx->slice &&
		   scx_bpf_dsq_nr_queued(BOOST_DSQ)) {
		p->scx.slice = 0;
	}
}

/*
 * CPU hotplug: a scheduler without these callbacks is ejected by the kernel on every hotplug event. A CPU
 * coming or going starts clean: no priority, a fresh boost window, the reserve due at once.
 */
static void reset_cpu(s32 cpu, bool offline)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	count(hotplug_events);
	if (!c)
		return;
	c->offline = offline;
	set_cpu_prio(cpu, c, offline ? ~0U : 0);
	c->boost_used = 0;
	c->window_start = 0;
	c->last_reserve = 0;
}

void OP(gthulhu_cpu_online, s32 cpu)
{
	reset_cpu(cpu, false);
	domain_cpu_change(cpu, 1);
}

/* An offline CPU looks as busy as can be, so no boosted waker is sent there. */
void OP(gthulhu_cpu_offline, s32 cpu)
{
	reset_cpu(cpu, true);
	domain_cpu_change(cpu, -1);
}

s32 OP(gthulhu_init_task, struct task_struct *p, struct scx_init_task_args *args)
{
	struct task_ctx *tctx;

	tctx = bpf_task_storage_get(&task_ctxs, p, 0, BPF_LOCAL_STORAGE_GET_F_CREATE);
	if (!tctx)
		return -12; /* -ENOMEM */
	tctx->vtime = vtime_now;
	tctx->served = vtime_now;
	if (bpf_core_field_exists(args->cgroup))
		tctx->cgid = cgroup_key(BPF_CORE_READ(args, cgroup));
	return 0;
}

/*
 * cgroups (CONFIG_EXT_GROUP_SCHED): sched_ext calls cgroup_init for every cgroup with the cpu controller,
 * parents first, when the scheduler loads and whenever one is created, and cgroup_set_weight when its
 * cpu.weight changes. Never fail: a cgroup we cannot track (the map is full) has its tasks charged as
 * individuals, and its descendants as if the level below it were the top.
 */
s32 OP(gthulhu_cgroup_init, struct cgroup *cgrp, struct scx_cgroup_init_args *args)
{
	struct cgroup_ctx cg = {};
	u64 id = cgroup_key(cgrp);

	if (!id)
		return 0;
	cg.weight = args->weight ?: 1;
	if (BPF_CORE_READ(cgrp, level) > 1)
		cg.parent = cgroup_key(BPF_CORE_READ(cgrp, self.parent, cgroup));
#ifdef GTHULHU_CGROUP_BW
	bw_set_us(&cg, args->bw_period_us, args->bw_quota_us, args->bw_burst_us, bpf_ktime_get_ns());
#else
	if (BW_IN_KERNEL) {
		/* a cgroup there at load has its task_group linked; a new one gets it at its first walk */
		cg.cgrp = (u64)cgrp;
		cg.tg = bw_tg_of(cg.cgrp);
		if (cg.tg) {
			struct bw_limit l;

			cg.bw_read_at = bpf_ktime_get_ns();
			bw_tg_limit(cg.tg, &l);
			bw_set(&cg, l.period, l.quota, l.burst, cg.bw_read_at);
		}
	} else {
		/* no CFS bandwidth in this kernel: the agent reports cpu.max as not enforced */
		count(cgroups_untracked);
	}
#endif
	if (bpf_map_update_elem(&cgroups, &id, &cg, BPF_ANY))
		count(cgroups_untracked);
	return 0;
}

void OP(gthulhu_cgroup_exit, struct cgroup *cgrp)
{
	u64 id = cgroup_key(cgrp);

	if (id)
		bpf_map_delete_elem(&cgroups, &id);
}

/* The kernel dequeues a moving task first (quiescent) and enqueues it after (runnable): it is counted
 * in the new cgroup from then on. */
void OP(gthulhu_cgroup_move, struct task_struct *p, struct cgroup *from, struct cgroup *to)
{
	struct task_ctx *tctx = ctx_of(p);

	if (tctx)
		tctx->cgid = cgroup_key(to);
}

/* A busy cgroup's new weight reaches its parent's load at once, not at its next idle moment. */
void OP(gthulhu_cgroup_set_weight, struct cgroup *cgrp, u32 weight)
{
	u64 id = cgroup_key(cgrp);
	struct cgroup_ctx *cg = id ? bpf_map_lookup_elem(&cgroups, &id) : NULL;
	s64 up = 0;

	if (!cg)
		return;
	bpf_spin_lock(&cg->lock);
	cg->weight = weight ?: 1;
	if (cg->contrib) {
		up = (s64)cg->weight - cg->contrib;
		cg->contrib = cg->weight;
	}
	bpf_spin_unlock(&cg->lock);
	cgroup_add(cg->parent, up);
}

#ifdef GTHULHU_CGROUP_BW
/* A new cpu.max or cpu.max.burst (6.17+). A raised or removed limit frees the parked tasks at once. */
void OP(gthulhu_cgroup_set_bandwidth, struct cgroup *cgrp, u64 period_us, u64 quota_us, u64 burst_us)
{
	u64 id = cgroup_key(cgrp), now = bpf_ktime_get_ns();
	struct cgroup_ctx *cg = id ? bpf_map_lookup_elem(&cgroups, &id) : NULL;

	if (!cg)
		return;
	bpf_spin_lock(&cg->lock);
	bw_set_us(cg, period_us, quota_us, burst_us, now);
	bpf_spin_unlock(&cg->lock);
	bw_arm(now, now);
}
#endif

/* Delete an entry only if it belongs to this task: the id may already name a new task. */
static __always_inline bool delete_if_owned(void *map, u32 id, u64 start_time)
{
	struct gthulhu_entry *e = bpf_map_lookup_elem(map, &id);

	if (!e || e->start_time != start_time)
		return false;
	return bpf_map_delete_elem(map, &id) == 0;
}

/*
 * Called when a task exits and also, for every task, when the scheduler is unloaded: only an exiting
 * task's entries go (the TGID entry once the whole process is gone).
 */
void OP(gthulhu_exit_task, struct task_struct *p, struct scx_exit_task_args *args)
{
	if (!(p->flags & PF_EXITING))
		return;
	if (delete_if_owned(&tid_map, p->pid, ticks(p->start_boottime)))
		count(exit_deleted_tid);
	if (p->signal->live.counter == 0 &&
	    delete_if_owned(&tgid_map, p->tgid, ticks(p->group_leader->start_boottime)))
		count(exit_deleted_tgid);
}

/*
 * The CPUs as init finds them (the kernel holds CPU hotplug off from here until the hotplug callbacks
 * are armed): the online ones run nothing boosted yet, each counts in its domain, and an offline one is
 * marked as cpu_offline leaves it.
 */
static s32 init_cpus(void)
{
	const struct cpumask *online;
	struct bpf_cpumask *mask, *old;
	struct cpumask_slot *slot;
	struct bpf_iter_num it;
	struct cpu_ctx *c;
	u32 key = 0;
	int *i;

	mask = bpf_cpumask_create();
	if (!mask)
		return -12; /* -ENOMEM */
	online = scx_bpf_get_online_cpumask();
	bpf_iter_num_new(&it, 0, settings.nr_cpus);
	while ((i = bpf_iter_num_next(&it))) {
		if (bpf_cpumask_test_cpu(*i, online)) {
			bpf_cpumask_set_cpu(*i, mask);
			domain_cpu_change(*i, 1);
		} else if ((c = cpu_ctx_of(*i))) {
			c->offline = 1;
			c->prio = ~0U;
		}
	}
	bpf_iter_num_destroy(&it);
	scx_bpf_put_cpumask(online);
	slot = bpf_map_lookup_elem(&unboosted_cpus, &key);
	if (!slot) {
		bpf_cpumask_release(mask);
		return -2; /* -ENOENT */
	}
	old = bpf_kptr_xchg(&slot->mask, mask);
	if (old)
		bpf_cpumask_release(old);
	return 0;
}

/* Each domain's CPUs as a cpumask (domain_masks), on a host with more than one. */
static s32 init_domain_masks(void)
{
	struct bpf_cpumask *mask, *old;
	struct cpumask_slot *slot;
	struct bpf_iter_num doms, cpus;
	int *d, *i;
	s32 ret = 0;
	u32 key;

	if (nr_domains() <= 1)
		return 0;
	bpf_iter_num_new(&doms, 0, nr_domains());
	while ((d = bpf_iter_num_next(&doms))) {
		mask = bpf_cpumask_create();
		if (!mask) {
			ret = -12; /* -ENOMEM */
			break;
		}
		bpf_iter_num_new(&cpus, 0, settings.nr_cpus);
		while ((i = bpf_iter_num_next(&cpus)))
			if (domain_of(*i) == (u32)*d)
				bpf_cpumask_set_cpu(*i, mask);
		bpf_iter_num_destroy(&cpus);
		key = *d;
		slot = bpf_map_lookup_elem(&domain_masks, &key);
		if (!slot) {
			bpf_cpumask_release(mask);
			ret = -2; /* -ENOENT */
			break;
		}
		old = bpf_kptr_xchg(&slot->mask, mask);
		if (old)
			bpf_cpumask_release(old);
	}
	bpf_iter_num_destroy(&doms);
	return ret;
}

/* Sleepable (the loader sets BPF_F_SLEEPABLE): creating a DSQ may allocate. */
s32 OP(gthulhu_init)
{
	struct bpf_iter_num it;
	s32 ret = scx_bpf_create_dsq(BOOST_DSQ, -1);
	int *d;

	if (ret)
		return ret;
	bpf_iter_num_new(&it, 0, nr_domains());
	while ((d = bpf_iter_num_next(&it))) {
		ret = scx_bpf_create_dsq(fair_dsq(*d), -1);
		if (ret)
			break;
	}
	bpf_iter_num_destroy(&it);
	if (ret)
		return ret;
	ret = init_cpus();
	if (ret)
		return ret;
	ret = init_domain_masks();
	if (ret)
		return ret;
	return bw_init();
}

/* Keep the kernel's reason for the agent, which reads it after noticing the scheduler is gone. */
void OP(gthulhu_exit, struct scx_exit_info *ei)
{
	bpf_probe_read_kernel_str(bss.exit_info.reason, sizeof(bss.exit_info.reason), ei->reason);
	bpf_probe_read_kernel_str(bss.exit_info.msg, sizeof(bss.exit_info.msg), ei->msg);
	bss.exit_info.exit_code = ei->exit_code;
	bss.exit_info.kind = ei->kind;
}

/* Run on demand by the agent (BPF_PROG_TEST_RUN): an exact live-entry count, even on an idle node. */
SEC("syscall")
int gthulhu_count_entries(void *ctx)
{
	bss.gauges.live_tid_entries = bpf_map_sum_elem_count((struct bpf_map *)&tid_map);
	bss.gauges.live_tgid_entries = bpf_map_sum_elem_count((struct bpf_map *)&tgid_map);
	return 0;
}

/*
 * The ops table. libbpf 1.1.2 (Debian 12's) refuses a struct_ops type that has a member the running kernel
 * lacks, even one left zero, and every release since 6.12 added members. So the type is declared here with
 * only the members we set, all present since 6.12: libbpf matches members by name and copies each to the
 * kernel's own offset.
 */
/*
 * 6.12 wants a scheduler that handles cpu.weight to say so with SCX_OPS_HAS_CGROUP_WEIGHT (1 << 16 there;
 * without it the kernel logs that we ignore cpu.weight). 6.15 made the flag a no-op that logs a deprecation
 * warning and 7.1 removed it: a kernel refuses flags it does not know. The 6.12 object runs only where the
 * old kfunc names exist, which is 6.12 alone, so only it sets the flag.
 */
/*
 * Every object sets SCX_OPS_ENQ_LAST (1 << 1 on every kernel): a task the kernel would otherwise keep on
 * an otherwise idle CPU is enqueued instead, so one over its cpu.max can be parked.
 */
#ifdef GTHULHU_KFUNCS_6_12
#define OPS_FLAGS ((1ULL << 16) | (1ULL << 1))
#else
#define OPS_FLAGS (1ULL << 1)
#endif

struct sched_ext_ops {
	s32 (*select_cpu)(struct task_struct *p, s32 prev_cpu, u64 wake_flags);
	void (*enqueue)(struct task_struct *p, u64 enq_flags);
	void (*dispatch)(s32 cpu, struct task_struct *prev);
	void (*tick)(struct task_struct *p);
	void (*runnable)(struct task_struct *p, u64 enq_flags);
	void (*running)(struct task_struct *p);
	void (*stopping)(struct task_struct *p, bool runnable);
	void (*quiescent)(struct task_struct *p, u64 deq_flags);
	s32 (*init_task)(struct task_struct *p, struct scx_init_task_args *args);
	void (*exit_task)(struct task_struct *p, struct scx_exit_task_args *args);
	s32 (*cgroup_init)(struct cgroup *cgrp, struct scx_cgroup_init_args *args);
	void (*cgroup_exit)(struct cgroup *cgrp);
	void (*cgroup_move)(struct task_struct *p, struct cgroup *from, struct cgroup *to);
	void (*cgroup_set_weight)(struct cgroup *cgrp, u32 weight);
#ifdef GTHULHU_CGROUP_BW
	void (*cgroup_set_bandwidth)(struct cgroup *cgrp, u64 period_us, u64 quota_us, u64 burst_us);
#endif
	void (*cpu_online)(s32 cpu);
	void (*cpu_offline)(s32 cpu);
	s32 (*init)(void);
	void (*exit)(struct scx_exit_info *info);
	u64 flags;
	u32 timeout_ms;
	char name[128];
#ifdef GTHULHU_TEST_UNLOADABLE
	u64 gthulhu_no_such_member; /* tests only: what a kernel lacking a member we set looks like */
#endif
};

SEC(".struct_ops")
struct sched_ext_ops gthulhu_ops = {
	.select_cpu = (void *)gthulhu_select_cpu,
	.enqueue = (void *)gthulhu_enqueue,
	.dispatch = (void *)gthulhu_dispatch,
	.running = (void *)gthulhu_running,
	.runnable = (void *)gthulhu_runnable,
	.quiescent = (void *)gthulhu_quiescent,
	.stopping = (void *)gthulhu_stopping,
	.tick = (void *)gthulhu_tick,
	.init_task = (void *)gthulhu_init_task,
	.exit_task = (void *)gthulhu_exit_task,
	.cgroup_init = (void *)gthulhu_cgroup_init,
	.cgroup_exit = (void *)gthulhu_cgroup_exit,
	.cgroup_move = (void *)gthulhu_cgroup_move,
	.cgroup_set_weight = (void *)gthulhu_cgroup_set_weight,
#ifdef GTHULHU_CGROUP_BW
	.cgroup_set_bandwidth = (void *)gthulhu_cgroup_set_bandwidth,
#endif
	.cpu_online = (void *)gthulhu_cpu_online,
	.cpu_offline = (void *)gthulhu_cpu_offline,
	.init = (void *)gthulhu_init,
	.exit = (void *)gthulhu_exit,
	.flags = OPS_FLAGS,
	.timeout_ms = 0, /* the loader patches it from config.scheduler.watchdog_timeout_ms */
	.name = "gthulhu",
};
