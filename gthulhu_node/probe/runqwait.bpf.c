/*
 * Run-queue wait of selected threads, as log2 histograms, compiled by BCC at run time.
 *
 * A wait starts when a thread becomes runnable without running: woken (sched_wakeup, sched_wakeup_new), or
 * switched out while still runnable (sched_switch, preempted, or with its state still TASK_RUNNING:
 * rescheduled on its way back to user space, or a yield). It ends at the sched_switch that puts the thread
 * on a CPU. Only threads in `targets` (tid -> intent index, written by user space) are measured; every
 * other event costs one hash lookup.
 *
 * Raw tracepoints, not the tracefs ones: attaching a tracefs tracepoint opens a perf event through
 * tracefs, which the agent can no longer do once it has dropped CAP_SYS_ADMIN (docs/probe.md); a raw
 * tracepoint needs only CAP_BPF and CAP_PERFMON, and no tracefs. The arguments are the tracepoints'
 * TP_PROTO, unchanged since 5.18: sched_wakeup(p), sched_switch(preempt, prev, next, prev_state).
 *
 * NSLOTS, MAX_TARGETS, MAX_INTENTS and THREAD_HIST come from the Python side as -D flags.
 */
#include <linux/sched.h>

struct intent_slot {
    u32 intent;
    u32 slot;
};

struct thread_slot {
    u32 tid;
    u32 slot;
};

struct wait_total {
    u64 sum_ns;
    u64 count;
    u64 max_ns;
};

BPF_HASH(targets, u32, u32, MAX_TARGETS);
BPF_HASH(wait_start, u32, u64, MAX_TARGETS);
BPF_HISTOGRAM(intent_hist, struct intent_slot, MAX_INTENTS * NSLOTS);
BPF_HASH(intent_total, u32, struct wait_total, MAX_INTENTS);
#ifdef THREAD_HIST
BPF_HISTOGRAM(thread_hist, struct thread_slot, MAX_TARGETS * 16);
BPF_HASH(thread_total, u32, struct wait_total, MAX_TARGETS);
#endif

static inline void woken(u32 tid)
{
    if (!targets.lookup(&tid))
        return;
    u64 now = bpf_ktime_get_ns();
    /* insert, not update: waking a thread that is already queued (preempted) must not restart its wait. */
    wait_start.insert(&tid, &now);
}

static inline void add_total(struct wait_total *t, u64 delta)
{
    lock_xadd(&t->sum_ns, delta);
    lock_xadd(&t->count, 1);
    /* Not atomic against another CPU updating the same total at the same instant; a lost max is rare. */
    if (delta > t->max_ns)
        t->max_ns = delta;
}

static inline void wait_ends(u32 tid)
{
    u64 *start = wait_start.lookup(&tid);
    if (!start)
        return;
    u64 delta = bpf_ktime_get_ns() - *start;
    wait_start.delete(&tid);
    u32 *intent = targets.lookup(&tid);
    if (!intent)
        return;
    u32 slot = bpf_log2l(delta);
    if (slot >= NSLOTS)
        slot = NSLOTS - 1;

    struct intent_slot ik = {.intent = *intent, .slot = slot};
    intent_hist.atomic_increment(ik);
    struct wait_total zero = {};
    struct wait_total *it = intent_total.lookup_or_try_init(intent, &zero);
    if (it)
        add_total(it, delta);
#ifdef THREAD_HIST
    struct thread_slot tk = {.tid = tid, .slot = slot};
    thread_hist.atomic_increment(tk);
    struct wait_total *tt = thread_total.lookup_or_try_init(&tid, &zero);
    if (tt)
        add_total(tt, delta);
#endif
}

static inline u32 task_tid(u64 arg)
{
    u32 tid = 0;
    bpf_probe_read_kernel(&tid, sizeof(tid), &((struct task_struct *)arg)->pid);
    return tid;
}

RAW_TRACEPOINT_PROBE(sched_wakeup)
{
    woken(task_tid(ctx->args[0]));
    return 0;
}

RAW_TRACEPOINT_PROBE(sched_wakeup_new)
{
    woken(task_tid(ctx->args[0]));
    return 0;
}

RAW_TRACEPOINT_PROBE(sched_switch)
{
    bool preempt = ctx->args[0];
    u32 prev = task_tid(ctx->args[1]);
    unsigned int prev_state = ctx->args[3];

    if (prev != 0 && targets.lookup(&prev)) {
        if (preempt || prev_state == TASK_RUNNING) {
            u64 now = bpf_ktime_get_ns();
            wait_start.update(&prev, &now);
        } else {
            /* Asleep: a wakeup seen while it was still running (woken before it slept) is void. */
            wait_start.delete(&prev);
        }
    }
    wait_ends(task_tid(ctx->args[2]));
    return 0;
}
