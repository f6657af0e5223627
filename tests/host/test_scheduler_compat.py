"""The scheduler objects against the BTF of every kernel we can get, booted or not (tests/btfcheck.py).

These are the x86_64 objects (the arm64 ones: test_scheduler_arm64.py). The lab boots 6.12 and 7.3;
between them, Debian's trixie-backports offers the 7.2 cloud kernels, whose headers packages carry their
BTF. What libbpf 1.1.2 checks before the verifier runs (ops members, kfunc prototypes, CO-RE fields and
enumerators) is checked here for each. Fetching the BTF needs the network once; after that the cache
(/var/cache/gthulhu-node-lab) answers.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.btfcheck import check
from tests.vm.kernel import lab_kernel, other_btfs

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "gthulhu_node" / "data"
NEW, OLD = DATA / "gthulhu.x86_64.bpf.o", DATA / "gthulhu-6.12.x86_64.bpf.o"
UNLOADABLE = REPO / "bpf" / ".output" / "gthulhu-unloadable.bpf.o"


def test_the_6_12_object_matches_the_6_12_kernel() -> None:
    assert check(OLD, lab_kernel("6.12").vmlinux) == []


def test_the_6_13_object_matches_the_7_3_kernel() -> None:
    assert check(NEW, lab_kernel("7.3").vmlinux) == []


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
    problems = check(NEW, other_btfs()[version])
    assert all(re.fullmatch(r"kfunc (scx_bpf|bpf_iter_scx)_\w+: \d+ arguments in the kernel", p)
               for p in problems), problems
