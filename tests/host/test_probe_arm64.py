"""The probe's C (gthulhu_node/probe/runqwait.bpf.c) is compiled by BCC on the target, against that
kernel's headers: it must compile against arm64 headers too. It reads only the sched raw tracepoints'
arguments and BPF helpers (no pt_regs, no kprobes, no syscall wrappers), so nothing in it is x86's; this
compiles it with BCC for arm64 (ARCH=arm64) against Debian's arm64 7.3 cloud kernel headers, with the
amd64 ones as the control.

This machine's kernel has no headers (test_probe_host.py), so each run happens in a private mount
namespace where /lib/modules/<release>/{build,source} point at the unpacked headers: the machine's own
mounts are untouched. The program BCC built is then loaded and attached to this kernel's raw tracepoints
for a moment (BPF byte code is the same machine everywhere; the task_struct offsets are the other
kernel's, harmless for a moment: only a tid is read), exactly as `gthulhu-node probe` does, through the
agent's own RunqueueProbe.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.vm.kernel import lab_kernel

pytestmark = pytest.mark.host

REPO = Path(__file__).resolve().parents[2]
# BCC's name of the architecture (its ARCH variable); unset means this machine's own.
BCC_ARCH = {"amd64": None, "arm64": "arm64"}

NAMESPACE_SETUP = """set -e
mount -t tmpfs tmpfs /lib/modules
mkdir -p "/lib/modules/$(uname -r)"
ln -s "$HEADERS" "/lib/modules/$(uname -r)/build"
ln -s "$COMMON" "/lib/modules/$(uname -r)/source"
exec "$PYTHON" -c "$PROGRAM"
"""

PROGRAM = """
from gthulhu_node.probe.loader import RunqueueProbe
probe = RunqueueProbe(per_thread=True, max_targets=16)
probe.close()
print("compiled and attached")
"""


def compile_probe(headers_of: str, bcc_arch: str | None) -> subprocess.CompletedProcess[str]:
    """RunqueueProbe built by BCC (ARCH=`bcc_arch`) against the headers of Debian's 7.3 kernel of
    architecture `headers_of`, in a private mount namespace."""
    kernel = lab_kernel("7.3", arch=headers_of)
    env = {**os.environ, "HEADERS": str(kernel.headers), "COMMON": str(kernel.common_headers),
           "PYTHON": sys.executable, "PROGRAM": PROGRAM}
    env.pop("ARCH", None)
    if bcc_arch is not None:
        env["ARCH"] = bcc_arch
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", NAMESPACE_SETUP],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False)


@pytest.mark.parametrize("arch", sorted(BCC_ARCH))
def test_the_probe_compiles_for_the_architecture(arch: str) -> None:
    done = compile_probe(arch, BCC_ARCH[arch])
    assert done.returncode == 0 and done.stdout.strip() == "compiled and attached", done.stderr[-3000:]


def test_the_arm64_headers_need_arm64() -> None:
    """What makes the test above able to fail: with x86 named instead, BCC does not find the asm headers
    in the arm64 tree (so ARCH=arm64 is what the arm64 run compiled with)."""
    done = compile_probe("arm64", "x86")
    assert done.returncode != 0 and "did not compile" in done.stderr, done.stderr[-3000:]
