// SPDX-License-Identifier: GPL-2.0
/*
 * cgroup bandwidth: cpu.max enforced for every task, boosted or not (part of the one compilation unit
 * gthulhu.bpf.c, included after topology.bpf.c; not built alone). The design is in gthulhu.bpf.c's top
 * comment; the callbacks call in here:
 *  - cgroup_init and cgroup_set_bandwidth set a cgroup's limit (bw_cgroup_init, bw_set_us): the kernel
 *    passes cpu.max from 6.17 (the object built with GTHULHU_CGROUP_BW); before, it is read from the
 *    cgroup's task_group and read again as walks pass it (bw_reread);
 *  - running, tick and stopping charge the run to the cgroup and its ancestors (bw_charge, bw_walk), and a
 *    run is cut short by a per-CPU timer when its budget ends (bw_limit_run, bw_keep);
 *  - enqueue parks a task out of budget in THROTTLED_DSQ (bw_park); a timer and dispatch's release pass
 *    move it back (bw_timer_fired, bw_release_due);
 *  - init creates THROTTLED_DSQ and the timer (bw_init).
 */
#ifndef GTHULHU_CGROUP_BW_BPF_C
#define GTHULHU_CGROUP_BW_BPF_C

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
	/* bounded by an iterator, not a counter: see RESERVE_SCAN (state.bpf.h) */
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
	/* The pass's bound is a numbers iterator, not a counter: see RESERVE_SCAN (state.bpf.h). */
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

/*
 * A cgroup's cpu.max as cgroup_init first sees it (at load for every cgroup, then for each new one): passed
 * by the kernel from 6.17, before that read from its task_group.
 */
static __always_inline void bw_cgroup_init(struct cgroup_ctx *cg, struct cgroup *cgrp,
					   struct scx_cgroup_init_args *args)
{
#ifdef GTHULHU_CGROUP_BW
	bw_set_us(cg, args->bw_period_us, args->bw_quota_us, args->bw_burst_us, bpf_ktime_get_ns());
#else
	if (BW_IN_KERNEL) {
		/* a cgroup there at load has its task_group linked; a new one gets it at its first walk */
		cg->cgrp = (u64)cgrp;
		cg->tg = bw_tg_of(cg->cgrp);
		if (cg->tg) {
			struct bw_limit l;

			cg->bw_read_at = bpf_ktime_get_ns();
			bw_tg_limit(cg->tg, &l);
			bw_set(cg, l.period, l.quota, l.burst, cg->bw_read_at);
		}
	} else {
		/* no CFS bandwidth in this kernel: the agent reports cpu.max as not enforced */
		count(cgroups_untracked);
	}
#endif
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

#endif /* GTHULHU_CGROUP_BW_BPF_C */
