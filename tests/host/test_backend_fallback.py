"""`backend: auto` when the kernel refuses our sched_ext scheduler: the agent falls back instead of dying,
and says so in its status, log and metrics; `backend: sched_ext` fails hard.

The refusal itself is simulated here (this machine's kernel has no sched_ext): a backend whose start raises
SchedulerRefused stands in for the sched_ext one. The real refusal, from the kernel and libbpf, is
tested in the lab on both kernels (tests/vm/test_matrix.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from gthulhu_node import agent as agent_module
from gthulhu_node.agent import Agent
from gthulhu_node.backends.base import Backend, SchedulerRefused
from gthulhu_node.backends.dryrun import DryRunBackend
from gthulhu_node.config import AgentConfig
from gthulhu_node.metrics import Metrics
from tests.host.agent_support import config_dict, short_dir
from tests.prom import parse_samples

REFUSAL = "the kernel refused the scheduler (gthulhu.bpf.o): [Errno 95] (Cannot find member x in kernel BTF)"


class RefusedBackend(DryRunBackend):
    name = "sched_ext"

    def start(self) -> None:
        raise SchedulerRefused(REFUSAL, ("libbpf: struct_ops init_kern gthulhu_ops: Cannot find member x",))


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> None:
    def select(config: Any) -> tuple[Backend, str]:
        return RefusedBackend(), "auto: the kernel has sched_ext"

    def fallback(config: Any, refusal: str) -> tuple[Backend, str]:
        return DryRunBackend(), f"auto: the kernel refused the sched_ext scheduler ({refusal}); dry run"

    monkeypatch.setattr(agent_module, "select_backend", select)
    monkeypatch.setattr(agent_module, "fallback_after_refusal", fallback)


def _agent(base: Path, kind: str) -> Agent:
    return Agent(AgentConfig.model_validate(config_dict(base, backend={"kind": kind})))


def test_auto_falls_back_and_says_so(refusing: None) -> None:
    agent = _agent(short_dir(), "auto")
    agent.start()
    metrics = Metrics()
    try:
        assert agent.backend is not None and agent.backend.name == "dry-run"
        assert REFUSAL in agent.backend_reason
        assert agent.sched_ext_refused == REFUSAL
        assert REFUSAL in agent.status().agent.backend_reason
        metrics.attach(agent)
        samples = parse_samples(generate_latest(metrics.registry).decode())
        assert samples["gthulhu_node_sched_ext_refused"][()] == 1.0
    finally:
        agent.stop()


def test_forced_sched_ext_fails_hard(refusing: None) -> None:
    agent = _agent(short_dir(), "sched_ext")
    with pytest.raises(SchedulerRefused):
        agent.start()
