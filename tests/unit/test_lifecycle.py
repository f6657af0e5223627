"""The one lifecycle (gthulhu_node/lifecycle.py): parts start in the listed order, stop in reverse, a part
that fails to start is named and what started before it is undone, and the process's order is one list."""

from __future__ import annotations

from pathlib import Path

import pytest

from gthulhu_node.agent import Agent
from gthulhu_node.api.server import ApiConfigError
from gthulhu_node.backends.base import BackendState
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.config import AgentConfig
from gthulhu_node.lifecycle import Health, Step, Supervisor
from gthulhu_node.service import Service


def parts(log: list[str], names: str, fail_start: str = "", fail_stop: str = "") -> list[Step]:
    def step(name: str) -> Step:
        def start() -> None:
            log.append(f"start {name}")
            if name == fail_start:
                raise OSError(f"{name} cannot bind")

        def stop() -> None:
            log.append(f"stop {name}")
            if name == fail_stop:
                raise RuntimeError(f"{name} stuck")

        return Step(name, start, stop, lambda: Health(name != "b", f"{name} degraded"))

    return [step(n) for n in names]


def test_starts_in_order_and_stops_in_reverse() -> None:
    log: list[str] = []
    sup = Supervisor(parts(log, "abc"))
    sup.start()
    assert sup.started == ["a", "b", "c"]
    assert sup.health() == {"a": Health(True, "a degraded"), "b": Health(False, "b degraded"),
                            "c": Health(True, "c degraded")}
    assert sup.stop() == []
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]
    assert sup.stop() == []  # idempotent: nothing is stopped twice
    assert len(log) == 6


def test_a_failed_start_is_named_and_what_started_is_undone_in_reverse() -> None:
    log: list[str] = []
    sup = Supervisor(parts(log, "abcd", fail_start="c"))
    with pytest.raises(OSError, match="c cannot bind") as caught:  # the original type, for callers
        sup.start()
    assert sup.failed == "c"
    assert "while starting c" in caught.value.__notes__
    assert log == ["start a", "start b", "start c", "stop c", "stop b", "stop a"]  # d never started
    assert sup.started == []


def test_stop_goes_on_past_a_part_that_fails_and_reports_it() -> None:
    log: list[str] = []
    sup = Supervisor(parts(log, "abc", fail_stop="b"))
    sup.start()
    failures = sup.stop()
    assert [(f.name, str(f.error)) for f in failures] == [("b", "b stuck")]
    assert log[3:] == ["stop c", "stop b", "stop a"]


def test_names_are_unique() -> None:
    with pytest.raises(ValueError, match="unique"):
        Supervisor(parts([], "aa"))


def config(tmp_path: Path, **sections: dict[str, object]) -> AgentConfig:
    return AgentConfig.model_validate({
        "state": {"directory": str(tmp_path / "state")},
        "policies": {"directory": str(tmp_path / "policies")},
        "api": {"socket": str(tmp_path / "api.sock")},
        **sections,
    })


def test_the_process_order_is_one_list(tmp_path: Path) -> None:
    """Metrics first (a hanging start can be looked at), the agent's parts with `ready` last among them
    (the first undone at stop), the probe after the agent it watches."""
    cfg = config(tmp_path, rest={"enabled": True, "insecure_allow_plain_http": True},
                 probe={"enabled": True})
    service = Service(cfg, agent_factory=lambda c: Agent(c, backend=DryRunBackend()))
    service._agent = service.agent_factory(cfg)
    assert [c.name for c in service._components()] == [
        "metrics", "backend", "engine", "policy-files", "cgroup-limits", "status", "api", "rest", "ready",
        "probe"]
    agent = Agent(config(tmp_path), backend=DryRunBackend())
    assert [c.name for c in agent.components()] == ["backend", "engine", "policy-files", "cgroup-limits",
                                                     "status", "api", "ready"]


def test_an_agent_that_fails_to_start_undoes_its_parts(tmp_path: Path) -> None:
    """A socket path taken by a regular file: the API fails with its own error, and the engine and backend
    started before it are stopped."""
    cfg = config(tmp_path)
    cfg.api.socket.write_text("not a socket")
    backend = DryRunBackend()
    agent = Agent(cfg, backend=backend)
    with pytest.raises(ApiConfigError, match="is not a socket") as caught:
        agent.start()
    assert "while starting api" in caught.value.__notes__
    assert agent.engine is not None and not agent.engine.running
    assert backend.health().state is BackendState.STOPPED
    assert not agent.ready and agent.wait_stopped(0)
    agent.stop()  # idempotent after a failed start
