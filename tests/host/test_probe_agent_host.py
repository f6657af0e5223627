"""The agent with `probe.enabled` on this machine's own kernel, which has no headers: the real
`gthulhu-node run` process (dry-run backend) must keep running and serving, say why the probe is off in
one log event, and export `gthulhu_node_probe_up 0`."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.host.agent_support import PYTHON, REPO, short_dir, wait_for, write_config
from tests.host.test_service_process import free_port
from tests.prom import scrape

pytestmark = pytest.mark.host


@pytest.fixture
def base() -> Iterator[Path]:
    d = short_dir()
    yield d
    subprocess.run(["rm", "-rf", str(d)], check=False)


def _events(log: Path) -> list[dict[str, object]]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def test_agent_runs_on_without_the_probe(base: Path) -> None:
    port = free_port()
    config = write_config(base, metrics={"listen": f"127.0.0.1:{port}"}, log={"format": "json"},
                          probe={"enabled": True, "poll_interval_s": 0.2})
    log = base / "agent.log"
    with log.open("wb") as out:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        proc = subprocess.Popen([str(PYTHON), "-m", "gthulhu_node", "run", "--config", str(config)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/")
        try:
            unavailable = wait_for(
                lambda: next((e for e in _events(log) if e.get("event") == "probe_unavailable"), None),
                timeout=60, what="the probe_unavailable event")
            assert f"no kernel headers for {os.uname().release}" in str(unavailable["reason"])
            got = wait_for(lambda: _scrape_or_none(port), timeout=30, what="a scrape")
            assert got["gthulhu_node_probe_up"][()] == 0
            assert got["gthulhu_node_ready"][()] == 1
            assert proc.poll() is None, "the agent exited"
        finally:
            proc.terminate()
            assert proc.wait(timeout=30) == 0
    assert not any(e.get("level") == "error" and "probe" in str(e.get("event")) for e in _events(log))


def _scrape_or_none(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
    try:
        got = scrape("127.0.0.1", port)
    except OSError:
        return None
    return got if "gthulhu_node_probe_up" in got and "gthulhu_node_ready" in got else None
