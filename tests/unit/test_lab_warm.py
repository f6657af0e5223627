"""tests/vm/warm.py: the agent's CLI run in a forked child must behave as the installed command does.

Real processes: each case runs in a fresh single-threaded interpreter (warm.py forks, and pytest's own
process may run threads), which compares `run_cli` with an exec of `.venv/bin/gthulhu-node`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).with_name("gthulhu-node")

DRIVER = """
import json, sys
from tests.vm import warm
r = warm.run_cli(json.loads(sys.argv[1]), timeout=60)
print(json.dumps({"returncode": r.returncode, "stdout": r.stdout, "stderr": r.stderr}))
"""


def warm_run(args: list[str]) -> dict[str, object]:
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(args)], cwd=REPO, capture_output=True,
                       text=True, timeout=120, check=True)
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("args", [["--version"], ["status", "--socket", "/nonexistent/api.sock"],
                                  ["no-such-command"]])
def test_a_warm_cli_run_answers_as_the_installed_command(args: list[str]) -> None:
    cold = subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=120)
    warm = warm_run(args)
    assert warm == {"returncode": cold.returncode, "stdout": cold.stdout, "stderr": cold.stderr}


def test_a_warm_process_is_stopped_and_reaped_like_popen(tmp_path: Path) -> None:
    driver = """
import signal, subprocess, sys, time
from tests.vm import warm
p = warm.spawn(lambda: time.sleep(60))
assert p.poll() is None
p.terminate()
print(p.wait(10), p.poll())
q = warm.spawn(lambda: 7)
print(q.wait(10))
d = warm.spawn(lambda: print("to devnull"), stdout=subprocess.DEVNULL)
print(d.wait(10))
"""
    r = subprocess.run([sys.executable, "-c", driver], cwd=REPO, capture_output=True, text=True,
                       timeout=60, check=True)
    # DEVNULL is -3 to subprocess: taken for a descriptor, the child failed at once (exit 1)
    assert r.stdout.split() == [str(-15), str(-15), "7", "0"]
