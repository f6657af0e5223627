// SPDX-License-Identifier: GPL-2.0
/*
 * Topology: where a task may go (part of the one compilation unit gthulhu.bpf.c, included after
 * state.bpf.h; not built alone).
 *  - the CPUs running nothing boosted, as a cpumask a boosted waker searches in one operation;
 *  - domains (NUMA nodes): each CPU's, the online CPUs per domain, each domain's cpumask, and the fair
 *    queue of each (FAIR_DSQ_BASE + domain);
 *  - placing a boosted waker: a CPU running nothing boosted, else a lesser boost (find_victim), not one
 *    where a task bound to it waited for boosted work while another qualifies (find_unbound); on CPUs of
 *    different capacity, the most capable one (find_capable);
 *  - the CPU masks and domain counts as init finds them (init_cpus, init_domain_masks).
 */
#ifndef GTHULHU_TOPOLOGY_BPF_C
#define GTHULHU_TOPOLOGY_BPF_C

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

/*
 * Whether a CPU runs something of a strictly weaker rank than prio, its boost share is not spent, and
 * nothing of an equal or stronger rank was handed to it and waits there (goes_first): a CPU handed such a
 * task shows its old rank until it reschedules, and a waker sent there would wait for that task's run
 * while another CPU ran a hog.
 */
static __always_inline bool preemptible_for(s32 cpu, u32 prio, u64 now)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	return c && weaker(c->prio, prio) && !cpu_throttled(c, now) && goes_first(c, cpu, prio);
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

/*
 * How long boosted wakers keep off a CPU after a task bound to it waited there for boosted work:
 * longer than a boosted task's usual sleep, so its next wake-ups go elsewhere too.
 */
#define BOUND_WAIT_NS 100000000ULL

/* CPUs a boosted waker scans for one where no bound task waited (find_unbound). */
#define UNBOUND_SCAN 8

/*
 * Note that a task that may run on this CPU only waits for boosted work there: an unboosted waker that found
 * it running, a boosted one that does not go first, or a run a boosted waker cut short (`cut`; the CPU still
 * shows the cut run's rank).
 */
static __always_inline void note_bound_wait(s32 cpu, u64 now, bool cut)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	if (c && (cut || c->prio))
		c->bound_waited = now;
}

static __always_inline bool bound_waits(s32 cpu, u64 now)
{
	struct cpu_ctx *c = cpu_ctx_of(cpu);

	return c && c->bound_waited && before(now, c->bound_waited + BOUND_WAIT_NS);
}

/*
 * Another CPU of from's node the boosted waker may use that runs nothing boosted, has nothing waiting in
 * its local DSQ and where no bound task waited (bound_waits); -1 if none among the UNBOUND_SCAN after it.
 * A thread pinned to `from` (taskset, cyclictest's measuring thread) cannot go elsewhere; the boosted task
 * can: beside a boosted engine on its one CPU, such a thread waited for every burst (1.40x EEVDF's latency).
 */
static s32 find_unbound(struct task_struct *p, s32 from, u32 prio, u64 now)
{
	u32 n = settings.nr_cpus, node = domain_of(from);
	struct bpf_iter_num it;
	s32 found = -1, cpu;
	int *i;

	bpf_iter_num_new(&it, 1, n <= UNBOUND_SCAN ? n : UNBOUND_SCAN + 1);
	while ((i = bpf_iter_num_next(&it))) {
		cpu = ((u32)from + (u32)*i) % n;
		if (domain_of(cpu) == node && !prio_on(cpu) && preemptible_for(cpu, prio, now) &&
		    local_free(cpu) && !bound_waits(cpu, now) && bpf_cpumask_test_cpu(cpu, p->cpus_ptr)) {
			found = cpu;
			break;
		}
	}
	bpf_iter_num_destroy(&it);
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
 * Kernels that stopped doing so (6.18+ without PREEMPT_RCU) make a truly migration-disabled current task
 * read as movable, and a remote local-DSQ insert of it is refused with an error that ejects us: the
 * unboosted wake-up rule never moves the current task that way (wakeup_preempt kicks instead);
 * move_to_capable (big.LITTLE) still trusts this on such kernels.
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

#endif /* GTHULHU_TOPOLOGY_BPF_C */
