/* SPDX-License-Identifier: GPL-2.0 */
/*
 * What differs between the kernels and the libbpf the scheduler runs with, in one place (part of the one
 * compilation unit gthulhu.bpf.c; nothing here schedules):
 *  - the kfuncs, called by one name each and declared under the name this object's kernel has: they were
 *    renamed in 6.13, and the build makes one object per naming (Makefile);
 *  - sched_ext's enum values as the running kernel defines them (CO-RE), never as vmlinux.h's kernel did;
 *  - the ops flags we set, by name, and the ops table's type with only the members we set.
 */
#ifndef GTHULHU_COMPAT_BPF_H
#define GTHULHU_COMPAT_BPF_H

/* vmlinux.h's ops table is the newest kernel's: ours is declared at the end of this file. */
#define sched_ext_ops sched_ext_ops___vmlinux
#include "vmlinux.h"
#undef sched_ext_ops
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_tracing.h>
#include <bpf/bpf_core_read.h>

/* The kfuncs 6.13 renamed: KFUNC(name since 6.13, name in 6.12); the scheduler calls the name defined. */
#ifdef GTHULHU_KFUNCS_6_12
#define KFUNC(name, name_6_12) name_6_12
#else
#define KFUNC(name, name_6_12) name
#endif
#define dsq_insert KFUNC(scx_bpf_dsq_insert, scx_bpf_dispatch)
#define dsq_insert_vtime KFUNC(scx_bpf_dsq_insert_vtime, scx_bpf_dispatch_vtime)
#define dsq_move_to_local KFUNC(scx_bpf_dsq_move_to_local, scx_bpf_consume)
#define dsq_move KFUNC(scx_bpf_dsq_move, scx_bpf_dispatch_from_dsq)
#define dsq_move_set_vtime KFUNC(scx_bpf_dsq_move_set_vtime, scx_bpf_dispatch_from_dsq_set_vtime)
#define dsq_move_vtime KFUNC(scx_bpf_dsq_move_vtime, scx_bpf_dispatch_vtime_from_dsq)
void dsq_insert(struct task_struct *p, u64 dsq_id, u64 slice, u64 enq_flags) __ksym;
void dsq_insert_vtime(struct task_struct *p, u64 dsq_id, u64 slice, u64 vtime, u64 enq_flags) __ksym;
bool dsq_move_to_local(u64 dsq_id) __ksym;
bool dsq_move(struct bpf_iter_scx_dsq *it__iter, struct task_struct *p, u64 dsq_id, u64 enq_flags) __ksym;
void dsq_move_set_vtime(struct bpf_iter_scx_dsq *it__iter, u64 vtime) __ksym;
bool dsq_move_vtime(struct bpf_iter_scx_dsq *it__iter, struct task_struct *p, u64 dsq_id, u64 enq_flags) __ksym;
/* The kfuncs with one name on every kernel we load on. */
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
#define WAKE_SYNC KENUM(scx_wake_flags, SCX_WAKE_SYNC)

/*
 * The ops flags we set. They are data in the ops table, where CO-RE cannot relocate, so their values are
 * written here as every kernel we load on has them (tests/host/test_scheduler_compat.py checks them
 * against the lab kernels' BTF).
 *
 * SCX_OPS_ENQ_LAST (1 << 1 on every kernel), set by every object: a task the kernel would otherwise keep
 * on an otherwise idle CPU is enqueued instead, so one over its cpu.max can be parked.
 */
#define OPS_ENQ_LAST (1ULL << 1)
/*
 * SCX_OPS_HAS_CGROUP_WEIGHT (1 << 16 in 6.12): 6.12 wants a scheduler that handles cpu.weight to say so
 * (without it the kernel logs that we ignore cpu.weight). 6.15 made the flag a no-op that logs a deprecation
 * warning and 7.1 removed it: a kernel refuses flags it does not know. The 6.12 object runs only where the
 * old kfunc names exist, which is 6.12 alone, so only it sets the flag.
 */
#define OPS_HAS_CGROUP_WEIGHT_6_12 (1ULL << 16)
#ifdef GTHULHU_KFUNCS_6_12
#define OPS_FLAGS (OPS_HAS_CGROUP_WEIGHT_6_12 | OPS_ENQ_LAST)
#else
#define OPS_FLAGS OPS_ENQ_LAST
#endif

/*
 * The ops table's type. libbpf 1.1.2 (Debian 12's) refuses a struct_ops type that has a member the running
 * kernel lacks, even one left zero, and every release since 6.12 added members. So the type is declared
 * here with only the members we set, all present since 6.12 (cgroup_set_bandwidth since 6.17, in the
 * 6.17 object only): libbpf matches members by name and copies each to the kernel's own offset. The
 * table itself is at the end of gthulhu.bpf.c.
 */
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

#endif /* GTHULHU_COMPAT_BPF_H */
