"""A small ctypes binding to libbpf.so.1: just what loading a struct_ops scheduler and writing its maps needs.

Why ctypes over libbpf and not BCC: BCC cannot load a sched_ext scheduler (no struct_ops maps, no kfunc
relocation, no global data, no CO-RE). Every call here exists in Debian 12's libbpf 1.1.2 and in every newer
release; nothing newer is required. Errors come back as `LibbpfError` carrying errno and the call's name.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import re
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gthulhu_node.errors import BackendError

BPF_F_SLEEPABLE = 1 << 4
BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2
BPF_MAP_TYPE_STRUCT_OPS = 26
BTF_KIND_STRUCT = 4


class LibbpfError(BackendError, OSError):
    """A libbpf call failed; errno and strerror as the kernel reported them."""

    def __init__(self, call: str, err: int) -> None:
        err = abs(err)
        super().__init__(err, f"{call}: {os.strerror(err)}")
        self.call = call


def _load() -> ctypes.CDLL:
    # GTHULHU_LIBBPF names another libbpf.so (the lab loads the scheduler with a newer one as well).
    override = os.environ.get("GTHULHU_LIBBPF")
    if override:
        return ctypes.CDLL(override, use_errno=True)
    name = ctypes.util.find_library("bpf") or "libbpf.so.1"
    try:
        return ctypes.CDLL("libbpf.so.1", use_errno=True)
    except OSError:
        return ctypes.CDLL(name, use_errno=True)


_lib: ctypes.CDLL | None = None

_P = ctypes.c_void_p
_SIGS: dict[str, tuple[Any, list[Any]]] = {
    "bpf_object__open_mem": (_P, [_P, ctypes.c_size_t, _P]),
    "bpf_object__load": (ctypes.c_int, [_P]),
    "bpf_object__close": (None, [_P]),
    "bpf_object__find_map_by_name": (_P, [_P, ctypes.c_char_p]),
    "bpf_object__find_program_by_name": (_P, [_P, ctypes.c_char_p]),
    "bpf_object__btf": (_P, [_P]),
    "bpf_map__set_max_entries": (ctypes.c_int, [_P, ctypes.c_uint32]),
    "bpf_map__max_entries": (ctypes.c_uint32, [_P]),
    "bpf_map__initial_value": (_P, [_P, ctypes.POINTER(ctypes.c_size_t)]),
    "bpf_map__set_initial_value": (ctypes.c_int, [_P, _P, ctypes.c_size_t]),
    "bpf_map__fd": (ctypes.c_int, [_P]),
    "bpf_map__attach_struct_ops": (_P, [_P]),
    "bpf_program__flags": (ctypes.c_uint32, [_P]),
    "bpf_program__set_flags": (ctypes.c_int, [_P, ctypes.c_uint32]),
    "bpf_program__fd": (ctypes.c_int, [_P]),
    "bpf_program__name": (ctypes.c_char_p, [_P]),
    "bpf_program__set_log_level": (ctypes.c_int, [_P, ctypes.c_uint32]),
    "bpf_program__set_log_buf": (ctypes.c_int, [_P, _P, ctypes.c_size_t]),
    "bpf_object__next_program": (_P, [_P, _P]),
    "bpf_link__destroy": (ctypes.c_int, [_P]),
    "bpf_link__disconnect": (None, [_P]),
    "bpf_map_update_elem": (ctypes.c_int, [ctypes.c_int, _P, _P, ctypes.c_uint64]),
    "bpf_map_lookup_elem": (ctypes.c_int, [ctypes.c_int, _P, _P]),
    "bpf_map_delete_elem": (ctypes.c_int, [ctypes.c_int, _P]),
    "bpf_map_get_next_key": (ctypes.c_int, [ctypes.c_int, _P, _P]),
    "bpf_map_get_next_id": (ctypes.c_int, [ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32)]),
    "bpf_map_get_fd_by_id": (ctypes.c_int, [ctypes.c_uint32]),
    "bpf_obj_get_info_by_fd": (ctypes.c_int, [ctypes.c_int, _P, ctypes.POINTER(ctypes.c_uint32)]),
    "bpf_prog_test_run_opts": (ctypes.c_int, [ctypes.c_int, _P]),
    "btf__find_by_name_kind": (ctypes.c_int32, [_P, ctypes.c_char_p, ctypes.c_uint32]),
    "btf__type_by_id": (_P, [_P, ctypes.c_uint32]),
    "btf__name_by_offset": (ctypes.c_char_p, [_P, ctypes.c_uint32]),
    "btf__resolve_size": (ctypes.c_int64, [_P, ctypes.c_uint32]),
    "btf__parse": (_P, [ctypes.c_char_p, _P]),
    "btf__free": (None, [_P]),
    "libbpf_set_print": (_P, [_P]),
    "libbpf_num_possible_cpus": (ctypes.c_int, []),
}


def lib() -> ctypes.CDLL:
    """libbpf.so.1 with argument types declared (loaded on first use, so importing never fails)."""
    global _lib
    if _lib is None:
        handle = _load()
        for name, (restype, argtypes) in _SIGS.items():
            fn = getattr(handle, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = handle
    return _lib


def _check(call: str, ret: int) -> int:
    """libbpf 1.x returns -errno (and sets errno); map ops return -1 with errno."""
    if ret < 0:
        err = ctypes.get_errno() or -ret
        raise LibbpfError(call, err if err > 0 else errno.EINVAL)
    return ret


def _ptr(call: str, ptr: int | None) -> int:
    if not ptr:
        raise LibbpfError(call, ctypes.get_errno() or errno.ENOENT)
    return ptr


# int (*)(enum libbpf_print_level, const char *fmt, va_list): a va_list argument is passed as a pointer on
# x86-64 and arm64 alike, so vsnprintf can format it from here.
_PRINT_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
_LIBBPF_WARN, _LIBBPF_INFO = 0, 1
_libc = ctypes.CDLL(None, use_errno=True)
_libc.vsnprintf.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p, ctypes.c_void_p]
_capture_lock = threading.Lock()


@contextlib.contextmanager
def captured_messages(keep: int = 60) -> Iterator[deque[str]]:
    """libbpf's warnings and notes while the block runs (the last `keep` lines): on a refused load they
    hold the verifier's log and libbpf's reason, which the errno alone does not say."""
    lines: deque[str] = deque(maxlen=keep)

    def printer(level: int, fmt: bytes | None, args: int | None) -> int:
        if level > _LIBBPF_INFO or fmt is None:
            return 0
        buf = ctypes.create_string_buffer(2048)
        _libc.vsnprintf(buf, len(buf), fmt, args)
        for line in buf.value.decode(errors="replace").splitlines():
            if line.strip():
                lines.append(line.rstrip())
        return 0

    callback = _PRINT_FN(printer)
    with _capture_lock:
        previous = lib().libbpf_set_print(ctypes.cast(callback, ctypes.c_void_p))
        try:
            yield lines
        finally:
            lib().libbpf_set_print(previous)


class _BtfType(ctypes.Structure):
    _fields_ = [("name_off", ctypes.c_uint32), ("info", ctypes.c_uint32), ("size", ctypes.c_uint32)]


class _BtfMember(ctypes.Structure):
    _fields_ = [("name_off", ctypes.c_uint32), ("type", ctypes.c_uint32), ("offset", ctypes.c_uint32)]


class Btf:
    """Read access to one BTF object (owned by its bpf_object)."""

    def __init__(self, handle: int) -> None:
        self._h = handle

    def struct_members(self, name: str) -> list[tuple[str, int, int]]:
        """(member name, byte offset, byte size) of a struct, in declaration order."""
        libbpf = lib()
        type_id = libbpf.btf__find_by_name_kind(self._h, name.encode(), BTF_KIND_STRUCT)
        if type_id < 0:
            raise LibbpfError(f"btf__find_by_name_kind({name})", -type_id)
        tptr = _ptr("btf__type_by_id", libbpf.btf__type_by_id(self._h, type_id))
        t = _BtfType.from_address(tptr)
        vlen = t.info & 0xFFFF
        kind_flag = t.info >> 31
        members = (_BtfMember * vlen).from_address(tptr + ctypes.sizeof(_BtfType))
        out = []
        for m in members:
            bits = m.offset & 0xFFFFFF if kind_flag else m.offset
            mname = libbpf.btf__name_by_offset(self._h, m.name_off) or b""
            size = libbpf.btf__resolve_size(self._h, m.type)
            out.append((mname.decode(), bits // 8, int(size)))
        return out

    def struct_size(self, name: str) -> int:
        libbpf = lib()
        type_id = libbpf.btf__find_by_name_kind(self._h, name.encode(), BTF_KIND_STRUCT)
        if type_id < 0:
            raise LibbpfError(f"btf__find_by_name_kind({name})", -type_id)
        return int(libbpf.btf__resolve_size(self._h, type_id))


@contextlib.contextmanager
def parsed_btf(path: Path) -> Iterator[Btf]:
    """A BTF file (a kernel's /sys/kernel/btf/vmlinux) read by libbpf, freed on exit."""
    ctypes.set_errno(0)
    handle = _ptr(f"btf__parse({path})", lib().btf__parse(str(path).encode(), None))
    try:
        yield Btf(handle)
    finally:
        lib().btf__free(handle)


class _OpenOpts(ctypes.Structure):
    # struct bpf_object_open_opts begins with `size_t sz`, then `const char *object_name`; libbpf reads
    # only as many bytes as sz says, so this prefix is valid for every version.
    _fields_ = [("sz", ctypes.c_size_t), ("object_name", ctypes.c_char_p)]


class _TestRunOpts(ctypes.Structure):
    _fields_ = [
        ("sz", ctypes.c_size_t),
        ("data_in", ctypes.c_void_p),
        ("data_out", ctypes.c_void_p),
        ("data_size_in", ctypes.c_uint32),
        ("data_size_out", ctypes.c_uint32),
        ("ctx_in", ctypes.c_void_p),
        ("ctx_out", ctypes.c_void_p),
        ("ctx_size_in", ctypes.c_uint32),
        ("ctx_size_out", ctypes.c_uint32),
        ("retval", ctypes.c_uint32),
        ("repeat", ctypes.c_int),
        ("duration", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("batch_size", ctypes.c_uint32),
    ]


class BpfMap:
    """A map of an object: before load (sizing, initial value) and after (fd)."""

    def __init__(self, handle: int, name: str) -> None:
        self._h = handle
        self.name = name

    def set_max_entries(self, n: int) -> None:
        _check(f"bpf_map__set_max_entries({self.name})", lib().bpf_map__set_max_entries(self._h, n))

    @property
    def max_entries(self) -> int:
        return int(lib().bpf_map__max_entries(self._h))

    def initial_value(self) -> bytes:
        size = ctypes.c_size_t()
        ptr = _ptr(f"bpf_map__initial_value({self.name})", lib().bpf_map__initial_value(self._h, size))
        return ctypes.string_at(ptr, size.value)

    def set_initial_value(self, data: bytes) -> None:
        buf = ctypes.create_string_buffer(data, len(data))
        _check(
            f"bpf_map__set_initial_value({self.name})",
            lib().bpf_map__set_initial_value(self._h, buf, len(data)),
        )

    @property
    def fd(self) -> int:
        return _check(f"bpf_map__fd({self.name})", lib().bpf_map__fd(self._h))

    def attach_struct_ops(self) -> Link:
        ctypes.set_errno(0)
        ptr = lib().bpf_map__attach_struct_ops(self._h)
        return Link(_ptr(f"bpf_map__attach_struct_ops({self.name})", ptr))


# The verifier's log level that prints only its statistics (kernel BPF_LOG_STATS).
BPF_LOG_STATS = 4
_PROCESSED = re.compile(rb"processed (\d+) insns")


class Program:
    def __init__(self, handle: int, name: str) -> None:
        self._h = handle
        self.name = name
        self._log: ctypes.Array[ctypes.c_char] | None = None

    def record_stats(self) -> None:
        """Have the verifier write its statistics (a few lines) for this program at load. Only for checks:
        with a log buffer of ours, libbpf does not retry a refused load with the full log it would print."""
        self._log = ctypes.create_string_buffer(4096)
        _check(f"bpf_program__set_log_buf({self.name})",
               lib().bpf_program__set_log_buf(self._h, self._log, len(self._log)))
        _check(f"bpf_program__set_log_level({self.name})",
               lib().bpf_program__set_log_level(self._h, BPF_LOG_STATS))

    def verified_insns(self) -> int | None:
        """Instructions the verifier processed for this program (its limit is 1,000,000), after a load
        with record_stats; None without."""
        found = _PROCESSED.search(self._log.value) if self._log is not None else None
        return int(found.group(1)) if found else None

    def add_flags(self, flags: int) -> None:
        libbpf = lib()
        _check(
            f"bpf_program__set_flags({self.name})",
            libbpf.bpf_program__set_flags(self._h, libbpf.bpf_program__flags(self._h) | flags),
        )

    @property
    def fd(self) -> int:
        return _check(f"bpf_program__fd({self.name})", lib().bpf_program__fd(self._h))

    def test_run(self) -> int:
        """Run a `syscall` program once (BPF_PROG_TEST_RUN); returns its return value."""
        opts = _TestRunOpts(sz=ctypes.sizeof(_TestRunOpts))
        ret = lib().bpf_prog_test_run_opts(self.fd, ctypes.byref(opts))
        _check(f"bpf_prog_test_run_opts({self.name})", ret)
        return int(opts.retval)


class Link:
    def __init__(self, handle: int) -> None:
        self._h: int | None = handle

    def destroy(self) -> None:
        """Detach (for a struct_ops map: unregister the scheduler)."""
        if self._h is not None:
            handle, self._h = self._h, None
            _check("bpf_link__destroy", lib().bpf_link__destroy(handle))

    def forget(self) -> None:
        """Drop the handle without detaching (the process is about to exit on purpose)."""
        self._h = None


class BpfObject:
    """One opened (then loaded) BPF object file. Close it to free everything it holds."""

    def __init__(self, data: bytes, name: str) -> None:
        self._buf = ctypes.create_string_buffer(data, len(data))
        self._name = ctypes.c_char_p(name.encode())
        opts = _OpenOpts(sz=ctypes.sizeof(_OpenOpts), object_name=self._name)
        ctypes.set_errno(0)
        self._h: int | None = _ptr(
            f"bpf_object__open_mem({name})",
            lib().bpf_object__open_mem(self._buf, len(data), ctypes.byref(opts)),
        )

    @property
    def handle(self) -> int:
        if self._h is None:
            raise ValueError("BPF object is closed")
        return self._h

    def map(self, name: str) -> BpfMap:
        ctypes.set_errno(0)
        ptr = lib().bpf_object__find_map_by_name(self.handle, name.encode())
        return BpfMap(_ptr(f"bpf_object__find_map_by_name({name})", ptr), name)

    def program(self, name: str) -> Program:
        ctypes.set_errno(0)
        ptr = lib().bpf_object__find_program_by_name(self.handle, name.encode())
        return Program(_ptr(f"bpf_object__find_program_by_name({name})", ptr), name)

    def btf(self) -> Btf:
        return Btf(_ptr("bpf_object__btf", lib().bpf_object__btf(self.handle)))

    def programs(self) -> list[Program]:
        found: list[Program] = []
        ptr = lib().bpf_object__next_program(self.handle, None)
        while ptr:
            found.append(Program(ptr, (lib().bpf_program__name(ptr) or b"").decode()))
            ptr = lib().bpf_object__next_program(self.handle, ptr)
        return found

    def load(self) -> None:
        _check("bpf_object__load", lib().bpf_object__load(self.handle))

    def close(self) -> None:
        if self._h is not None:
            handle, self._h = self._h, None
            lib().bpf_object__close(handle)


# Map operations on a plain fd (the agent's map writer uses these on the loaded maps).


def map_update(fd: int, key: Any, value: Any, flags: int = BPF_ANY) -> None:
    ret = lib().bpf_map_update_elem(fd, ctypes.byref(key), ctypes.byref(value), flags)
    _check("bpf_map_update_elem", ret)


def map_lookup(fd: int, key: Any, value: Any) -> bool:
    """Fill value; False when the key is absent."""
    ret = lib().bpf_map_lookup_elem(fd, ctypes.byref(key), ctypes.byref(value))
    if ret < 0:
        err = ctypes.get_errno()
        if err == errno.ENOENT:
            return False
        raise LibbpfError("bpf_map_lookup_elem", err or -ret)
    return True


def num_possible_cpus() -> int:
    """How many slots a per-CPU map's value has (the kernel's num_possible_cpus(), as libbpf counts it)."""
    return _check("libbpf_num_possible_cpus", lib().libbpf_num_possible_cpus())


def percpu_lookup(fd: int, key: Any, value_type: type[ctypes.Structure]) -> list[Any]:
    """Every CPU's value of a per-CPU map's key (each padded to 8 bytes, as the kernel copies them)."""
    stride = (ctypes.sizeof(value_type) + 7) // 8 * 8
    ncpus = num_possible_cpus()
    buf = ctypes.create_string_buffer(stride * ncpus)
    ret = lib().bpf_map_lookup_elem(fd, ctypes.byref(key), buf)
    _check("bpf_map_lookup_elem", ret)
    return [value_type.from_buffer_copy(buf.raw, cpu * stride) for cpu in range(ncpus)]


def map_delete(fd: int, key: Any) -> bool:
    """False when the key was absent."""
    ret = lib().bpf_map_delete_elem(fd, ctypes.byref(key))
    if ret < 0:
        err = ctypes.get_errno()
        if err == errno.ENOENT:
            return False
        raise LibbpfError("bpf_map_delete_elem", err or -ret)
    return True


def map_keys(fd: int, key_type: type[ctypes.c_uint32]) -> Iterator[int]:
    """Every key of a hash map (a snapshot-ish walk: keys added meanwhile may or may not appear)."""
    libbpf = lib()
    cur = key_type()
    nxt = key_type()
    first = True
    while True:
        ret = libbpf.bpf_map_get_next_key(fd, None if first else ctypes.byref(cur), ctypes.byref(nxt))
        if ret < 0:
            err = ctypes.get_errno()
            if err == errno.ENOENT:
                return
            raise LibbpfError("bpf_map_get_next_key", err or -ret)
        first = False
        yield int(nxt.value)
        cur.value = nxt.value


class _MapInfo(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
        ("rest", ctypes.c_uint8 * 64),
    ]


def struct_ops_map_fds(name: str) -> Iterator[int]:
    """Open every loaded struct_ops map called `name` (the caller closes the fds)."""
    libbpf = lib()
    cur = ctypes.c_uint32(0)
    nxt = ctypes.c_uint32()
    while libbpf.bpf_map_get_next_id(cur.value, ctypes.byref(nxt)) == 0:
        cur.value = nxt.value
        fd = libbpf.bpf_map_get_fd_by_id(nxt.value)
        if fd < 0:
            continue
        info = _MapInfo()
        size = ctypes.c_uint32(ctypes.sizeof(info))
        if (
            libbpf.bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)) == 0
            and info.type == BPF_MAP_TYPE_STRUCT_OPS
            and info.name.decode(errors="replace") == name[:15]
        ):
            yield fd
        else:
            os.close(fd)
