"""The lab's matrix: which kernels and guest shapes exist, and how a test names the one it needs.

A spec is "KERNEL/SHAPE". Kernels (tests/vm/kernel.py): 7.3 (Debian's trixie-backports cloud kernel) and
6.12 (the LTS, built from Debian's linux-source-6.12). Shapes: 2cpu (the lab's default: 2 vCPUs, one NUMA
node), 8cpu-2numa (8 vCPUs over 2 NUMA nodes, 4 per node: function only, since 8 emulated CPUs share
the machine's 2 cores, shares and latencies there mean nothing), 2cpu-64possible (64 vCPUs of which the
kernel brings 2 online: a host with CPUs offline).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.vm.kernel import DEFAULT_KERNEL, KERNELS, lab_kernel
from tests.vm.lab import Init, Lab


@dataclass(frozen=True)
class Shape:
    cpus: int
    numa_nodes: int
    memory_mb: int
    # CPUs the kernel brings up at boot (its `maxcpus=`), when fewer than `cpus`: the rest are possible
    # and present but offline. qemu's own `-smp N,maxcpus=M` does not do it: the 7.3 kernel lists its
    # absent CPUs as "plus 0 hotplug CPUs", so possible stays at N (measured; possible_cpus= only lowers).
    boot_cpus: int | None = None


SHAPES = {
    "2cpu": Shape(cpus=2, numa_nodes=1, memory_mb=2048),
    "8cpu-2numa": Shape(cpus=8, numa_nodes=2, memory_mb=4096),
    # 64 possible CPUs, 2 online: a host with CPUs offline (chcpu, a cloud VM sized down, SMT off)
    "2cpu-64possible": Shape(cpus=64, numa_nodes=1, memory_mb=2048, boot_cpus=2),
}
DEFAULT = f"{DEFAULT_KERNEL}/2cpu"
BOTH_KERNELS = [f"{k}/2cpu" for k in KERNELS]
WIDE = [f"{DEFAULT_KERNEL}/8cpu-2numa"]
SPARSE = [f"{DEFAULT_KERNEL}/2cpu-64possible"]


def parse(spec: str) -> tuple[str, Shape]:
    kernel, _, shape = spec.partition("/")
    if kernel not in KERNELS or shape not in SHAPES:
        raise ValueError(f"unknown lab spec {spec!r}: KERNEL/SHAPE with KERNEL in {KERNELS}, "
                         f"SHAPE in {tuple(SHAPES)}")
    return kernel, SHAPES[shape]


def make_lab(init: Init | str, spec: str) -> Lab:
    kernel, shape = parse(spec)
    if init not in ("plain", "systemd"):
        raise ValueError(f"unknown init {init!r}")
    return Lab("plain" if init == "plain" else "systemd", kernel=lab_kernel(kernel), cpus=shape.cpus,
               numa_nodes=shape.numa_nodes, memory_mb=shape.memory_mb,
               append=[f"maxcpus={shape.boot_cpus}"] if shape.boot_cpus else [])
