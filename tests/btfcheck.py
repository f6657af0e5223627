"""Check a compiled scheduler object against a kernel's BTF without booting that kernel.

What libbpf 1.1.2 needs from the running kernel before the verifier even sees a program: every member of
the object's `struct sched_ext_ops` (by name, data members of the same size), every kfunc it calls (by
name, with the same number of arguments and a return of the same kind), and every CO-RE relocation it
carries (struct fields by name path; enumerators by name). Field relocations that only test existence
(`bpf_core_field_exists`) may miss: the code has a path for that.

Usage: `python -m tests.btfcheck OBJECT VMLINUX...` prints one line per problem and exits 1 if any.
"""

from __future__ import annotations

import functools
import json
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gthulhu_node.scheduler.loader import elf_section

Type = dict[str, Any]

_MODIFIERS = {"TYPEDEF", "VOLATILE", "CONST", "RESTRICT", "TYPE_TAG"}
_FIELD_EXISTS = 2
_ENUMVAL_KINDS = {10, 11}
_FIELD_KINDS = {0, 1, 2, 3, 4, 5}


class Btf:
    """The types of one BTF (from `bpftool -j btf dump file`), by id and by name."""

    def __init__(self, path: Path) -> None:
        out = subprocess.run(["bpftool", "-j", "btf", "dump", "file", str(path)], check=True,
                             capture_output=True, text=True).stdout
        self.types: dict[int, Type] = {t["id"]: t for t in json.loads(out)["types"]}
        self.by_name: dict[str, list[Type]] = {}
        for t in self.types.values():
            name = t.get("name")
            if name and name != "(anon)":
                self.by_name.setdefault(name, []).append(t)

    def resolve(self, type_id: int) -> Type:
        t = self.types.get(type_id, {"kind": "VOID", "id": 0})
        while t["kind"] in _MODIFIERS:
            t = self.types.get(t["type_id"], {"kind": "VOID", "id": 0})
        return t

    def size(self, type_id: int) -> int:
        t = self.resolve(type_id)
        if t["kind"] == "ARRAY":
            return int(t["nr_elems"]) * self.size(t["type_id"])
        if t["kind"] == "PTR":
            return 8
        return int(t.get("size", 0))

    def named(self, kind: tuple[str, ...], name: str) -> list[Type]:
        base = name.split("___")[0]
        return [t for t in self.by_name.get(base, []) if t["kind"] in kind]

    def member(self, t: Type, name: str) -> Type | None:
        """A member by name, looking through anonymous struct/union members as C does."""
        for m in t.get("members", []):
            if m["name"] == name:
                return dict(m)
            if m["name"] in ("", "(anon)"):
                inner = self.resolve(m["type_id"])
                if inner["kind"] in ("STRUCT", "UNION"):
                    found = self.member(inner, name)
                    if found is not None:
                        return found
        return None


@dataclass(frozen=True)
class Relo:
    type_id: int
    access: str
    kind: int


def _section(elf: bytes, name: str) -> bytes:
    offset, size = elf_section(elf, name)
    return elf[offset : offset + size]


def core_relos(obj: Path) -> list[Relo]:
    """The CO-RE relocation records of .BTF.ext (struct bpf_core_relo), with their access strings."""
    elf = obj.read_bytes()
    btf, ext = _section(elf, ".BTF"), _section(elf, ".BTF.ext")
    hdr_len, _, _, str_off, _ = struct.unpack_from("<IIIII", btf, 4)
    strings = btf[hdr_len + str_off :]

    def string(off: int) -> str:
        return strings[off : strings.index(b"\0", off)].decode()

    ext_hdr_len = struct.unpack_from("<I", ext, 4)[0]
    if ext_hdr_len < 32:
        return []
    relo_off, relo_len = struct.unpack_from("<II", ext, 24)
    data = ext[ext_hdr_len + relo_off : ext_hdr_len + relo_off + relo_len]
    rec_size = struct.unpack_from("<I", data, 0)[0]
    pos, relos = 4, []
    while pos < len(data):
        _, num = struct.unpack_from("<II", data, pos)
        pos += 8
        for _ in range(num):
            _, type_id, access_off, kind = struct.unpack_from("<IIII", data, pos)
            relos.append(Relo(type_id, string(access_off), kind))
            pos += rec_size
    return relos


def _field_path(local: Btf, relo: Relo) -> tuple[Type, list[str]]:
    root = local.resolve(relo.type_id)
    t, names = root, []
    for index in (int(x) for x in relo.access.split(":")[1:]):
        if t["kind"] == "ARRAY":
            t = local.resolve(t["type_id"])
            continue
        m = t["members"][index]
        names.append(m["name"])
        t = local.resolve(m["type_id"])
    return root, names


def _field_ok(kernel: Btf, root: Type, names: list[str]) -> bool:
    for cand in kernel.named(("STRUCT", "UNION"), root["name"]):
        t: Type | None = cand
        for name in names:
            while t is not None and t["kind"] == "ARRAY":
                t = kernel.resolve(t["type_id"])
            m = kernel.member(t, name) if t is not None else None
            t = kernel.resolve(m["type_id"]) if m is not None else None
        if t is not None:
            return True
    return False


@functools.lru_cache(maxsize=16)
def _btf(path: Path) -> Btf:
    return Btf(path)


def check(obj: Path, vmlinux: Path) -> list[str]:
    """Problems that would stop libbpf 1.1.2 loading `obj` on the kernel whose BTF is `vmlinux`."""
    local, kernel = Btf(obj), _btf(vmlinux)
    problems: list[str] = []
    ops = local.named(("STRUCT",), "sched_ext_ops")
    kops = kernel.named(("STRUCT",), "sched_ext_ops")
    if not ops or not kops:
        return [f"sched_ext_ops missing ({'object' if not ops else 'kernel'})"]
    for m in ops[0]["members"]:
        km = kernel.member(kops[0], m["name"])
        if km is None:
            problems.append(f"sched_ext_ops.{m['name']}: not in the kernel")
        elif local.resolve(m["type_id"])["kind"] != "PTR" and local.size(m["type_id"]) != kernel.size(
                km["type_id"]):
            problems.append(f"sched_ext_ops.{m['name']}: size differs")
    for fn in (t for t in local.types.values() if t["kind"] == "FUNC" and t.get("linkage") == "extern"):
        kfns = kernel.named(("FUNC",), fn["name"])
        if not kfns:
            problems.append(f"kfunc {fn['name']}: not in the kernel")
            continue
        mine, theirs = local.resolve(fn["type_id"]), kernel.resolve(kfns[0]["type_id"])
        if len(mine.get("params", [])) != len(theirs.get("params", [])):
            problems.append(f"kfunc {fn['name']}: {len(theirs.get('params', []))} arguments in the kernel")
        if (local.resolve(mine["ret_type_id"])["kind"] == "VOID") != (
                kernel.resolve(theirs["ret_type_id"])["kind"] == "VOID"):
            problems.append(f"kfunc {fn['name']}: return type differs")
    for relo in core_relos(obj):
        if relo.kind in _ENUMVAL_KINDS:
            enum = local.resolve(relo.type_id)
            value = enum["values"][int(relo.access)]["name"]
            if not any(value in {v["name"] for v in e["values"]}
                       for e in kernel.named(("ENUM", "ENUM64"), enum["name"])):
                problems.append(f"enum {enum['name']}.{value}: not in the kernel")
        elif relo.kind in _FIELD_KINDS and relo.kind != _FIELD_EXISTS:
            root, names = _field_path(local, relo)
            if not _field_ok(kernel, root, names):
                problems.append(f"field {root['name']}.{'.'.join(names)}: not in the kernel")
    return sorted(set(problems))


def main(argv: list[str]) -> int:
    obj, *kernels = (Path(a) for a in argv)
    bad = 0
    for vmlinux in kernels:
        for problem in check(obj, vmlinux):
            print(f"{obj.name} on {vmlinux.name}: {problem}")
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
