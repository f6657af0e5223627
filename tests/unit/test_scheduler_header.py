"""gthulhu_node/scheduler/layout.py against bpf/gthulhu.h itself, the one header the scheduler and the agent
share: every struct the header declares has a mirror, each mirrored field sits at the header's offset with
the header's size, each struct has the header's size, and the header's constants are the ones Python uses.

The header is compiled (syntax only, for the BPF target when clang is here) with one `_Static_assert` per
fact taken from the mirrors, so the compiler, not a parser of ours, lays the structs out, and no build of
the scheduler is needed. tests/host/test_scheduler_layout.py checks the compiled objects' BTF the same way.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gthulhu_node import limits
from gthulhu_node.scheduler import layout
from gthulhu_node.scheduler.layout import MIRRORS, fields_of

HEADER = Path(__file__).resolve().parents[2] / "bpf" / "gthulhu.h"
# The build's compiler for the target the scheduler is built for, else the host's: the header holds only
# fixed-size types, padded explicitly, laid out alike on every 64-bit target.
COMPILERS = (("clang-16", "-target", "bpf"), ("clang", "-target", "bpf"), ("cc",))
# Each constant the header defines, as Python has it.
CONSTANTS = {
    "GTHULHU_PRIORITY_MAX": limits.PRIORITY_MAX,
    "GTHULHU_EXIT_REASON_LEN": layout.EXIT_REASON_LEN,
    "GTHULHU_EXIT_MSG_LEN": layout.EXIT_MSG_LEN,
}


def compiler() -> list[str]:
    for command in COMPILERS:
        if shutil.which(command[0]):
            return list(command)
    tried = ", ".join(c[0] for c in COMPILERS)
    pytest.fail(f"no C compiler here (tried {tried}): `make build` installs clang")


def assertions() -> str:
    """One `_Static_assert` per mirrored fact, each naming what it checks."""
    lines = []
    for name, mirror in sorted(MIRRORS.items()):
        for field, offset, size in fields_of(mirror):
            lines.append(f'_Static_assert(__builtin_offsetof(struct {name}, {field}) == {offset}, '
                         f'"{name}.{field} at offset {offset} in layout.py");')
            lines.append(f'_Static_assert(sizeof(((struct {name} *)0)->{field}) == {size}, '
                         f'"{name}.{field} of {size} bytes in layout.py");')
        size = ctypes.sizeof(mirror)
        lines.append(f'_Static_assert(sizeof(struct {name}) == {size}, '
                     f'"{name} of {size} bytes in layout.py");')
    for constant, value in sorted(CONSTANTS.items()):
        lines.append(f'_Static_assert({constant} == {value}, "{constant} is {value} in Python");')
    return "\n".join(lines)


def check(header: Path) -> subprocess.CompletedProcess[str]:
    source = f'#include "{header.name}"\n{assertions()}\n'
    return subprocess.run([*compiler(), "-fsyntax-only", "-x", "c", "-I", str(header.parent), "-"],
                          input=source, capture_output=True, text=True, check=False)


def test_every_struct_and_constant_of_the_header_is_mirrored() -> None:
    text = HEADER.read_text()
    assert set(re.findall(r"^struct (\w+) \{", text, re.M)) == set(MIRRORS)
    assert set(re.findall(r"^#define (GTHULHU_\w+) ", text, re.M)) == set(CONSTANTS)


def test_the_mirrors_have_the_headers_layout() -> None:
    result = check(HEADER)
    assert result.returncode == 0, f"layout.py differs from {HEADER.name}:\n{result.stderr}"


def test_a_header_that_differs_is_caught(tmp_path: Path) -> None:
    """The check can fail: the header with two fields of gthulhu_entry swapped is refused, naming them."""
    text = HEADER.read_text()
    swapped = text.replace("\tu64 start_time;", "\tu64 @@;").replace("\tu64 slice_ns;", "\tu64 start_time;")
    swapped = swapped.replace("\tu64 @@;", "\tu64 slice_ns;")
    assert swapped != text
    changed = tmp_path / HEADER.name
    changed.write_text(swapped)
    result = check(changed)
    assert result.returncode != 0
    assert "gthulhu_entry.start_time at offset 0" in result.stderr
    assert "gthulhu_entry.slice_ns at offset 8" in result.stderr
