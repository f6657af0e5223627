"""What the scheduler is told about NUMA nodes: each CPU's fair-queue domain, from the kernel's node
cpulists, numbered densely over the nodes that have CPUs, one domain where sysfs has no nodes, and the
MAX_DOMAINS fold the C side relies on (it creates that many queues at most)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gthulhu_node.config import SchedulerConfig
from gthulhu_node.scheduler.loader import MAX_DOMAINS, cpu_domains, parse_cpulist

SOURCE = Path(__file__).resolve().parents[2] / "bpf" / "state.bpf.h"


def nodes(tmp_path: Path, lists: dict[int, str]) -> Path:
    for node, text in lists.items():
        (tmp_path / f"node{node}").mkdir()
        (tmp_path / f"node{node}" / "cpulist").write_text(text + "\n")
    return tmp_path


@pytest.mark.parametrize(("text", "cpus"), [("0", [0]), ("0-3", [0, 1, 2, 3]),
                                            ("0-1,8,10-11", [0, 1, 8, 10, 11]), ("", [])])
def test_cpulists_parse(text: str, cpus: list[int]) -> None:
    assert parse_cpulist(text + "\n") == cpus


def test_two_nodes_of_four_cpus_each(tmp_path: Path) -> None:
    assert cpu_domains(8, nodes(tmp_path, {0: "0-3", 1: "4-7"})) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_interleaved_cpu_numbers_follow_their_node(tmp_path: Path) -> None:
    """Dual-socket x86 hosts often number the sockets' CPUs alternately."""
    assert cpu_domains(4, nodes(tmp_path, {0: "0,2", 1: "1,3"})) == [0, 1, 0, 1]


def test_memory_only_and_sparse_nodes_get_no_domain_of_their_own(tmp_path: Path) -> None:
    """A GPU's or CXL memory's node has no CPUs; node numbers may skip. Domains stay dense, by node order."""
    root = nodes(tmp_path, {0: "0-1", 1: "", 4: "2-3"})
    assert cpu_domains(4, root) == [0, 0, 1, 1]


def test_a_cpu_offline_at_load_is_found_by_its_node_link(tmp_path: Path) -> None:
    """x86 and arm64 drop an offline CPU from its node's cpulist; its cpuN link stays, so a CPU brought
    online later queues in its own node, not in domain 0."""
    root = nodes(tmp_path, {0: "0-1", 1: "2"})
    (root / "node1" / "cpu3").mkdir()  # stands for the symlink to ../../cpu/cpu3
    assert cpu_domains(4, root) == [0, 0, 1, 1]


def test_no_nodes_in_sysfs_is_one_domain(tmp_path: Path) -> None:
    assert cpu_domains(4, tmp_path / "absent") == [0, 0, 0, 0]


def test_a_cpu_no_node_lists_is_in_domain_zero(tmp_path: Path) -> None:
    assert cpu_domains(6, nodes(tmp_path, {0: "0-1", 1: "2-3"})) == [0, 0, 1, 1, 0, 0]


def test_more_nodes_than_queues_fold(tmp_path: Path) -> None:
    root = nodes(tmp_path, {n: str(n) for n in range(MAX_DOMAINS + 2)})
    domains = cpu_domains(MAX_DOMAINS + 2, root)
    assert max(domains) == MAX_DOMAINS - 1
    assert domains[MAX_DOMAINS] == 0 and domains[MAX_DOMAINS + 1] == 1


def test_python_and_c_agree_on_the_number_of_queues() -> None:
    m = re.search(r"#define MAX_DOMAINS (\d+)", SOURCE.read_text())
    assert m and int(m.group(1)) == MAX_DOMAINS


def test_fair_queues_is_per_node_by_default_and_refuses_other_words() -> None:
    assert SchedulerConfig().fair_queues == "per_node"
    assert SchedulerConfig(fair_queues="single").fair_queues == "single"
    with pytest.raises(ValueError, match="fair_queues"):
        SchedulerConfig(fair_queues="per_llc")  # type: ignore[arg-type]
