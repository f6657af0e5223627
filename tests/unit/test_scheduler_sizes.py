"""The scheduler's per-CPU array is sized from the kernel's possible CPUs, whatever their number: there is
no compiled-in cap (the former MAX_CPUS 512 silently dropped the per-CPU floor on CPUs above it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gthulhu_node.scheduler.loader import possible_cpus


@pytest.mark.parametrize(("text", "count"), [("0", 1), ("0-1", 2), ("0-63", 64), ("0-1023", 1024),
                                             ("0-8191", 8192), ("0-3,8-11", 12)])
def test_possible_cpus_is_nr_cpu_ids(tmp_path: Path, text: str, count: int) -> None:
    path = tmp_path / "possible"
    path.write_text(text + "\n")
    assert possible_cpus(path) == count


def test_the_object_has_no_compiled_in_cpu_cap() -> None:
    bpf = Path(__file__).resolve().parents[2] / "bpf"
    sources = [*sorted(bpf.glob("*.bpf.[ch]")), bpf / "gthulhu.h"]
    assert bpf / "gthulhu.bpf.c" in sources
    assert not [p.name for p in sources if "MAX_CPUS" in p.read_text()]
    assert 'obj.map("cpu_ctxs").set_max_entries(nr_cpus)' in (
        Path(__file__).resolve().parents[2] / "gthulhu_node" / "scheduler" / "loader.py").read_text()
