"""Why the probe cannot run here, said in one line that tells people what to install or do.

BCC compiles the probe's C at run time against the running kernel's headers, so three things must hold
before compiling: root (loading BPF programs), BCC's Python module (Debian's python3-bpfcc), and headers for
`uname -r`. Checking them first turns BCC's multi-line compiler noise into one actionable message.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from types import ModuleType

from gthulhu_node.errors import Unsupported

MODULES_ROOT = Path("/lib/modules")
KHEADERS = Path("/sys/kernel/kheaders.tar.xz")


class ProbeUnavailable(Unsupported):
    """The probe cannot run on this machine now; str() is the one-line message for people."""


def not_root_message() -> str:
    return "gthulhu-node probe: needs root (it loads BPF programs): run it as root or with sudo"


def bcc_missing_message(exc: BaseException) -> str:
    return (
        f"gthulhu-node probe: BCC is not installed (python module 'bcc': {exc}): "
        "install python3-bpfcc (apt-get install python3-bpfcc), then rerun scripts/install-deps"
    )


def no_headers_message(release: str) -> str:
    return (
        f"gthulhu-node probe: no kernel headers for {release} "
        f"({MODULES_ROOT / release / 'build'} is missing): install linux-headers-{release}"
    )


def unreadable_headers_message(exc: OSError) -> str:
    return (
        f"gthulhu-node probe: cannot look for the kernel headers ({exc}); in a systemd unit, "
        "ProtectKernelModules=yes hides /lib/modules (the shipped unit sets it to no: docs/service.md)"
    )


def import_bcc() -> ModuleType:
    """BCC's module, or ProbeUnavailable saying how to install it."""
    try:
        bcc = importlib.import_module("bcc")
    except ImportError as exc:
        raise ProbeUnavailable(bcc_missing_message(exc)) from None
    return bcc


def headers_present(release: str, modules_root: Path = MODULES_ROOT) -> bool:
    """Where BCC looks: $BCC_KERNEL_SOURCE, /lib/modules/<release>/build, or the kernel's own kheaders."""
    override = os.environ.get("BCC_KERNEL_SOURCE")
    if override:
        return Path(override).is_dir()
    return (modules_root / release / "build").is_dir() or KHEADERS.exists()


def check(modules_root: Path = MODULES_ROOT) -> ModuleType:
    """Raise ProbeUnavailable for the first thing missing; return BCC's module when all is there."""
    if os.geteuid() != 0:
        raise ProbeUnavailable(not_root_message())
    bcc = import_bcc()
    release = os.uname().release
    try:
        present = headers_present(release, modules_root)
    except OSError as exc:
        raise ProbeUnavailable(unreadable_headers_message(exc)) from None
    if not present:
        raise ProbeUnavailable(no_headers_message(release))
    return bcc
