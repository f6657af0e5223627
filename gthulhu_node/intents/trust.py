"""Who may change this node's scheduling through policies.d: only root (or the agent's own user).

A policy file tells a root daemon which threads to boost, so whoever can write it, or replace it, or the
directory it is in, decides the node's scheduling. The rules (the same idea as OpenSSH's StrictModes):
- the directory, and every directory above it, is owned by root (or the agent's user) and is not group-
  or world-writable; a world-writable ancestor is tolerated only with the sticky bit (/tmp), where others
  cannot rename or remove entries they do not own;
- a policy file is a regular file owned by root (or the agent's user), not group- or world-writable;
- a symlink is followed only to such a file, in such directories;
- anything else named like a policy file (a FIFO, a directory, a device) is reported, never opened.

A refused file is never read, so nothing of its content can reach a log line or the status.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

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


def check_directory(directory: Path) -> None:
    """Refuse a policy directory that, or whose ancestors, someone other than root could change.

    Raises FileNotFoundError when it does not exist, OSError when it cannot be examined.
    """
    real = Path(os.path.realpath(directory))
    check_writers(os.stat(real), f"directory {real}")
    for parent in real.parents:
        check_writers(os.stat(parent), f"directory {parent} (above the policy directory)", sticky_ok=True)


def open_policy_file(path: Path) -> tuple[int, os.stat_result]:
    """Open a policy file for reading after checking it (module docstring); returns (fd, fstat).

    Raises UntrustedError (refused, not opened) or OSError.
    """
    lst = os.lstat(path)
    target = path
    if stat.S_ISLNK(lst.st_mode):
        target = Path(os.path.realpath(path))
        st = os.stat(target)
        if not stat.S_ISREG(st.st_mode):
            raise UntrustedError(f"symlink to {target}, which is {kind(st.st_mode)}: not read")
        check_writers(st, f"symlink target {target}")
        for parent in target.parents:
            check_writers(os.stat(parent), f"directory {parent} (above the symlink target)", sticky_ok=True)
    elif not stat.S_ISREG(lst.st_mode):
        raise UntrustedError(f"{kind(lst.st_mode)}, not a regular file: not read")
    else:
        check_writers(lst, "the file")
        st = lst
    # O_NOFOLLOW on the resolved path and the inode comparison close the window between check and open.
    fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        opened = os.fstat(fd)
        if (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
            raise UntrustedError("replaced while it was being checked: not read")
    except BaseException:
        os.close(fd)
        raise
    return fd, opened
