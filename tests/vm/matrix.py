"""The lab's matrix: which kernels and guest shapes exist, and how a test names the one it needs.

A spec is "KERNEL/SHAPE". Kernels (tests/vm/kernel.py): 7.3 (Debian's trixie-backports cloud kernel) and
6.12 (the LTS, built from Debian's linux-source-6.12). Shapes: 2cpu (the lab's default: 2 vCPUs, one NUMA
node), 8cpu-2numa (8 vCPUs over 2 NUMA nodes, 4 per node: function only, since 8 emulated CPUs share
the machine's 2 cores, shares and latencies there mean nothing), 2cpu-64possible (64 vCPUs of which the
kernel brings 2 online: a host with CPUs offline), 4cpu-arm64-biglittle (the arm64 guest, Debian's arm64
7.3 kernel under qemu-system-aarch64 with a Debian arm64 root of its own: 4 vCPUs, CPUs 0-1 of capacity
1024 and 2-3 of 512 from the device tree, an emulated big.LITTLE host; 7.3 only, docs/arm64.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from tests.vm.kernel import DEFAULT_KERNEL, KERNELS, lab_kernel
from tests.vm.lab import Arch, Init, Lab


@dataclass(frozen=True)
class Shape:
    cpus: int
    numa_nodes: int
    memory_mb: int
    # CPUs the kernel brings up at boot (its `maxcpus=`), when fewer than `cpus`: the rest are possible
    # and present but offline. qemu's own `-smp N,maxcpus=M` does not do it: the 7.3 kernel lists its
    # absent CPUs as "plus 0 hotplug CPUs", so possible stays at N (measured; possible_cpus= only lowers).
    boot_cpus: int | None = None
    arch: Arch = "x86_64"
    capacities: tuple[int, ...] | None = None  # capacity-dmips-mhz per CPU (aarch64 only)


SHAPES = {
    "2cpu": Shape(cpus=2, numa_nodes=1, memory_mb=2048),
    "8cpu-2numa": Shape(cpus=8, numa_nodes=2, memory_mb=4096),
    # 64 possible CPUs, 2 online: a host with CPUs offline (chcpu, a cloud VM sized down, SMT off)
    "2cpu-64possible": Shape(cpus=64, numa_nodes=1, memory_mb=2048, boot_cpus=2),
    # half big, half little (a GB10 has 10 and 10); the ratio is what an A725 to X925 pair measures roughly
    "4cpu-arm64-biglittle": Shape(cpus=4, numa_nodes=1, memory_mb=2048, arch="aarch64",
                                  capacities=(1024, 1024, 512, 512)),
}
DEFAULT = f"{DEFAULT_KERNEL}/2cpu"
BOTH_KERNELS = [f"{k}/2cpu" for k in KERNELS]
WIDE = [f"{DEFAULT_KERNEL}/8cpu-2numa"]
SPARSE = [f"{DEFAULT_KERNEL}/2cpu-64possible"]
ARM64 = ["7.3/4cpu-arm64-biglittle"]


def parse(spec: str) -> tuple[str, Shape]:
    kernel, _, shape = spec.partition("/")
    if kernel not in KERNELS or shape not in SHAPES:
        raise ValueError(f"unknown lab spec {spec!r}: KERNEL/SHAPE with KERNEL in {KERNELS}, "
                         f"SHAPE in {tuple(SHAPES)}")
    if SHAPES[shape].arch == "aarch64" and kernel != "7.3":
        raise ValueError(f"unknown lab spec {spec!r}: the arm64 guest has the 7.3 kernel only")
    return kernel, SHAPES[shape]


def make_lab(init: Init | str, spec: str, tcg_thread: str | None = None) -> Lab:
    kernel, shape = parse(spec)
    if init not in ("plain", "systemd"):
        raise ValueError(f"unknown init {init!r}")
    debian_arch = "arm64" if shape.arch == "aarch64" else "amd64"
    return Lab("plain" if init == "plain" else "systemd", kernel=lab_kernel(kernel, arch=debian_arch),
               cpus=shape.cpus, numa_nodes=shape.numa_nodes, memory_mb=shape.memory_mb,
               append=[f"maxcpus={shape.boot_cpus}"] if shape.boot_cpus else [], arch=shape.arch,
               capacities=shape.capacities, tcg_thread=tcg_thread)
