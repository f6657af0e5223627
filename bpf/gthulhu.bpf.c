// SPDX-License-Identifier: GPL-2.0
/*
 * gthulhu: a sched_ext scheduler whose per-task policy is written by the gthulhu-node agent.
 *
 * Every SCHED_NORMAL task is scheduled here. A task's strategy comes from tid_map (its own thread id),
 * else tgid_map (its process), else the default. Entries carry the start time of the task they were
 * written for, so a reused id never inherits a dead task's strategy.
 *
 * Priorities run upstream Gthulhu's way (its kernel mode): the lower the number, the stronger. An entry
 * holds the contract's number, which an operator reads back; strength_of (state.bpf.h) turns it into the
 * scheduler's terms in one place, and every comparison of priorities here compares those (weaker()).
 *  - priority 1-9, the preempt tier (boosted): queued in BOOST_DSQ ahead of unboosted work, earliest
 *    deadline first, where the deadline is the enqueue time plus a step per level below the top: stronger
 *    levels go first, and a weaker one that has waited long enough goes before a fresh stronger one
 *    (aging). A waking boosted task preempts a task that is unboosted or of a strictly weaker level, never
 *    an equal or stronger one, found through a mask of the CPUs running nothing boosted; nor does it go
 *    before an equal or stronger task already handed to that CPU and not yet run. It leaves its default
 *    pick for another CPU running nothing boosted when a task bound to the pick lately waited
 *    there for boosted work (find_unbound): that one cannot move, it can.
 *  - priority 10-20, the head-start tier: an unboosted task in every respect (fair queue, the unboosted
 *    wake-up rule, preempted by the preempt tier) except that part of each run's charge is forgiven, 50 %
 *    at 10 down to 5 % at 20 (upstream's vtime reduction): a share at most twice its unboosted one, never a
 *    place ahead of the queue or a preemption its unboosted twin would not make.
 *  - priority 0 with a slice: fair, with its own slice.
 *  - no entry: fair (weighted vtime) with the default slice. Like the kernel's fair class, the share is
 *    split between task groups (cgroups, or sessions through autogroup) first, then between the group's
 *    runnable tasks. Unboosted tasks queue per NUMA node (one queue on a single-node host), all ordered
 *    by the one vtime clock: a CPU takes from its node's queue, from a more crowded node's when the queues
 *    drift apart by more than a task per CPU, and from any node's when its own is empty.
 *  - a woken task takes an idle CPU when there is one (the kernel's pick, asked without the synchronous
 *    flag, so never the waker's busy CPU); else the rules above and below place it.
 *  - an unboosted waker (the head-start tier judged as its unboosted twin) preempts the unboosted task of a
 *    CPU when it is eligible (not ahead of the pool) and its virtual deadline comes first, as EEVDF, its
 *    vtime floored a slice behind the lower of the pool's clock and the running task's own, unless
 *    that run is its own group's and in its first millisecond; one that shares its group with other
 *    runnable tasks is judged with a default slice at its weight of credit, against a run past its first
 *    millisecond (a sleeper in a crowded session, without hackbench's chains).
 *  - every run, boosted or not, is charged to the task's vtime; after a boosted run it may lead the fair
 *    pool by at most one default slice (so a demoted task waits little), and its `served` measure by at
 *    most one window past the later of the fair pool's clock and the reserve's own.
 *  - the reserve: each CPU gives a turn to the task served least, unboosted (by vtime) or boosted (by
 *    served), at least once per (window - budget), and serves nothing else first once boosted tasks used
 *    more than boost_share_percent of it in the current window. A boosted task that the boosted queue
 *    starves is served there as if unboosted: being boosted never costs a task the share it would get
 *    unboosted.
 *  - a boosted task that used more than boost_share_percent of a CPU in its window runs unboosted until
 *    the window ends; so does a head-start task (without its head start). Both tiers are guarded alike.
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
 *
 * The source is one compilation unit: this file includes the parts, each once, where what it uses is
 * already defined (none is built alone). One unit rather than objects linked with bpftool: the object is
 * the one a single file made, and what one part calls in another stays static, where linking would need
 * it global, verified on its own. The parts, in the order included:
 *   gthulhu.h        the layouts shared with the agent (gthulhu_node/scheduler/layout.py mirrors them)
 *   compat.bpf.h     what differs between kernels: kfunc names, CO-RE enum values, ops flags, the ops type
 *   state.bpf.h      queues, settings, maps, the task, cgroup and CPU contexts, helpers every part uses
 *   topology.bpf.c   CPUs running nothing boosted, NUMA domains, placing a boosted waker, CPU capacities
 *   cgroup_bw.bpf.c  cpu.max: budgets, charging, parking and release, the stop timer
 * and this file: the strategy lookup, then the callbacks along a task's path (select_cpu, enqueue,
 * dispatch, running, runnable, stopping, tick), hotplug, task and cgroup lifetimes, init and exit, and
 * the ops table.
 */
#include "compat.bpf.h"
#include "gthulhu.h"

char _license[] SEC("license") = "GPL";

#include "state.bpf.h"
#include "topology.bpf.c"
#include "cgroup_bw.bpf.c"

/* What a task's entry asks for (before the boost guard, effective_prio): its slice, rank and head start. */
struct strategy {
	u64 slice;
	u32 prio;       /* the rank (strength_of), not the contract's number */
	u32 head_start;
};

static __always_inline void take(struct strategy *s, const struct gthulhu_entry *e)
{
	struct strength st = strength_of(e->priority);

	s->prio = st.rank;
	s->head_start = st.head_start;
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
	s->head_start = 0;
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
		s->prio = AGENT_RANK;
		count(agent_boosts);
	}
}

/* One lookup per wakeup: select_cpu's result is kept for the enqueue that follows it. */
static void strategy_of(struct task_struct *p, struct task_ctx *tctx, struct strategy *s)
{
	if (tctx && tctx->cached) {
		tctx->cached = 0;
		s->prio = tctx->cached_prio;
		s->head_start = tctx->cached_head_start;
		s->slice = tctx->cached_slice;
		return;
	}
	lookup_strategy(p, s);
}

/* The per-task guard: a boosted task over its share of one CPU runs fair until its window ends. */
static u32 effective_prio(struct task_ctx *tctx, u32 prio, u64 now)
{
	if (!prio || before(now, tctx->demoted_until))
		return 0;
	return prio;
}

/* The same guard for the head-start tier: over its share, it runs without its head start. */
static __always_inline u32 effective_head_start(struct task_ctx *tctx, struct strategy *s, u64 now)
{
	return before(now, tctx->demoted_until) ? 0 : s->head_start;
}

/* Whether the boosted run in progress has crossed the task's budget for its window. */
static __always_inline bool over_budget(struct task_ctx *tctx, u64 now)
{
	u64 used = tctx->started_at ? now - tctx->started_at : 0;

	if (now - tctx->window_start < settings.boost_window_ns)
		used += tctx->window_used;
	return used > boost_budget();
}

/*
 * The wake-up rule for unboosted tasks: virtual deadlines, as EEVDF orders its entities. A task's deadline is
 * its vtime plus what a whole slice costs it at its weight (slice_vtime): a light sleeper alone in its
 * session pays one slice for it, each of eight hogs sharing another session eight. A waking task preempts the
 * unboosted task a CPU runs when it is eligible (its vtime not past the pool's, vtime_now: it has not had
 * more than its share) and its deadline comes first, its vtime floored one default slice behind the pool (or
 * the running task, where that is behind: beats), or one default slice at its own weight against a run
 * older than PROTECT_NS; never a run of its own group
 * younger than that, unless it may run on that CPU only (wakeup_preempts). The head-start tier is judged on
 * its full-charge vtime both as waker and as the running task (twin_vtime): its head start is CPU share,
 * never a place ahead at wake-up. The rule this replaced (half a slice behind the running task's vtime) held
 * for a sleeper floored one slice behind the pool only against the task that started last
 * (docs/scheduler.md).
 */
static __always_inline u64 slice_vtime(struct task_ctx *tctx)
{
	return tctx->slice_vtime ?: settings.default_slice_ns;
}

/*
 * A run younger than this is safe from a waker of its own group and from one that only its larger credit
 * lets preempt (unless the waker may run on that CPU only: wakeup_preempts): the tasks of one crowded group
 * (hackbench's 80) would otherwise preempt each other's short runs in chains, a message per preemption
 * (6.12 beside a loaded host: 4-13x EEVDF's time while only the credited wakers were held off). Not from a
 * waker of another group: a lone sleeper in its own session paid 1.4x EEVDF's latency when every waker was
 * held off (7.3, 2026-12-07).
 */
#define PROTECT_NS 1000000ULL

/*
 * Eligible (not past the pool), deadline before the running task's, its vtime floored `credit` behind the
 * pool or behind the running task's (full-charge, floored) vtime where that is lower; behind the pool only
 * while no run of ours is on (a higher class holds the CPU, or it idles: the record is the last run's).
 * vtime_now, the highest vtime an unboosted run started at, leads the pool by up to what one run costs the
 * task that set it: a hog of a crowded group pays eight slices of vtime for one, so a sleeper floored
 * against it alone was judged as having run more than a busy task alone in its session, refused at 80 % of
 * its wake-ups, and queued behind most of the hogs (6.12, one busy shell loop beside `stress-ng --cpu 8`:
 * run-queue wait 2.4-2.8 ms against EEVDF's 0.12-0.15). Two floored runs tie no more: a waker floored now
 * goes before a run floored at its start (a light task of another session at every wake-up, as EEVDF's
 * earlier deadline does), at most once per wake-up, since a cut run is requeued, not re-placed.
 */
static __always_inline bool beats(struct task_ctx *tctx, struct cpu_ctx *c, u64 full, u64 credit)
{
	u64 level = c->run_on && before(c->vtime, vtime_now) ? c->vtime : vtime_now;
	u64 vtime = before(full, level - credit) ? level - credit : full;

	return !before(vtime_now, vtime) && before(vtime + slice_vtime(tctx), c->deadline);
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
 * The group ops.runnable keys the task by (its cgroup, else its autogroup; 0 none), without runnable's
 * side effects: select_cpu runs before runnable, and a woken task's group is cleared while it sleeps.
 */
static __always_inline u64 group_key(struct task_struct *p, struct task_ctx *tctx)
{
	return tctx->group ?: tctx->cgid ?: (u64)autogroup_of(p, tctx);
}

/* What wakeup_preempts found; WAKE_NO is false, so a caller may test it as a bool. */
enum wake_verdict {
	WAKE_NO,     /* the rule does not hold, or the CPU's local DSQ is taken (a bound waker may join) */
	WAKE_USUAL,  /* holds with the usual credit */
	WAKE_CREDIT, /* holds only with the crowded-group credit (fair_preemptions_credit) */
};

/*
 * The rule, on the task's full-charge vtime, never against a run of the waker's (or re-placed cut run's)
 * own group (`group`, group_key) younger than PROTECT_NS: with a sleeper's usual credit (one default slice
 * of vtime), or, for a woken task (not a cut run re-placed), with what a default slice costs it at its
 * weight (wake_credit) against a run older than PROTECT_NS. A sleeper sharing its session with eight hogs
 * pays nine default slices of vtime for one default slice of run: one default slice of vtime credit left it
 * judged behind the running hog at most wake-ups (4.4x EEVDF's latency). One default slice of run is the
 * credit a lone nice 0 sleeper has; EEVDF too keeps a sleeper's lag in its own weight's terms. A task's own
 * longer slice buys it no credit: its later deadline stays later. A waker `bound` to this one CPU is judged
 * by the rule alone against a run that may go elsewhere.
 */
static __always_inline enum wake_verdict wakeup_preempts(struct task_ctx *tctx, u64 group, s32 cpu, u64 now,
							 bool woken, bool bound)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);
	u64 full = tctx->vtime + tctx->forgiven, credit = settings.default_slice_ns;
	enum wake_verdict verdict = WAKE_USUAL;
	bool young;

	if (!c || c->prio)
		return WAKE_NO;
	/*
	 * Not from a waker that may run on this CPU only against a run that may go elsewhere: the waker has no
	 * other CPU to go to, and, refused, it waited in the fair queue for a slice of its own session to end (a
	 * thread pinned among eight hogs of its session, 7.3, 2026-12-07: p99 1.20x EEVDF's, 0.63x with this).
	 * Both bound, the protection holds: a group pinned to one CPU (`taskset -c 0 hackbench`, 6.12) took
	 * 9.7-12.2 s without it against 0.76-0.78 with it (EEVDF 0.88-0.90), its tasks preempting each other.
	 */
	young = !(bound && !c->run_bound) && before(now, c->run_start + PROTECT_NS);
	if (young && group && group == c->run_group)
		return WAKE_NO;
	if (!beats(tctx, c, full, credit)) {
		if (!woken || tctx->wake_credit <= credit || young ||
		    !beats(tctx, c, full, tctx->wake_credit))
			return WAKE_NO;
		verdict = WAKE_CREDIT;
	}
	/*
	 * A waker bound here joins unboosted wakers inserted to preempt whose preemption is still pending
	 * (fair_waker): refused, it waited in the fair queue behind the run they cut, whose key is older than a
	 * sleeper's floor, for that run's whole slice (cyclictest's pinned thread, woken in the interrupt that
	 * put its main thread on this CPU first: 6.12, 78-93 such refusals per 8 s). Nothing boosted may wait
	 * there (handed).
	 */
	if (local_free(cpu) || (bound && c->fair_waker && !c->handed))
		return verdict;
	return WAKE_NO;
}

/* CPUs an unboosted waker looks at after its default pick, in its node, for one whose task it preempts. */
#define WAKE_SCAN 8

/*
 * A CPU the unboosted waker may use whose task it preempts (wakeup_preempts): `from` (the default pick: its
 * cache) if it qualifies, else the one with the latest deadline among the WAKE_SCAN CPUs after it in its
 * node; -1 if none.
 */
static s32 find_preemptible(struct task_struct *p, struct task_ctx *tctx, s32 from, bool woken)
{
	u64 now = bpf_ktime_get_ns(), latest = 0, group = group_key(p, tctx);
	u32 n = settings.nr_cpus, node = domain_of(from);
	struct bpf_iter_num it;
	struct cpu_ctx *c;
	s32 best = -1, cpu;
	int *i;

	if (wakeup_preempts(tctx, group, from, now, woken, false))
		return from;
	bpf_iter_num_new(&it, 1, n <= WAKE_SCAN ? n : WAKE_SCAN + 1);
	while ((i = bpf_iter_num_next(&it))) {
		cpu = ((u32)from + (u32)*i) % n;
		if (domain_of(cpu) != node || !bpf_cpumask_test_cpu(cpu, p->cpus_ptr) ||
		    !wakeup_preempts(tctx, group, cpu, now, woken, false))
			continue;
		c = cpu_ctx_of(cpu);
		if (c && (best < 0 || before(latest, c->deadline))) {
			best = cpu;
			latest = c->deadline;
		}
	}
	bpf_iter_num_destroy(&it);
	return best;
}

/*
 * A waking unboosted run preempts its CPU's task by the wake-up rule (wakeup_preempts): into that CPU's
 * local DSQ with ENQ_PREEMPT. Not while boosted tasks wait: they go first. A run that a boosted waker
 * preempted before its slice ended (typically a sleeper in its 50 us, cut_short) is placed by the same
 * rule on the CPU find_preemptible picks, since its own CPU now runs its preemptor: back in the fair queue
 * it waited for a slice to end somewhere. That one is the task being switched out, whose migration-disabled
 * count a kernel without PREEMPT_RCU (6.18+) reports without the BPF entry's share: moved straight to
 * another CPU's local DSQ, a truly pinned one would have us ejected. So it is queued at its (least) key and
 * that CPU is kicked to preempt: its dispatch takes it from the fair queue, where the kernel checks.
 */
static bool wakeup_preempt(struct task_struct *p, struct task_ctx *tctx, u64 slice, u64 enq_flags, bool boosted)
{
	bool cut = tctx->cut_short, woken = enq_flags & ENQ_WAKEUP, bound = woken && p->nr_cpus_allowed == 1;
	enum wake_verdict verdict = WAKE_NO;
	struct cpu_ctx *c;
	s32 cpu = scx_bpf_task_cpu(p);
	u64 now = bpf_ktime_get_ns();

	tctx->cut_short = 0; /* one re-placement per cut: a later enqueue (setaffinity, nice) is not one */
	if (!woken && cut && p->nr_cpus_allowed > 1) {
		cpu = find_preemptible(p, tctx, cpu, false);
	} else if (!woken) {
		/* cut short on the one CPU it may use: the boosted waker runs its burst here first */
		if (cut && !boosted)
			note_bound_wait(cpu, now, true);
		return false;
	}
	if (cpu >= 0 && bpf_cpumask_test_cpu(cpu, p->cpus_ptr))
		verdict = wakeup_preempts(tctx, group_key(p, tctx), cpu, now, woken, bound);
	if (verdict == WAKE_NO) {
		/* boosted wakers keep off this CPU a while if they can (find_unbound): this one cannot */
		if (bound && !boosted)
			note_bound_wait(cpu, now, false);
		if (!boosted)
			count(fair_wakeups_queued);
		return false;
	}
	if (scx_bpf_dsq_nr_queued(BOOST_DSQ)) {
		if (!boosted)
			count(fair_wakeups_held);
		return false;
	}
	count(fair_preemptions);
	if (verdict == WAKE_CREDIT)
		count(fair_preemptions_credit);
	tctx->stats.preemptions++;
	if (!woken) {
		dsq_insert_vtime(p, fair_dsq(domain_of(cpu)), slice, fair_vtime(tctx), enq_flags);
		scx_bpf_kick_cpu(cpu, KICK_PREEMPT);
		return true;
	}
	c = cpu_ctx_of(cpu);
	/* a bound waker joining (wakeup_preempts) queues behind the wakers whose preemption is pending */
	if (!local_free(cpu)) {
		dsq_insert(p, DSQ_LOCAL_ON | cpu, slice, enq_flags);
		return true;
	}
	dsq_insert(p, DSQ_LOCAL_ON | cpu, slice, enq_flags | ENQ_PREEMPT);
	if (c)
		c->fair_waker = 1;
	return true;
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
	/*
	 * The kernel's pick without the synchronous flag. With it, the pick returns the waker's own busy CPU
	 * as if idle (6.12: whenever some CPU is idle and the waker's local DSQ is empty; 7.3: when prev_cpu
	 * is not idle), and the direct insert below put the wakee behind the waker there, outside the boost
	 * and vtime order, while another CPU idled: a pipe's two ends ran one after the other on one CPU
	 * (docs/scheduler.md, "An idle CPU first"). Without it, an idle CPU or none.
	 */
	if (cpu < 0)
		cpu = scx_bpf_select_cpu_dfl(p, prev_cpu, wake_flags & ~WAKE_SYNC, &idle);
	/* Over its cgroup's cpu.max: enqueue parks it; the idle CPU claimed for it is woken to idle again. */
	if (idle && bw_held(tctx, now)) {
		scx_bpf_kick_cpu(cpu, KICK_IDLE);
		idle = false;
	}
	/* The default policy claimed an idle CPU for us: run there now, or that CPU idles until kicked. */
	if (idle) {
		if (tctx) {
			tctx->prio = prio;
			tctx->head_start = prio ? 0 : effective_head_start(tctx, &s, now);
			tctx->slice = s.slice;
		}
		dsq_insert(p, DSQ_LOCAL, s.slice, 0);
		hand(cpu_ctx_of(cpu), cpu, prio);
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
	tctx->cached_head_start = s.head_start;
	tctx->cached_slice = s.slice;
	tctx->cached = 1;
	/* Unboosted (the head-start tier too): a CPU whose task it preempts by the wake-up rule, else the pick. */
	if (!prio) {
		victim = p->nr_cpus_allowed > 1 && !bw_held(tctx, now) ? find_preemptible(p, tctx, cpu, true) : -1;
		return victim >= 0 ? victim : cpu;
	}
	/*
	 * A lesser boost on the default pick keeps its CPU while another runs nothing boosted. Nor is the pick
	 * kept while an unboosted waker waits in its local DSQ: inserted at the head, this one would make it
	 * wait through a whole burst (a sleeper beside a boosted engine: 1.9 ms per wake-up against 0.5).
	 */
	if (placed || p->nr_cpus_allowed == 1)
		return cpu;
	if (!prio_on(cpu) && preemptible_for(cpu, prio, now) && local_free(cpu)) {
		/* Not over a waker bound to this CPU while another CPU runs nothing boosted (find_unbound). */
		if (!bound_waits(cpu, now))
			return cpu;
		victim = find_unbound(p, cpu, prio, now);
		if (victim >= 0)
			count(bound_steers);
		return victim >= 0 ? victim : cpu;
	}
	victim = find_victim(p, cpu, prio, now);
	return victim >= 0 ? victim : cpu;
}

/*
 * ENQ_LAST comes from put_prev after the CPU has picked what runs next (idle): a task inserted into its
 * local DSQ then waits for the next scheduling event there, and the kernel leaves that event to the BPF
 * scheduler. The kick lands once the CPU is idle and makes it pick the task again.
 */
static __always_inline void insert_last(struct task_struct *p, u64 slice, u64 enq_flags, u32 prio)
{
	s32 cpu = scx_bpf_task_cpu(p);

	dsq_insert(p, DSQ_LOCAL, slice, enq_flags);
	hand(cpu_ctx_of(cpu), cpu, prio);
	scx_bpf_kick_cpu(cpu, KICK_IDLE);
}

/*
 * A boosted task requeued (its slice ended) on a CPU less capable than another it may use that is idle or
 * runs something less important: straight to that CPU's local DSQ, preempting, instead of BOOST_DSQ, from
 * which the CPU that just ran it would take it back. Only while no boosted task waits in BOOST_DSQ (their
 * deadlines come first) and, for a busy target, while nothing waits in its local DSQ (a waker handed to
 * it is not overtaken).
 */
static bool move_to_capable(struct task_struct *p, struct task_ctx *tctx, struct strategy *s, u32 prio,
			    s32 cpu, u64 enq_flags)
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
		hand(cpu_ctx_of(to), to, prio);
		scx_bpf_kick_cpu(to, KICK_IDLE);
	} else if (!scx_bpf_dsq_nr_queued(DSQ_LOCAL_ON | to)) {
		dsq_insert(p, DSQ_LOCAL_ON | to, s->slice, enq_flags | ENQ_PREEMPT | ENQ_HEAD);
		hand(cpu_ctx_of(to), to, prio);
		count(preemptions);
		tctx->stats.preemptions++;
	} else {
		return false;
	}
	count(capacity_placements);
	return true;
}

static void enqueue_boosted(struct task_struct *p, struct task_ctx *tctx, struct strategy *s, u32 prio,
			    u64 enq_flags, u64 now)
{
	s32 cpu = scx_bpf_task_cpu(p);
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	count(boosted_dispatches);
	/*
	 * A waking boosted task: local DSQ + ENQ_PREEMPT, so it runs the moment its CPU reschedules instead
	 * of at that CPU's next dispatch. Only wakeups: a task requeued at the end of its slice goes through
	 * BOOST_DSQ, so it never jumps ahead of tasks already handed to this CPU. Only the task's own CPU:
	 * affinity and migration-disabled tasks stay safe. Not on a CPU whose boost share is spent: the
	 * unboosted tasks' turn there must not be cut short. Only over a strictly weaker rank: equals wait
	 * their turn in BOOST_DSQ, and a weaker waker never displaces a stronger runner. Nor does it go before
	 * an equal or stronger task already handed to that CPU (goes_first: such a CPU is no victim either, so
	 * this is a bound task, a waker no CPU qualified for, or a race): it waits in BOOST_DSQ, taken by deadline
	 * after what it was handed (and after a reserve turn if one is due). The unboosted rule below then
	 * never holds (that DSQ is not empty).
	 */
	if ((enq_flags & ENQ_WAKEUP) && c && weaker(c->prio, prio) && !cpu_throttled(c, now) &&
	    bpf_cpumask_test_cpu(cpu, p->cpus_ptr) && goes_first(c, cpu, prio)) {
		dsq_insert(p, DSQ_LOCAL_ON | cpu, s->slice, enq_flags | ENQ_PREEMPT | ENQ_HEAD);
		hand(c, cpu, prio);
		c->boost_waker = 1;
		count(preemptions);
		tctx->stats.preemptions++;
		return;
	}
	/*
	 * Never worse off for being boosted: where the unboosted wake-up rule preempts and the boosted one
	 * does not (a CPU whose boost share is spent), it preempts by that rule, and this run is unboosted.
	 */
	tctx->prio = 0;
	if ((enq_flags & ENQ_WAKEUP) && wakeup_preempt(p, tctx, s->slice, enq_flags, true))
		return;
	tctx->prio = prio;
	if (!(enq_flags & ENQ_WAKEUP) && move_to_capable(p, tctx, s, prio, cpu, enq_flags))
		return;
	/* Bound behind its CPU's boosted run: marked as its unboosted twin would be (find_unbound). */
	if ((enq_flags & ENQ_WAKEUP) && p->nr_cpus_allowed == 1 && c && c->prio)
		note_bound_wait(cpu, now, false);
	/* Earliest deadline first: rank buys a head start, waiting catches up with it. */
	dsq_insert_vtime(p, BOOST_DSQ, s->slice, boost_deadline(prio, now), enq_flags);
	kick_idle(p);
}

void OP(gthulhu_enqueue, struct task_struct *p, u64 enq_flags)
{
	struct task_ctx *tctx = ctx_of(p);
	u64 now = bpf_ktime_get_ns();
	struct strategy s;
	u32 prio;

	strategy_of(p, tctx, &s);
	/* A per-CPU kernel thread (ksoftirqd, kworker/N) can only run there: queue it there, not globally. */
	if ((p->flags & PF_KTHREAD) && p->nr_cpus_allowed == 1) {
		if (tctx) {
			tctx->prio = 0;
			tctx->head_start = 0;
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
			insert_last(p, s.slice, enq_flags, 0);
		else
			dsq_insert_vtime(p, fair_dsq_of(p), s.slice, vtime_now, enq_flags);
		return;
	}
	prio = effective_prio(tctx, s.prio, now);
	tctx->prio = prio;
	tctx->head_start = prio ? 0 : effective_head_start(tctx, &s, now);
	tctx->slice = s.slice;
	/* cpu.max before priority: a boosted task in a limited cgroup is held to the limit. */
	if (bw_park(p, tctx, s.slice, enq_flags, now))
		return;
	if (enq_flags & ENQ_LAST) {
		insert_last(p, s.slice, enq_flags, prio);
		return;
	}
	if (prio) {
		enqueue_boosted(p, tctx, &s, prio, enq_flags, now);
		return;
	}

	count(fair_dispatches);
	if (wakeup_preempt(p, tctx, s.slice, enq_flags, false))
		return;
	dsq_insert_vtime(p, fair_dsq(domain_of(scx_bpf_task_cpu(p))), s.slice, fair_vtime(tctx), enq_flags);
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
	/* Either tier's run counts: a head start is the 10-20 levels' boost. */
	if (tctx->prio || tctx->head_start)
		tctx->stats.boosted_runs++;
	if (!tctx->prio && before(vtime_now, tctx->vtime))
		vtime_now = tctx->vtime;
	cpu = scx_bpf_task_cpu(p);
	c = cpu_ctx_of(cpu);
	if (c) {
		set_cpu_prio(cpu, c, tctx->prio);
		c->vtime = twin_vtime(tctx);
		c->run_start = tctx->started_at; /* before the deadline; read unlocked, the pair is a hint */
		c->run_group = tctx->group;
		c->run_bound = p->nr_cpus_allowed == 1;
		c->run_on = 1;
		c->deadline = c->vtime + slice_vtime(tctx);
		c->boost_waker = 0; /* it was for the run before, or for none (an idle CPU) */
		c->fair_waker = 0; /* the preemption it noted happened */
		if (local_free(cpu))
			c->handed = 0; /* all it was handed runs or ran */
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
 * Add `delta` to a cgroup's load and carry its activation (load from zero to positive, or back) up the
 * tree as a change of its contrib to its parent's load, level by level.
 */
static void cgroup_add(u64 id, s64 delta)
{
	struct bpf_iter_num levels;
	struct cgroup_ctx *cg;
	s64 before, up;

	bpf_iter_num_new(&levels, 0, CG_MAX_DEPTH); /* not a counter: see RESERVE_SCAN (state.bpf.h) */
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

	if (!tctx)
		return;
	tctx->woke = 1;
	if (tctx->group)
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

	bpf_iter_num_new(&levels, 0, CG_MAX_DEPTH); /* not a counter: see RESERVE_SCAN (state.bpf.h) */
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
 * The vtime a run of `used` ns costs at `weight`: used / weight, where a grouped task's weight is its part
 * of its groups' shares at every level (effective_weight). Eight hogs in one session then cost eight times
 * what a lone thread in another session pays, as under EEVDF.
 */
static __always_inline u64 charge_at(u64 used, u64 weight)
{
	u64 charge;

	if (used > MAX_CHARGED_NS)
		used = MAX_CHARGED_NS;
	charge = used * (100ULL << WEIGHT_SHIFT) / weight;
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
		tctx->stats.demotions++;
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
	u64 now = bpf_ktime_get_ns(), used, lead, charge, forgive, weight;

	if (c) {
		set_cpu_prio(cpu, c, 0);
		bw_run_ended(c);
		c->run_on = 0;
	}
	if (!tctx)
		return;
	/*
	 * Runnable with slice left: a higher class (or core scheduling) took the CPU, and the kernel puts the
	 * task back at the head of its local DSQ without enqueue. Our own preemptions and slice ends zero it.
	 */
	if (runnable && p->scx.slice && tctx->prio)
		hand(c, cpu, tctx->prio);
	/* A task already running when the scheduler was enabled has no start: charge nothing for that run. */
	used = tctx->started_at ? now - tctx->started_at : 0;
	tctx->started_at = 0;
	bw_charge(tctx, now);
	tctx->bw_mark = 0;
	/*
	 * Cut short by a boosted waker in the first run after it woke: placed by the wake-up rule when queued
	 * again. Not every preempted run: a hog preempted by a sleeper, re-placed so, displaced the other CPU's
	 * hog at most wake-ups (6.12: the hogs' throughput fell and the sleeper's run-queue wait rose, 2-5x
	 * EEVDF's); nor a hog cut by a boosted waker, which then preempted the other CPU's hog at each of the
	 * engine's wake-ups and, until that CPU rescheduled, left a waking sleeper no CPU to go to.
	 */
	tctx->cut_short = runnable && tctx->woke && used < tctx->slice && c && c->boost_waker;
	tctx->woke = 0;
	if (c)
		c->boost_waker = 0;
	weight = effective_weight(p, tctx);
	charge = charge_at(used, weight);
	tctx->slice_vtime = charge_at(tctx->slice ?: settings.default_slice_ns, weight);
	tctx->wake_credit = charge_at(settings.default_slice_ns, weight);
	tctx->served += charge;
	/*
	 * The head-start tier: part of the charge forgiven (at most half, so at most twice the unboosted share;
	 * the wake-up rule adds it back, twin_vtime, up to a lead of two slices over the pool), and its run time
	 * counted against the same per-task budget as a boosted task's, whose guard then withdraws the head
	 * start until the window ends (effective_head_start). Not the CPU's boost share: it is fair work, which
	 * the reserve already serves.
	 */
	if (tctx->head_start) {
		forgive = charge * tctx->head_start / 100;
		tctx->vtime += charge - forgive;
		tctx->forgiven += forgive;
		lead = vtime_now + 2 * settings.default_slice_ns;
		if (before(lead, tctx->vtime + tctx->forgiven))
			tctx->forgiven = before(tctx->vtime, lead) ? lead - tctx->vtime : 0;
		charge_boost(tctx, NULL, used, now);
		return;
	}
	tctx->forgiven = 0;
	tctx->vtime += charge;
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
	c->handed = 0;
	c->fair_waker = 0;
	c->run_on = 0;
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
	bw_cgroup_init(&cg, cgrp, args);
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
