"""The real CLI (a subprocess) against a real agent: apply/status/matches/delete, tables and -o json,
--dry-run without an agent, clear errors, a non-root user refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.host.agent_support import NamedThread, run_cli, running_agent, short_dir, wait_for

pytestmark = pytest.mark.host

POLICY = """\
- id: engine
  commandRegex: "^gn-cli-eng$"
  priority: 2
  executionTime: 2000000
- commandRegex: "^gn-cli-(eng|aux)$"
  priority: 10
- id: nothing
  commandRegex: "^no-such-thread$"
  priority: 1
"""


@pytest.fixture(scope="module")
def agent():  # type: ignore[no-untyped-def]
    with running_agent() as a:
        yield a


def sock_args(agent) -> list[str]:  # type: ignore[no-untyped-def]
    return ["--socket", str(agent.config.api.socket)]


def test_apply_status_matches_delete(agent, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "mine.yaml"
    f.write_text(POLICY)
    with NamedThread("gn-cli-eng") as eng:
        out = run_cli("apply", "-f", str(f), *sock_args(agent), check=True).stdout
        assert "3 intents" in out and "applied" in out and "generation 1" in out
        again = run_cli("apply", "-f", str(f), "-o", "json", *sock_args(agent), check=True)
        assert json.loads(again.stdout) == {"generation": "1", "changed": False}

        def engine_status() -> dict | None:  # type: ignore[type-arg]
            doc = json.loads(run_cli("status", "-o", "json", *sock_args(agent), check=True).stdout)
            by_key = {s["key"]: s for s in doc["intents"]}
            return doc if by_key["cli/engine"].get("matchedTasks") == "1" else None

        doc = wait_for(engine_status, what="status with the engine thread matched")
        by_key = {s["key"]: s for s in doc["intents"]}
        assert by_key["cli/engine"]["state"] == "INTENT_STATE_APPLIED"
        assert by_key["cli/engine"]["intent"]["commandRegex"] == "^gn-cli-eng$"
        assert by_key["cli/engine"]["intent"]["executionTime"] == "2000000"
        assert any("overlaps with cli/engine" in w for w in by_key["cli/mine-1"]["warnings"])
        assert any("not the command line" in w for w in by_key["cli/nothing"]["warnings"])
        assert doc["agent"]["nodeName"] == "test-node"

        table = run_cli("status", *sock_args(agent), check=True).stdout
        assert "cli/engine" in table and "Applied" in table and "2ms" in table
        assert "cli/nothing: matches no task right now" in table

        matches = json.loads(run_cli("matches", "-o", "json", *sock_args(agent), check=True).stdout)
        (m,) = [m for m in matches["matches"] if m["tid"] == eng.tid]
        assert m["intent"] == "cli/engine" and m["comm"] == "gn-cli-eng" and m["priority"] == "2"
        assert "gn-cli-eng" in run_cli("matches", *sock_args(agent), check=True).stdout

        run_cli("delete", "engine", *sock_args(agent), check=True)
        run_cli("delete", "cli/nothing", *sock_args(agent), check=True)
        doc = json.loads(
            run_cli("status", "--source", "cli", "-o", "json", *sock_args(agent), check=True).stdout
        )
        assert [s["key"] for s in doc["intents"]] == ["cli/mine-1"]
        gone = run_cli("delete", "engine", *sock_args(agent))
        assert gone.returncode == 1 and "not found" in gone.stderr


def test_apply_refused_with_field_and_stale_generation(agent, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    f = tmp_path / "x.json"
    f.write_text('{"id": "a", "commandRegex": "x", "priority": 3}')
    run_cli("apply", "-f", str(f), "--source", "gens", "--generation", "5", *sock_args(agent), check=True)
    stale = run_cli("apply", "-f", str(f), "--source", "gens", "--generation", "4", *sock_args(agent))
    assert stale.returncode == 1 and "stale" in stale.stderr
    reserved = run_cli("apply", "-f", str(f), "--source", "manager", *sock_args(agent))
    assert reserved.returncode == 1 and "invalid argument: source:" in reserved.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("- id: a\n  commandRegex: x\n  priority: 21\n")
    r = run_cli("apply", "-f", str(bad), *sock_args(agent))
    assert r.returncode == 2 and "[0].priority: priority 21 is outside 0-20" in r.stderr


def test_dry_run_without_agent_changes_nothing(tmp_path: Path) -> None:
    f = tmp_path / "dry.yaml"
    f.write_text(POLICY)
    missing = tmp_path / "no-agent.sock"
    with NamedThread("gn-cli-eng") as eng, NamedThread("gn-cli-aux") as aux:
        r = run_cli("apply", "--dry-run", "-f", str(f), "-o", "json", "--socket", str(missing), check=True)
    doc = json.loads(r.stdout)
    assert doc["valid"] and not doc["comparedWithRunningAgent"]
    # Threads are scanned by the CLI's own process; the test threads live in this process.
    rows = {m["tid"]: m for m in doc["matches"]}
    assert rows[eng.tid]["intent"] == "cli/engine" and rows[eng.tid]["sliceNs"] == 2_000_000
    assert rows[aux.tid]["intent"] == "cli/dry-1" and rows[aux.tid]["priority"] == 10
    by_key = {i["key"]: i for i in doc["intents"]}
    assert by_key["cli/engine"]["matchedTasks"] == 1
    assert any("overlaps with cli/engine on 1 tasks" in w for w in by_key["cli/dry-1"]["warnings"])
    assert any("not the command line" in w for w in by_key["cli/nothing"]["warnings"])
    table = run_cli("apply", "--dry-run", "-f", str(f), "--socket", str(missing), check=True).stdout
    assert "dry run: nothing was changed" in table
    assert not missing.exists()


def test_agent_not_running_says_which_socket_and_how_to_start(tmp_path: Path) -> None:
    sock = tmp_path / "nothing-here.sock"
    r = run_cli("status", "--socket", str(sock))
    assert r.returncode == 3
    assert str(sock) in r.stderr and "not running" in r.stderr and "systemctl start gthulhu-node" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_non_root_user_refused() -> None:
    base = short_dir()
    with running_agent(base) as a:
        r = run_cli("status", "--socket", str(a.config.api.socket), user="nobody")
        assert r.returncode == 3 and "permission denied" in r.stderr and "root-only" in r.stderr
        root = run_cli("status", "--socket", str(a.config.api.socket))
        assert root.returncode == 0
