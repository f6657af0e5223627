"""The lab's kernel cache filled by several processes at once, as pytest's workers do on a fresh machine.

Each worker collects the tests parametrized by `other_btfs()` (tests/host/test_scheduler_compat.py,
test_scheduler_arm64.py), so on an empty cache two workers fetched the same headers packages into the same
folders at the same moment; one failed with FileNotFoundError on another's half-unpacked folder, the
workers collected different tests, and `make test` stopped before running any (seen 2026-12-02 on a fresh
cache). Real apt, real downloads (arm64's cloud-kernel headers, about 1.5 MB each) into a private cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# what a pytest worker does when it collects test_scheduler_arm64.py
FETCH = "from tests.vm.kernel import other_btfs\nfor v, p in other_btfs(arch='arm64').items(): print(v, p)"


def test_two_processes_fetching_every_btf_into_an_empty_cache_agree(tmp_path: Path) -> None:
    env = {**os.environ, "GTHULHU_LAB_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-c", FETCH]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=900) for p in procs]
    for proc, (_, err) in zip(procs, results, strict=True):
        assert proc.returncode == 0, err[-3000:]
    listed = [sorted(out.split("\n")) for out, _ in results]
    assert listed[0] == listed[1], listed
    paths = [Path(line.split()[1]) for line in results[0][0].splitlines()]
    assert paths and all(p.stat().st_size > 1_000_000 for p in paths), paths
