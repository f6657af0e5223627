"""What the scheduler is told about big and little CPUs: the kernel's cpu_capacity per CPU, uniform where
a host reports none (x86), the most capable value for a possible CPU with no file yet (so a hot-added CPU
is never avoided by mistake), and the capacity-aware paths only when capacities differ."""

from __future__ import annotations

from pathlib import Path

import pytest

from gthulhu_node.scheduler.layout import STAT_COUNTERS, GthulhuSettings
from gthulhu_node.scheduler.loader import _runs, cpu_capacities
from tests.vm.devicetree import _without_sockets


def sysfs(tmp_path: Path, caps: dict[int, str]) -> Path:
    for cpu, text in caps.items():
        (tmp_path / f"cpu{cpu}").mkdir()
        (tmp_path / f"cpu{cpu}" / "cpu_capacity").write_text(text + "\n")
    return tmp_path


def test_a_gb10_shape_reads_ten_big_and_ten_little(tmp_path: Path) -> None:
    root = sysfs(tmp_path, {cpu: "1024" if cpu < 10 else "486" for cpu in range(20)})
    caps = cpu_capacities(20, root)
    assert caps == [1024] * 10 + [486] * 10
    assert _runs(caps) == "0-9:1024,10-19:486"


def test_no_capacity_files_means_uniform(tmp_path: Path) -> None:
    assert cpu_capacities(4, tmp_path) == [1024] * 4


def test_an_absent_or_unreadable_cpu_counts_as_the_most_capable(tmp_path: Path) -> None:
    root = sysfs(tmp_path, {0: "1024", 1: "512", 2: "garbage"})
    assert cpu_capacities(4, root) == [1024, 512, 1024, 1024]


@pytest.mark.parametrize(("caps", "text"), [([7], "0:7"), ([1, 1, 2, 1], "0-1:1,2:2,3:1")])
def test_runs_names_each_stretch_once(caps: list[int], text: str) -> None:
    assert _runs(caps) == text


def test_the_settings_and_stats_carry_the_capacity_fields() -> None:
    assert "asym_capacity" in dict(GthulhuSettings._fields_)
    assert "capacity_placements" in STAT_COUNTERS


def test_the_device_tree_dump_drops_every_socket_device() -> None:
    argv = ["qemu", "-machine", "virt", "-chardev", "socket,id=fs0", "-device", "vhost-user-fs-pci",
            "-smp", "4", "-device", "virtio-serial"]
    assert _without_sockets(argv) == ["qemu", "-machine", "virt", "-smp", "4"]
