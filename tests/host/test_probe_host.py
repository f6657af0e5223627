"""`gthulhu-node probe` on this machine's own kernel, which has no headers (docs/probe.md): the real
command, run as root and as nobody, must fail with one clear line and a non-zero exit, before touching the
kernel."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.host import unprivileged

pytestmark = pytest.mark.host

GTHULHU = [sys.executable, "-m", "gthulhu_node"]
REPO = Path(__file__).resolve().parents[2]


def _probe(prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(prefix or []), *GTHULHU, "probe", "--regex", "x", "--duration", "1"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )


def test_no_headers_on_this_kernel() -> None:
    release = os.uname().release
    assert not Path(f"/lib/modules/{release}/build").exists(), "this machine's kernel has headers after all"
    done = _probe()
    assert done.returncode != 0
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"no kernel headers for {release}" in done.stderr
    assert f"install linux-headers-{release}" in done.stderr


def test_not_root() -> None:
    done = unprivileged.cli("nobody", "probe", "--regex", "x", "--duration", "1")
    assert done.returncode != 0
    assert done.stderr.count("\n") == 1, done.stderr
    assert "needs root" in done.stderr
