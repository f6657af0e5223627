"""Who may change this node's scheduling through policies.d: only root (or the agent's own user).

A policy file tells a root daemon which threads to boost, so whoever can write it, or replace it, or the
directory it is in, decides the node's scheduling. The rules (the same idea as OpenSSH's StrictModes):
- the directory, and every directory above it, is owned by root (or the agent's user) and is not group-
  or world-writable; a world-writable ancestor is tolerated only with the sticky bit (/tmp), where others
  cannot rename or remove entries they do not own;
- a policy file is a regular file owned by root (or the agent's user), not group- or world-writable;
- a symlink is followed only when the link itself is owned by root (or the agent's user), and only to
  such a file, in such directories: every component of the path the agent follows is checked, on the
  descriptor it opened (openat with O_NOFOLLOW, one component at a time, and fstat), so what is read is
  what was checked;
- files of kernel interfaces (procfs, sysfs, debugfs, ...) are never read, even when root owns them;
- anything else named like a policy file (a FIFO, a directory, a device) is reported, never opened.

A refused file is never read, so nothing of its content can reach a log line or the status.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from gthulhu_node.errors import InvalidInput


class UntrustedError(InvalidInput):
    """A file or directory that someone other than root could change; the message says who and how."""


def trusted_uids() -> frozenset[int]:
    return frozenset({0, os.geteuid()})


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, ImportError):
        return f"uid {uid}"


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISLNK, "a symlink"),
)


def kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def check_writers(st: os.stat_result, what: str, *, sticky_ok: bool = False) -> None:
    """Refuse `st` unless only a trusted user can change it."""
    if st.st_uid not in trusted_uids():
        raise UntrustedError(f"{what} is owned by {_owner(st.st_uid)}: it must be owned by root")
    mode = stat.S_IMODE(st.st_mode)
    if sticky_ok and mode & stat.S_ISVTX:
        return
    if mode & stat.S_IWOTH:
        raise UntrustedError(f"{what} is world-writable: anyone could change this node's scheduling; "
                             "chmod o-w")
    if mode & stat.S_IWGRP:
        raise UntrustedError(f"{what} is group-writable (gid {st.st_gid}): chmod g-w")


# Filesystems whose "files" are kernel interfaces: reading one can have effects (/proc/kmsg consumes the
# kernel log) or show what the reader was not meant to see (/proc/self/cmdline). statfs(2)'s f_type.
PSEUDO_FILESYSTEMS = {
    0x9FA0: "procfs", 0x62656572: "sysfs", 0x64626720: "debugfs", 0x74726163: "tracefs",
    0x73636673: "securityfs", 0x27E0EB: "cgroupfs", 0x63677270: "cgroup2", 0xCAFE4A11: "bpffs",
    0x1CD1: "devpts", 0x62656570: "configfs", 0xDE5E81E4: "efivarfs", 0x6165676C: "pstore",
    0x65735543: "fusectl", 0x42494E4D: "binfmt_misc",
}
MAX_SYMLINKS = 40  # as the kernel's ELOOP
_O_PATH = getattr(os, "O_PATH", 0o10000000)


def filesystem_type(fd: int) -> int:
    """statfs(2)'s f_type of an open descriptor (an O_PATH one will do)."""
    import ctypes

    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first field, a long
    if _libc().fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ctypes.c_long.from_buffer(buf).value)


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def open_policy_file(path: Path) -> tuple[int, os.stat_result]:
    """Open a policy file for reading after checking every step to it on descriptors; returns (fd, fstat).

    The path is walked from `/` one component at a time with `openat(O_PATH | O_NOFOLLOW)`, each opened
    component checked with fstat: every directory on the way (symlinks' targets included) is trusted
    (check_writers, the sticky bit tolerated), every symlink is owned by a trusted user (its mode means
    nothing) and is followed by hand, and the last component must be a regular file, trusted, on a
    filesystem that is not a kernel interface (PSEUDO_FILESYSTEMS). Only then is it opened for reading,
    relative to its checked directory, and the inode read must be the one checked: a name swapped in
    between is refused, never read. Nothing that is not a checked regular file is ever opened for reading.

    Raises UntrustedError (refused, not read) or OSError.
    """
    return _open_walked(path, directory=False)


def open_policy_directory(path: Path) -> int:
    """Open the policy directory for listing, walked and checked as `open_policy_file` walks a file: every
    component on the way trusted, the directory itself owned by root and writable by no one else (the
    sticky bit excuses nothing there), opened relative to its checked parent and the same inode. Its
    listing (`os.listdir(fd)`) then names the entries of the directory that was checked, whatever is
    renamed meanwhile. Raises UntrustedError, FileNotFoundError or OSError.
    """
    return _open_walked(path, directory=True)[0]


def _open_walked(path: Path, *, directory: bool) -> tuple[int, os.stat_result]:
    fds: list[int] = []
    try:
        dir_fd = _open_dir("/", None, Path("/"), fds)
        here = Path("/")
        pending = list(path.absolute().parts[1:])
        via_link: Path | None = None  # the symlink the last component was reached through
        links = 0
        while pending:
            name = pending.pop(0)
            if name in ("", "."):
                continue
            if name == "..":
                here = here.parent
                dir_fd = _open_dir("..", dir_fd, here, fds)
                continue
            fd = os.open(name, _O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            fds.append(fd)
            st = os.fstat(fd)
            where = here / name
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > MAX_SYMLINKS:
                    raise UntrustedError(f"more than {MAX_SYMLINKS} symlinks on the way: not read")
                if st.st_uid not in trusted_uids():
                    raise UntrustedError(f"symlink {where} is owned by {_owner(st.st_uid)}: it must be owned "
                                         "by root (whoever owns a link chooses what it points to)")
                target = os.readlink("", dir_fd=fd)  # the link this descriptor holds, not the name's
                if not pending:
                    via_link = where
                pending[:0] = [p for p in Path(target).parts if p != "/"]
                if target.startswith("/"):
                    here = Path("/")
                    dir_fd = _open_dir("/", None, here, fds)
                continue
            if pending:  # a directory on the way
                if not stat.S_ISDIR(st.st_mode):
                    raise UntrustedError(f"{where} is {kind(st.st_mode)}, not a directory: not read")
                check_writers(st, f"directory {where} (on the way to the file)", sticky_ok=True)
                here, dir_fd = where, fd
                continue
            if directory:
                return _open_checked_directory(dir_fd, name, st, where)
            return _open_checked(dir_fd, name, fd, st, where, via_link)
        raise UntrustedError("not a file: not read")
    finally:
        for fd in fds:
            os.close(fd)


def _open_dir(name: str, dir_fd: int | None, where: Path, fds: list[int]) -> int:
    """An O_PATH descriptor of a directory on the way (`/` or `..`), checked like the others."""
    fd = os.open(name, _O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    fds.append(fd)
    check_writers(os.fstat(fd), f"directory {where} (on the way to the file)", sticky_ok=True)
    return fd


def _open_checked_directory(dir_fd: int, name: str, st: os.stat_result,
                            where: Path) -> tuple[int, os.stat_result]:
    """The policy directory, checked on its O_PATH descriptor, then opened for listing."""
    if not stat.S_ISDIR(st.st_mode):
        raise UntrustedError(f"{where} is {kind(st.st_mode)}, not a directory: not read")
    check_writers(st, f"directory {where}")
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    return _same_inode(fd, st)


def _same_inode(fd: int, st: os.stat_result) -> tuple[int, os.stat_result]:
    """`fd` and its fstat when it is the inode that was checked (`st`); closed and refused otherwise."""
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise UntrustedError("replaced while it was being checked: not read")
    except BaseException:
        os.close(fd)
        raise
    return fd, opened


def _open_checked(dir_fd: int, name: str, path_fd: int, st: os.stat_result, where: Path,
                  via_link: Path | None) -> tuple[int, os.stat_result]:
    """The last component, checked on its O_PATH descriptor, then opened for reading."""
    what = f"symlink target {where}" if via_link is not None else "the file"
    if not stat.S_ISREG(st.st_mode):
        if via_link is not None:
            raise UntrustedError(f"symlink to {where}, which is {kind(st.st_mode)}: not read")
        raise UntrustedError(f"{kind(st.st_mode)}, not a regular file: not read")
    fs = PSEUDO_FILESYSTEMS.get(filesystem_type(path_fd))
    if fs is not None:
        shown = f"symlink to {where}, which" if via_link is not None else str(where)
        raise UntrustedError(f"{shown} is on {fs}, a kernel interface, not a file: not read")
    check_writers(st, what)
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY,
                 dir_fd=dir_fd)
    return _same_inode(fd, st)
