"""The lab guest agent's warm Python (tests/vm/zygote.py), run here with real processes: a script it forks
gives the same exit code, output, input, environment and working folder as a fresh interpreter would, a
timeout kills the script's whole process group, and one script's state never reaches the next."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vm import guest_agent

REPO = Path(__file__).resolve().parents[2]
PYTHON = ".venv/bin/python"

SCRIPT = '''
import json, os, sys, time
PRELOADED = "gthulhu_node.config" in sys.modules
import gthulhu_node.config as preloaded
preloaded.ZYGOTE_RUNS = getattr(preloaded, "ZYGOTE_RUNS", 0) + 1  # a preloaded module's state
mode = sys.argv[1]
if mode == "echo":
    data = sys.stdin.read()
    print(json.dumps({"argv": sys.argv[1:], "stdin": data, "cwd": os.getcwd(),
                      "env": os.environ.get("ZYGOTE_TEST"), "state": preloaded.ZYGOTE_RUNS,
                      "preloaded": PRELOADED, "pgid": os.getpgid(0) == os.getpid()}))
    print("to stderr", file=sys.stderr)
elif mode == "exit":
    sys.exit(int(sys.argv[2]))
elif mode == "raise":
    raise RuntimeError("boom")
elif mode == "sleep":
    os.system("sleep 60 &")
    time.sleep(60)
'''


@pytest.fixture
def zygote(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[guest_agent.Zygote, Path]]:
    with tempfile.TemporaryDirectory(prefix="zyg-") as tmp:
        monkeypatch.setattr(guest_agent.Zygote, "SOCKET", f"{tmp}/z.sock")
        monkeypatch.setattr(guest_agent.Zygote, "PRELOAD", ("gthulhu_node.config",))
        script = Path(tmp) / "script.py"
        script.write_text(SCRIPT)
        z = guest_agent.Zygote()
        monkeypatch.setattr(guest_agent, "ZYGOTE", z)
        yield z, script
        if z._proc is not None:
            z._proc.kill()
            z._proc.wait()


def run(script: Path, *args: str, cold: bool = False, **extra: Any) -> dict[str, Any]:
    request = {"argv": [PYTHON, str(script), *args], "cwd": str(REPO), "cold": cold, **extra}
    return guest_agent.run(request)


def test_a_forked_script_behaves_as_a_fresh_interpreter(zygote: tuple[guest_agent.Zygote, Path]) -> None:
    z, script = zygote
    kw: dict[str, Any] = {"input": "hello", "env": {"ZYGOTE_TEST": "yes"}, "timeout": 60}
    warm, cold = run(script, "echo", "a", **kw), run(script, "echo", "a", cold=True, **kw)
    assert z._proc is not None and z._proc.poll() is None  # the warm one went through the zygote
    assert warm["returncode"] == cold["returncode"] == 0 and warm["stderr"] == cold["stderr"] == "to stderr\n"
    assert '"preloaded": true' in warm["stdout"] and '"preloaded": false' in cold["stdout"]
    assert warm["stdout"].replace("true", "false") == cold["stdout"].replace("true", "false")
    assert '"stdin": "hello"' in warm["stdout"] and '"env": "yes"' in warm["stdout"]
    assert f'"cwd": "{REPO}"' in warm["stdout"] and '"pgid": true' in warm["stdout"]
    # a second run starts from the zygote's state again, not from the first run's
    assert '"state": 1' in run(script, "echo", **kw)["stdout"]


def test_exit_codes_and_exceptions(zygote: tuple[guest_agent.Zygote, Path]) -> None:
    _, script = zygote
    assert run(script, "exit", "3")["returncode"] == 3
    res = run(script, "raise")
    assert res["returncode"] == 1 and "RuntimeError: boom" in res["stderr"]


def test_a_timeout_kills_the_scripts_process_group(zygote: tuple[guest_agent.Zygote, Path]) -> None:
    _, script = zygote
    started = time.monotonic()
    res = run(script, "sleep", timeout=3)
    assert res["timed_out"] and res["returncode"] == -9 and time.monotonic() - started < 30


def test_other_commands_are_not_forked(zygote: tuple[guest_agent.Zygote, Path]) -> None:
    z, _ = zygote
    res = guest_agent.run({"argv": [sys.executable, "-c", "print(1)"], "cwd": str(REPO)})
    assert res["stdout"] == "1\n" and z._proc is None
    assert z.for_command([PYTHON, "-m", "json.tool"], str(REPO)) is None
    assert os.path.exists(REPO / PYTHON)
