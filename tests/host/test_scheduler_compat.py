"""The scheduler objects against the BTF of every kernel we can get, booted or not (tests/btfcheck.py).

These are the x86_64 objects (the arm64 ones: test_scheduler_arm64.py). The lab boots 6.12 and 7.3;
between them, Debian's trixie-backports offers the 7.2 cloud kernels, whose headers packages carry their
BTF. What libbpf 1.1.2 checks before the verifier runs (ops members, kfunc prototypes, CO-RE fields and
enumerators) is checked here for each. Fetching the BTF needs the network once; after that the cache
(/var/cache/gthulhu-node-lab) answers.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from gthulhu_node.backends.base import SchedulerRefused
from gthulhu_node.scheduler import loader
from tests.btfcheck import Btf, check
from tests.vm.kernel import lab_kernel, other_btfs

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "gthulhu_node" / "data"
NEW, OLD = DATA / "gthulhu.x86_64.bpf.o", DATA / "gthulhu-6.12.x86_64.bpf.o"
BW = DATA / "gthulhu-6.17.x86_64.bpf.o"  # 6.17+: also sets ops.cgroup_set_bandwidth (cpu.max)
UNLOADABLE = REPO / "bpf" / ".output" / "gthulhu-unloadable.bpf.o"


def test_the_6_12_object_matches_the_6_12_kernel() -> None:
    assert check(OLD, lab_kernel("6.12").vmlinux) == []


def test_the_6_13_object_matches_the_7_3_kernel() -> None:
    assert check(NEW, lab_kernel("7.3").vmlinux) == []


def test_the_6_17_object_matches_the_7_3_kernel() -> None:
    assert check(BW, lab_kernel("7.3").vmlinux) == []


def test_only_the_6_17_object_has_the_cpu_max_member_in_its_sched_ext_ops_members() -> None:
    """libbpf 1.1.2 refuses an ops member the kernel lacks, even zero: 6.13-6.16 have no cgroup_set_bandwidth,
    so only the object picked on kernels that have it may declare it."""
    def members(obj: Path) -> set[str]:
        return {m["name"] for m in Btf(obj).named(("STRUCT",), "sched_ext_ops")[0]["members"]}

    assert "cgroup_set_bandwidth" in members(BW)
    assert "cgroup_set_bandwidth" not in members(NEW) | members(OLD)
    assert members(BW) - members(NEW) == {"cgroup_set_bandwidth"}
    assert "sched_ext_ops.cgroup_set_bandwidth: not in the kernel" in check(BW, lab_kernel("6.12").vmlinux)


def ops_flags(obj: Path) -> int:
    """The flags an object's ops table sets: its .struct_ops value at the offset its own BTF gives."""
    members = Btf(obj).named(("STRUCT",), "sched_ext_ops")[0]["members"]
    offset = next(m["bits_offset"] // 8 for m in members if m["name"] == "flags")
    elf = obj.read_bytes()
    start, _ = loader.elf_section(elf, ".struct_ops")
    return int.from_bytes(elf[start + offset :][:8], "little")


def ops_flag_values(vmlinux: Path) -> dict[str, int]:
    return {v["name"]: v["val"] for t in Btf(vmlinux).named(("ENUM", "ENUM64"), "scx_ops_flags")
            for v in t["values"]}


def test_the_named_ops_flags_are_the_kernels_own() -> None:
    """compat.bpf.h writes the ops flags as numbers (the ops table is data: CO-RE does not relocate it).
    Each object's flags are its kernel's values of the names it means; 7.3 has no cgroup-weight flag, and
    a kernel refuses a flag it does not know."""
    old, new = ops_flag_values(lab_kernel("6.12").vmlinux), ops_flag_values(lab_kernel("7.3").vmlinux)
    assert ops_flags(OLD) == old["SCX_OPS_HAS_CGROUP_WEIGHT"] | old["SCX_OPS_ENQ_LAST"]
    assert ops_flags(NEW) == ops_flags(BW) == new["SCX_OPS_ENQ_LAST"]
    assert "SCX_OPS_HAS_CGROUP_WEIGHT" not in new


# What a 6.13-6.16 kernel's BTF looks like to the loader: the new kfunc names, an ops table without
# cgroup_set_bandwidth (a BPF object's BTF: libbpf parses it as it parses /sys/kernel/btf/vmlinux).
KERNEL_6_16 = """
struct task_struct;
struct sched_ext_ops { void (*enqueue)(struct task_struct *p, unsigned long long f);
                       void (*cgroup_set_weight)(void *cgrp, unsigned int weight); };
extern void scx_bpf_dsq_insert(struct task_struct *p, unsigned long long d, unsigned long long s,
                               unsigned long long f) __attribute__((section(".ksyms")));
struct sched_ext_ops ops __attribute__((section(".data")));
void *used(void) { return (void *)scx_bpf_dsq_insert; }
"""


def test_the_loader_picks_the_object_by_the_kernels_sched_ext_ops_members(tmp_path: Path) -> None:
    """7.3 (and 7.2) have cgroup_set_bandwidth: the cpu.max object; 6.12 the old names; a kernel with the
    new names but no such member (6.13-6.16) the 6.13 object, which libbpf 1.1.2 can load there."""
    src, btf = tmp_path / "k.c", tmp_path / "k.o"
    src.write_text(KERNEL_6_16)
    subprocess.run(["clang-16", "-g", "-O2", "-target", "bpf", "-c", str(src), "-o", str(btf)], check=True)
    assert "cgroup_set_weight" in loader.ops_members(btf)
    assert loader.kfunc_flavour(btf) == "6.13"
    assert loader.kfunc_flavour(lab_kernel("7.3").vmlinux) == "6.17"
    assert loader.kfunc_flavour(lab_kernel("6.12").vmlinux) == "6.12"
    assert all(loader.kfunc_flavour(path) == "6.17" for path in other_btfs().values())
    assert all(loader.enforces_cpu_max(flavour) for flavour in ("6.12", "6.13", "6.17"))


def test_an_unreadable_kernel_btf_is_a_refusal_that_auto_falls_back_from(tmp_path: Path) -> None:
    """Before: libbpf's parse error (a BackendError, not a refusal) stopped an agent with `backend: auto`
    at start instead of falling back to eevdf."""
    btf = tmp_path / "vmlinux"
    btf.write_bytes(b"not BTF\0scx_bpf_dsq_insert\0")
    with pytest.raises(SchedulerRefused, match="cannot read struct sched_ext_ops"):
        loader.kfunc_flavour(btf)


def test_the_6_13_object_does_not_fit_the_6_12_kernel() -> None:
    """The loader picks the object by the kfunc names the kernel has; the other one must not fit."""
    problems = check(NEW, lab_kernel("6.12").vmlinux)
    assert any(p.startswith("kfunc scx_bpf_dsq_insert:") for p in problems), problems


def test_a_member_the_kernel_lacks_is_found() -> None:
    """What broke 6.12 before the ops table was declared by hand: a member the kernel does not have."""
    problems = check(UNLOADABLE, lab_kernel("7.3").vmlinux)
    assert "sched_ext_ops.gthulhu_no_such_member: not in the kernel" in problems


@pytest.mark.parametrize("version", sorted(other_btfs()))
def test_every_offered_kernel_differs_at_most_in_kfunc_arguments(version: str) -> None:
    """Debian's 7.2.x kernels declare some sched_ext kfuncs with an extra `aux` argument (a different set
    in each point release; 7.3.4 has none). libbpf refuses any object whose declaration differs
    ("func_proto incompatible with kernel", seen booting 7.2.9), so there the agent falls back to the
    eevdf backend (docs/lab.md). Ops members, CO-RE fields and enumerators must fit every kernel."""
    for obj in (NEW, BW):
        problems = check(obj, other_btfs()[version])
        assert all(re.fullmatch(r"kfunc (scx_bpf|bpf_iter_scx)_\w+: \d+ arguments in the kernel", p)
                   for p in problems), problems
