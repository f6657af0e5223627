"""The structs Python writes into the scheduler's maps match the compiled objects' BTF, field by field
(every architecture's objects: one Python serves them all); the loader picks this machine's architecture's
object; and on this machine's kernel (no sched_ext) the loader says clearly why it cannot run.

Opening an object (not loading it) needs no privileges and changes nothing on this kernel.
"""

from __future__ import annotations

import ctypes
import platform
from collections.abc import Iterator
from pathlib import Path

import pytest

from gthulhu_node.backends.base import BackendUnavailable
from gthulhu_node.scheduler import libbpf, loader
from gthulhu_node.scheduler.layout import MIRRORS, fields_of

DATA = Path(__file__).resolve().parents[2] / "gthulhu_node" / "data"
ARCHES = ["x86_64", "aarch64"]
OBJECTS = [f"{stem}.{arch}.bpf.o" for arch in ARCHES for stem in ("gthulhu", "gthulhu-6.12", "gthulhu-6.17")]


@pytest.fixture(params=OBJECTS)
def bpf_object(request: pytest.FixtureRequest) -> Iterator[libbpf.BpfObject]:
    path = DATA / request.param
    obj = libbpf.BpfObject(path.read_bytes(), "gthulhu")
    yield obj
    obj.close()


@pytest.mark.parametrize("struct_name", sorted(MIRRORS))
def test_python_layout_matches_btf(bpf_object: libbpf.BpfObject, struct_name: str) -> None:
    mirror = MIRRORS[struct_name]
    btf = bpf_object.btf()
    assert fields_of(mirror) == btf.struct_members(struct_name)
    assert btf.struct_size(struct_name) == ctypes.sizeof(mirror)


def test_rodata_and_bss_are_exactly_the_shared_structs(bpf_object: libbpf.BpfObject) -> None:
    """The loader writes settings as the whole .rodata and reads counters as the whole .bss."""
    from gthulhu_node.scheduler.layout import GthulhuBss, GthulhuSettings

    rodata = loader._internal_map(bpf_object, ".rodata")
    assert len(rodata.initial_value()) == ctypes.sizeof(GthulhuSettings)
    settings = GthulhuSettings.from_buffer_copy(rodata.initial_value())
    assert settings.default_slice_ns == 5_000_000 and settings.boost_share_percent == 75
    bss = loader._internal_map(bpf_object, ".bss")
    assert len(bss.initial_value()) == ctypes.sizeof(GthulhuBss)


def test_patch_ops_sets_timeout_and_name() -> None:
    elf = (DATA / "gthulhu.x86_64.bpf.o").read_bytes()
    patched = loader.patch_ops(elf, timeout_ms=2000, name="other")
    obj = libbpf.BpfObject(patched, "gthulhu")
    try:
        members = {m: off for m, off, _ in obj.btf().struct_members("sched_ext_ops")}
    finally:
        obj.close()
    sec, _ = loader.elf_section(patched, ".struct_ops")
    assert int.from_bytes(patched[sec + members["timeout_ms"] :][:4], "little") == 2000
    assert patched[sec + members["name"] :][:6] == b"other\0"
    assert len(patched) == len(elf)


def test_no_sched_ext_here_is_a_clear_error() -> None:
    """This machine's kernel has no sched_ext: the error names the missing piece and the kernel."""
    assert not Path("/sys/kernel/sched_ext").exists(), "this test expects the host kernel without sched_ext"
    with pytest.raises(BackendUnavailable, match=r"has no sched_ext .*CONFIG_SCHED_CLASS_EXT"):
        loader.check_support()


def test_kfunc_flavour_is_read_from_btf(tmp_path: Path) -> None:
    """The kfunc names decide 6.12; the kernels with the new names are told apart by their BTF's
    sched_ext_ops (test_scheduler_compat.py: the lab's kernels and a 6.13-6.16 ops table)."""
    old = tmp_path / "old"
    old.write_bytes(b"\0scx_bpf_dispatch\0scx_bpf_consume\0")
    assert loader.kfunc_flavour(old) == "6.12"


@pytest.mark.parametrize("machine", ARCHES)
def test_the_loader_picks_the_object_of_the_machine(machine: str) -> None:
    assert loader.object_path("6.13", machine=machine) == DATA / f"gthulhu.{machine}.bpf.o"
    assert loader.object_path("6.12", machine=machine) == DATA / f"gthulhu-6.12.{machine}.bpf.o"
    assert loader.object_path("6.17", machine=machine) == DATA / f"gthulhu-6.17.{machine}.bpf.o"


def test_the_loader_defaults_to_this_machine() -> None:
    assert loader.object_path("6.13") == DATA / f"gthulhu.{platform.machine()}.bpf.o"


def test_an_architecture_without_objects_is_named() -> None:
    """A machine the package has no objects for gets an error naming its architecture and those the package
    has (backend auto then falls back to eevdf), not a missing-file path."""
    with pytest.raises(BackendUnavailable, match=r"architecture \(riscv64\).* carries aarch64, x86_64"):
        loader.object_path("6.13", machine="riscv64")


def test_task_ctx_holds_the_task_stats_the_agent_reads(bpf_object: libbpf.BpfObject) -> None:
    """The loader finds `stats` in task_ctx by BTF (wherever it sits: fields may be added to task_ctx) and
    reads it as gthulhu_task_stats: it must be that struct, whole, inside task_ctx."""
    from gthulhu_node.scheduler.layout import GthulhuTaskStats

    btf = bpf_object.btf()
    members = {name: (offset, size) for name, offset, size in btf.struct_members("task_ctx")}
    offset, size = members["stats"]
    assert size == ctypes.sizeof(GthulhuTaskStats)
    assert offset + size <= btf.struct_size("task_ctx")
