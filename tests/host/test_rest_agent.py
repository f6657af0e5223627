"""The REST API inside the real Agent (dry-run backend forced: nothing on this machine is rescheduled),
over mutual TLS on loopback: a Manager push reaches the threads it names, status reports it, pod intents
select processes by their pod cgroup, and the manager push never touches the other sources.

Pod cgroups are created by the test under the cgroup2 hierarchy and hold only processes the test started.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.agent import Agent
from gthulhu_node.config import AgentConfig
from gthulhu_node.intents.model import Intent
from tests.unit.rest_support import (
    Pki,
    call,
    client_context,
    make_pki,
    node_policy_rows,
    pod_intent_rows,
    public_pem,
    reference_merkle,
    shell_merkle,
    write_rsa_key,
)

pytestmark = pytest.mark.host

WORKLOAD = Path(__file__).with_name("vllm_threads.py")
NODE = "test-node"
# Thread names unique to this run: the dry-run agent watches the whole machine, where other tests may run
# vLLM-like workloads with the same thread names at the same time.
TAG = uuid.uuid4().hex[:6]
ENGINE0, ENGINE1, POD_WORKER = f"Eng{TAG}_DP0", f"Eng{TAG}_DP1", f"pod{TAG}wk"
DEADLINE_S = 60.0


def wait_for(what: str, cond: Callable[[], bool]) -> None:
    end = time.monotonic() + DEADLINE_S
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"not reached within {DEADLINE_S}s: {what}")
        time.sleep(0.05)


class Manager:
    """Speaks to the agent the way the Manager does (mTLS, token, bearer)."""

    def __init__(self, agent: Agent, pki: Pki, key: Any) -> None:
        self.ctx = client_context(pki)
        self.base = f"https://localhost:{agent.rest.port}"
        reply = call(self.base, "POST", "/api/v1/auth/token",
                     json.dumps({"public_key": public_pem(key), "client_id": "manager-client"}),
                     {"Content-Type": "application/json"}, self.ctx)
        assert reply.status == 200, reply.body
        self.token = reply.body["data"]["token"]

    def __call__(self, method: str, path: str, body: Any = None) -> Any:
        headers = {"Authorization": f"Bearer {self.token}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        reply = call(self.base, method, path, json.dumps(body) if body is not None else None, headers,
                     self.ctx)
        assert reply.status == 200, (method, path, reply.status, reply.body)
        return reply.body.get("data", {})


@contextmanager
def agent_with_rest() -> Iterator[tuple[Agent, Manager]]:
    base = Path(tempfile.mkdtemp(prefix="gn-rest-", dir="/tmp"))
    try:
        pki = make_pki(base)
        key = write_rsa_key(base / "jwt.key")
        (base / "policies.d").mkdir()
        (base / "policies.d" / "vllm.yaml").write_text(
            f"- id: local-engine\n  commandRegex: '^{ENGINE1}$'\n  priority: 3\n"
        )
        config = AgentConfig.model_validate({
            "node": {"name": NODE},
            "backend": {"kind": "dry-run"},
            "api": {"socket": str(base / "run" / "api.sock")},
            "state": {"directory": str(base / "state")},
            "policies": {"directory": str(base / "policies.d")},
            "metrics": {"listen": ""},
            "watch": {"rescan_interval_s": 2.0},
            "rest": {
                "enabled": True,
                "listen": "127.0.0.1:0",
                "tls_cert": str(pki.server_cert),
                "tls_key": str(pki.server_key),
                "tls_client_ca": str(pki.ca),
                "jwt_private_key": str(base / "jwt.key"),
            },
        })
        agent = Agent(config)
        agent.start()
        try:
            yield agent, Manager(agent, pki, key)
        finally:
            agent.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Workload:
    """tests/host/vllm_threads.py, optionally started inside a cgroup (it moves itself before exec)."""

    def __init__(self, cgroup: Path | None = None) -> None:
        argv = [sys.executable, str(WORKLOAD)]
        if cgroup is not None:
            argv = ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$@"', "sh", *argv]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def spawn(self, name: str) -> int:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"spawn {name}\n")
        self.proc.stdin.flush()
        return int(self.proc.stdout.readline().split()[2])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def tids(agent: Agent, key: str) -> set[int]:
    return {m.tid for m in agent.matches(key)}


def states(manager: Manager) -> dict[str, dict[str, Any]]:
    return {p["policyID"]: p for p in manager("GET", "/api/v1/node-intents")["policies"]}


def test_manager_push_reaches_threads_and_status() -> None:
    with agent_with_rest() as (agent, manager):
        agent.store.apply("ops-team", 3, [Intent(id="db", commandRegex="^postgres$", priority=2)])

        def others() -> dict[str, Any]:
            return {k: v for k, v in agent.store.snapshot().items() if k != "manager"}

        before = others()
        assert set(before) == {"local", "ops-team"}
        work = Workload()
        try:
            engine_tid = work.spawn(ENGINE0)
            local_tid = work.spawn(ENGINE1)
            policies = [
                {"policyID": "665f1c2ab1d4e9a0c3b7f812", "nodeID": NODE,
                 "commandRegex": f"^{ENGINE0}$", "priority": 10, "executionTime": 2_000_000},
                {"policyID": "665f1c2ab1d4e9a0c3b7f813", "nodeID": "another-node",
                 "commandRegex": "^no-such-thread$", "priority": 20},
            ]
            data = manager("POST", "/api/v1/node-intents", {"policies": policies})
            assert data["accepted"] == 2 and data["nodeNameMismatch"] == ["665f1c2ab1d4e9a0c3b7f813"]
            wait_for("manager intent governs the engine thread",
                     lambda: engine_tid in tids(agent, "manager/665f1c2ab1d4e9a0c3b7f812"))
            engine_id = "665f1c2ab1d4e9a0c3b7f812"
            wait_for("status applied", lambda: states(manager)[engine_id]["state"] == "applied")
            row = states(manager)[engine_id]
            assert row["matchedTasks"] == 1
            # the Manager chose this node: applied whatever the node calls itself, with a warning
            other = states(manager)["665f1c2ab1d4e9a0c3b7f813"]
            assert other["state"] == "applied" and any("another-node" in w for w in other["warnings"])
            assert local_tid in tids(agent, "local/local-engine")
            assert manager("GET", "/api/v1/node-intents/merkle")["rootHash"] == shell_merkle(
                node_policy_rows(policies)
            )
            assert others() == before
            manager("DELETE", "/api/v1/node-intents", {"all": True})
            wait_for("manager intent gone", lambda: not tids(agent, "manager/665f1c2ab1d4e9a0c3b7f812"))
            assert local_tid in tids(agent, "local/local-engine")
            assert others() == before
        finally:
            work.close()


def test_thousand_intents_applied_and_acknowledged() -> None:
    with agent_with_rest() as (agent, manager):
        policies = [
            {"policyID": f"{i:024x}", "nodeID": NODE, "commandRegex": f"^{TAG}-w{i}$",
             "priority": 1 + i % 20, "executionTime": 1_000_000}
            for i in range(1000)
        ]
        data = manager("POST", "/api/v1/node-intents", {"policies": policies})
        assert data["accepted"] == 1000
        assert len(agent.store.get("manager").intents) == 1000  # type: ignore[union-attr]
        wait_for("1,000 intents applied",
                 lambda: all(p.get("state") == "applied" for p in states(manager).values()))
        assert len(states(manager)) == 1000
        assert manager("GET", "/api/v1/node-intents/merkle")["rootHash"] == reference_merkle(
            node_policy_rows(policies)
        )


# the cgroup2 hierarchy: hybrid hosts mount it at unified/, cgroup2-only hosts at the top
UNIFIED = Path("/sys/fs/cgroup/unified")
CGROUP2 = UNIFIED if (UNIFIED / "cgroup.procs").exists() else Path("/sys/fs/cgroup")


@contextmanager
def pod_cgroups() -> Iterator[tuple[str, Path, str, Path]]:
    """Two pod cgroups named as kubelet names them: systemd driver (`_` in the UID) and cgroupfs driver."""
    uid_a, uid_b = str(uuid.uuid4()), str(uuid.uuid4())
    top_a = CGROUP2 / f"gn-test-{uid_a[:8]}-kubepods.slice"
    dir_a = top_a / "kubepods-burstable.slice" / f"kubepods-burstable-pod{uid_a.replace('-', '_')}.slice"
    top_b = CGROUP2 / f"gn-test-{uid_b[:8]}-kubepods"
    dir_b = top_b / "burstable" / f"pod{uid_b}" / ("0" * 64)
    dir_a.mkdir(parents=True)
    dir_b.mkdir(parents=True)
    try:
        yield uid_a, dir_a, uid_b, dir_b
    finally:
        for d in (dir_a, dir_a.parent, top_a, dir_b, dir_b.parent, dir_b.parent.parent, top_b):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # the killed processes leave the cgroup asynchronously


def test_pod_intents_select_processes_by_pod_cgroup() -> None:
    with pod_cgroups() as (uid_a, dir_a, uid_b, dir_b), agent_with_rest() as (agent, manager):
        in_a, in_b, outside = Workload(dir_a), Workload(dir_b), Workload()
        try:
            tid_a, tid_b = in_a.spawn(POD_WORKER), in_b.spawn(POD_WORKER)
            tid_out = outside.spawn(POD_WORKER)
            assert uid_a.replace("-", "_") in Path(f"/proc/{in_a.proc.pid}/cgroup").read_text()
            intents = [
                {"podName": "vllm-0", "podID": uid_a, "nodeID": NODE, "k8sNamespace": "ml",
                 "commandRegex": f"^{POD_WORKER}$", "priority": 10, "executionTime": 2_000_000,
                 "podLabels": {"app": "vllm", "tier": "gpu"}},
                {"podName": "web-1", "podID": uid_b, "nodeID": NODE, "k8sNamespace": "default",
                 "commandRegex": f"^{POD_WORKER}$", "priority": 2},
            ]
            data = manager("POST", "/api/v1/intents", {"intents": intents})
            assert data["accepted"] == 2
            held = agent.store.get("manager-pods")
            assert held is not None
            keys = {i.pod_uid: f"manager-pods/{i.id}" for i in held.intents}
            wait_for("pod A's thread matched", lambda: tids(agent, keys[uid_a]) == {tid_a})
            wait_for("pod B's thread matched", lambda: tids(agent, keys[uid_b]) == {tid_b})
            all_matched = {m.tid for m in agent.matches()}
            assert tid_out not in all_matched
            rows = pod_intent_rows(intents)
            assert manager("GET", "/api/v1/intents/merkle")["rootHash"] == shell_merkle(rows)
            manager("DELETE", "/api/v1/intents", {"podId": uid_a})
            wait_for("pod A's intent gone", lambda: tid_a not in {m.tid for m in agent.matches()})
            assert tids(agent, keys[uid_b]) == {tid_b}
            assert manager("GET", "/api/v1/intents/merkle")["rootHash"] == shell_merkle(rows[1:])
        finally:
            for w in (in_a, in_b, outside):
                w.close()
