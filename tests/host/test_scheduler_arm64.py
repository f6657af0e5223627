"""The arm64 scheduler objects (gthulhu_node/data/*.aarch64.bpf.o) without an arm64 machine: what libbpf
1.1.2 checks before the verifier runs, against the BTF of Debian's arm64 7.3 cloud kernel
(tests/btfcheck.py: ops members, kfunc prototypes, CO-RE field paths, enumerators) and of every other arm64
cloud kernel the suite offers, as test_scheduler_compat.py does for x86_64; that they are BPF objects; and
that each architecture's object was built from its own kernel's vmlinux.h. No arm64 kernel boots here
(docs/arm64.md): fetching its packages needs the network once, then the lab cache answers.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.btfcheck import Btf, check
from tests.vm.kernel import lab_kernel, other_btfs

DATA = Path(__file__).resolve().parents[2] / "gthulhu_node" / "data"
ARM_NEW, ARM_OLD = DATA / "gthulhu.aarch64.bpf.o", DATA / "gthulhu-6.12.aarch64.bpf.o"
ARM_BW = DATA / "gthulhu-6.17.aarch64.bpf.o"
# The kfuncs only the 6.12 object calls: renamed in 6.13, the old names gone in 6.17.
NAMES_6_12 = {"scx_bpf_dispatch", "scx_bpf_dispatch_vtime", "scx_bpf_consume", "scx_bpf_dispatch_from_dsq",
              "scx_bpf_dispatch_from_dsq_set_vtime", "scx_bpf_dispatch_vtime_from_dsq"}
# platform.machine()'s name -> Debian's
DEBIAN_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


def arm64_btf() -> Path:
    return lab_kernel("7.3", arch="arm64").vmlinux


def test_the_arm64_6_13_object_matches_the_arm64_7_3_kernel() -> None:
    assert check(ARM_NEW, arm64_btf()) == []


def test_the_arm64_6_17_object_matches_the_arm64_7_3_kernel() -> None:
    assert check(ARM_BW, arm64_btf()) == []


def test_the_arm64_6_12_object_differs_from_7_3_only_in_the_old_kfunc_names() -> None:
    """No arm64 6.12 kernel is at hand; against 7.3, everything but the kfuncs 7.3 renamed must fit: the
    ops table, the CO-RE field paths and the enumerators are the same code as the 6.13 object's."""
    problems = check(ARM_OLD, arm64_btf())
    missing = {m.group(1) for p in problems if (m := re.fullmatch(r"kfunc (\w+): not in the kernel", p))}
    assert missing == NAMES_6_12 and len(problems) == len(missing), problems


@pytest.mark.parametrize("version", sorted(other_btfs(arch="arm64")))
def test_the_arm64_6_13_object_matches_every_offered_arm64_kernel(version: str) -> None:
    """Every arm64 cloud kernel of the suite (7.2.6-7.3.4 on 2026-12-01) fits entirely: unlike Debian's
    amd64 7.2.x kernels (test_scheduler_compat.py), the arm64 ones declare the sched_ext kfuncs without
    the extra `aux` argument, so nothing here is refused before the verifier."""
    assert check(ARM_NEW, other_btfs(arch="arm64")[version]) == []


@pytest.mark.parametrize("obj", [ARM_NEW, ARM_OLD], ids=lambda p: p.name)
def test_the_arm64_objects_are_little_endian_bpf(obj: Path) -> None:
    """Built for the BPF machine (not arm64 code), little-endian as arm64 Linux is."""
    header = subprocess.run(["readelf", "-h", str(obj)], capture_output=True, text=True, check=True).stdout
    assert re.search(r"Machine:\s+Linux BPF\n", header), header
    assert "little endian" in header and re.search(r"Class:\s+ELF64\n", header), header
    assert "architecture: bpfel" in subprocess.run(["llvm-objdump", "-f", str(obj)], capture_output=True,
                                                   text=True, check=True).stdout


@pytest.mark.parametrize("machine", sorted(DEBIAN_ARCH))
def test_each_object_was_built_with_its_architectures_vmlinux_h(machine: str) -> None:
    """The code reads no pt_regs (no CO-RE relocation differs per architecture), so the provenance shows
    in the types the object carries from vmlinux.h: struct task_struct and struct pt_regs have that
    architecture's kernel's sizes (4864 and 320 bytes on arm64 7.3; 6144 and 168 on x86_64), and arm64's
    pt_regs holds the syscall number (syscallno) where x86's has orig_ax."""
    obj = Btf(DATA / f"gthulhu.{machine}.bpf.o")
    kernel = Btf(lab_kernel("7.3", arch=DEBIAN_ARCH[machine]).vmlinux)
    for name in ("task_struct", "pt_regs"):
        [mine] = obj.named(("STRUCT",), name)
        [theirs] = kernel.named(("STRUCT",), name)
        assert mine["size"] == theirs["size"], (name, mine["size"], theirs["size"])
    [regs] = obj.named(("STRUCT",), "pt_regs")
    assert (obj.member(regs, "syscallno") is not None) == (machine == "aarch64")
    assert (obj.member(regs, "orig_ax") is not None) == (machine == "x86_64")


def test_the_two_architectures_objects_differ_in_those_types() -> None:
    """What makes the previous test able to fail: the two kernels' layouts are not the same."""
    sizes = {m: Btf(DATA / f"gthulhu.{m}.bpf.o").named(("STRUCT",), "task_struct")[0]["size"]
             for m in DEBIAN_ARCH}
    assert sizes["x86_64"] != sizes["aarch64"], sizes
