"""One `make deb` per test run, shared by the host package tests (tests/host/test_deb.py) and the lab
package test (tests/vm/test_deb_lab.py).

Building takes about 4 minutes on a loaded 2-core machine (mostly pip). Each of the two lanes of `make
test` used to build its own; the lab lane's guest sat idle meanwhile. Whichever test asks first builds it,
under a lock; the other waits for that build and takes its package. A package is reused only within the
same test run (xdist gives every worker of one run the same PYTEST_XDIST_TESTRUNUID), never from an earlier
run, whose sources may differ."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIST = REPO / "dist"


def _run_id() -> str:
    return os.environ.get("PYTEST_XDIST_TESTRUNUID") or f"pid-{os.getpid()}"


def session_deb() -> Path:
    """`scripts/build-deb`'s package for this test run, built at most once per run."""
    DIST.mkdir(exist_ok=True)
    stamp = DIST / ".test-run-deb"
    with (DIST / ".test-run-deb.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.exists():
            run_id, _, path = stamp.read_text().partition("\n")
            if run_id == _run_id() and Path(path.strip()).is_file():
                return Path(path.strip())
        out = subprocess.run([str(REPO / "scripts" / "build-deb")], capture_output=True, text=True,
                             check=False, timeout=1800)
        assert out.returncode == 0, out.stderr[-3000:]
        deb = Path(out.stdout.strip().splitlines()[-1]).resolve()
        stamp.write_text(f"{_run_id()}\n{deb}\n")
        return deb
