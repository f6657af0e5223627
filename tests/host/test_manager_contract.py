"""Contract tests: what a real Gthulhu Manager sends, replayed against the real agent over mutual TLS.

No real Manager can run here (its Go modules are not reachable), so every replayed exchange names the
upstream file it follows, all read at Gthulhu/Gthulhu@c969a96b10cb551b28e2f4a8320b803d62fe3f9b (v1.3.0 plus
two commits, 2026-08-17):
- bodies: api/manager/client/deicison_maker.go (node policies: SendNodeSchedulingIntents builds
  `dmrest.NodePolicy` with every field `omitempty`, api/decisionmaker/rest/node_policy_hdl.go; pod intents:
  `rest.Intent`, api/decisionmaker/rest/intent_handler.go);
- UI defaults: api/web/src/pages/NodePoliciesPage.jsx (a new node policy starts with `commandRegex: ''`,
  priority and executionTime inputs have only `min="0"`), api/web/src/components/cards/StrategiesCard.jsx
  (a strategy starts with `commandRegex: ''`);
- the reconcile cycle: api/manager/service/cron_svc.go (every 30 s, api/manager/app/rest_app.go: pod
  merkle check then, only when some node intent exists in the cluster, the node merkle check; a mismatch
  with nothing left for the node is answered with `DELETE {"all": true}`);
- the Manager's merkle: its expected root is computed here with bash + sha256sum (tests/unit/rest_support),
  from the very bodies it sent.
Real parts only: the Agent (dry-run backend), its REST listener on a loopback socket with mTLS, its state
directory across restarts, real threads in real (test-made) pod cgroups.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import structlog

from gthulhu_node.agent import Agent
from tests.host.agent_support import REPO, running_agent, short_dir
from tests.host.test_rest_agent import POD_WORKER, TAG, Manager, Workload, pod_cgroups, tids, wait_for
from tests.unit.rest_support import (
    Reply,
    call,
    client_context,
    make_pki,
    node_policy_rows,
    pod_intent_rows,
    shell_merkle,
    write_rsa_key,
)

pytestmark = pytest.mark.host

NODE = "test-node"  # tests.host.agent_support.config_dict's node name
EMPTY_ROOT = shell_merkle([])
ENGINE = f"Eng{TAG}_ct"
GNODE = REPO / ".venv" / "bin" / "gthulhu-node"


class Lab:
    """One node's persistent directory (state, keys, certificates) that agents are started on in turn."""

    def __init__(self) -> None:
        self.base = short_dir()
        (self.base / "policies.d").mkdir()
        self.pki = make_pki(self.base)
        self.key = write_rsa_key(self.base / "jwt.key")

    @contextmanager
    def agent(self, **rest: Any) -> Iterator[tuple[Agent, Manager]]:
        settings = {
            "enabled": True,
            "listen": "127.0.0.1:0",
            "tls_cert": str(self.pki.server_cert),
            "tls_key": str(self.pki.server_key),
            "tls_client_ca": str(self.pki.ca),
            "jwt_private_key": str(self.base / "jwt.key"),
            **rest,
        }
        with running_agent(self.base, rest=settings) as agent:
            yield agent, Manager(agent, self.pki, self.key)

    def close(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def lab() -> Iterator[Lab]:
    it = Lab()
    yield it
    it.close()


def raw(manager: Manager, method: str, path: str, body: str | None) -> Reply:
    """A request whatever its answer (Manager.__call__ insists on 200)."""
    headers = {"Authorization": f"Bearer {manager.token}", "Content-Type": "application/json"}
    return call(manager.base, method, path, body, headers, manager.ctx)


def go_node_policy(
    pid: str, node: str = NODE, regex: str = "", prio: int = 0, slice_ns: int = 0
) -> dict[str, Any]:
    """`dmrest.NodePolicy` as Go's encoder writes it: zero values are left out (`omitempty`)."""
    out: dict[str, Any] = {"policyID": pid, "nodeID": node}
    if regex:
        out["commandRegex"] = regex
    if prio:
        out["priority"] = prio
    if slice_ns:
        out["executionTime"] = slice_ns
    return out


def rows_by_policy(manager: Manager) -> list[dict[str, Any]]:
    return list(manager("GET", "/api/v1/node-intents")["policies"])


def cli_status(agent: Agent) -> str:
    """What `gthulhu-node status` prints (over the agent's gRPC socket)."""
    out = subprocess.run([str(GNODE), "status", "--socket", str(agent.config.api.socket)],
                         capture_output=True, text=True, timeout=60, check=True)
    return out.stdout


# -- what the Manager's UI produces never wedges the node ------------------------------------------------

def test_ui_defaults_are_accepted_reported_and_later_policies_flow(lab: Lab) -> None:
    """Each of these entries made the whole push a 400 before (so the Manager re-pushed it every 30 s and
    every later policy of the node was blocked): blank regex, priority 25, executionTime 10,000 ns and
    2 s, a duplicate policyID. Now: 200, what can be honoured is applied, the rest is failed with the
    reason in the push answer, the REST GET, `gthulhu-node status`, the journal and metrics, and the
    merkle root is the one the Manager computes from what it sent."""
    ok, blank, p25 = "665f1c2ab1d4e9a0c3b7f801", "665f1c2ab1d4e9a0c3b7f802", "665f1c2ab1d4e9a0c3b7f803"
    short, long, other = "665f1c2ab1d4e9a0c3b7f804", "665f1c2ab1d4e9a0c3b7f805", "665f1c2ab1d4e9a0c3b7f806"
    policies = [
        go_node_policy(ok, regex=f"^{ENGINE}$", prio=10, slice_ns=2_000_000),
        go_node_policy(blank),  # NodePoliciesPage.jsx defaults: commandRegex '', priority 0, executionTime 0
        go_node_policy(p25, regex="^p25$", prio=25),  # priority input: min="0", no max
        go_node_policy(short, regex="^short$", prio=1, slice_ns=10_000),
        go_node_policy(long, regex="^long$", slice_ns=2_000_000_000),
        go_node_policy(ok, regex="^again$", prio=3),  # the same policyID twice in one push
        go_node_policy(other, node="another-node"),  # blank regex, for another node
    ]
    work = Workload()
    try:
        engine_tid = work.spawn(ENGINE)
        with lab.agent() as (agent, manager), structlog.testing.capture_logs() as logs:
            body = json.dumps({"policies": policies}, separators=(",", ":"))
            push = raw(manager, "POST", "/api/v1/node-intents", body)
            assert push.status == 200 and push.body["success"] is True, push.body
            failed = {f["key"].partition("#")[0]: f["reason"] for f in push.body["data"]["failed"]}
            assert sorted(failed) == sorted([blank, p25, ok, other])
            assert push.body["data"]["accepted"] == 3

            # the Manager's own computation of the root, from what it sent: no re-push
            root = manager("GET", "/api/v1/node-intents/merkle")["rootHash"]
            assert root == shell_merkle(node_policy_rows(policies))

            wait_for("the good policy governs its thread",
                     lambda: engine_tid in tids(agent, f"manager/{ok}"))
            rows = rows_by_policy(manager)
            assert len(rows) == len(policies)  # every entry, as sent, in the Manager's order
            by_key = {(r["policyID"], r["commandRegex"]): r for r in rows}
            assert by_key[(ok, f"^{ENGINE}$")]["state"] == "applied"
            assert by_key[(blank, "")]["state"] == "failed"
            assert "upstream's Decision Maker skips" in by_key[(blank, "")]["reason"]
            assert by_key[(p25, "^p25$")]["state"] == "failed"
            assert "priority 25 is above 20" in by_key[(p25, "^p25$")]["reason"]
            assert any("clamped to 50000 ns" in w for w in by_key[(short, "^short$")]["warnings"])
            assert any("clamped to 1000000000 ns" in w for w in by_key[(long, "^long$")]["warnings"])
            assert by_key[(ok, "^again$")]["state"] == "failed"
            assert "duplicate policyID" in by_key[(ok, "^again$")]["reason"]
            assert by_key[(other, "")]["state"] == "failed"  # blank regex; and another node's name:
            assert any("another-node" in w for w in by_key[(other, "")]["warnings"])
            held = {i.id: i for i in agent.store.get("manager").intents}  # type: ignore[union-attr]
            assert held[short].execution_time == 50_000 and held[long].execution_time == 1_000_000_000

            shown = cli_status(agent)
            assert f"manager/{p25}#" in shown and "priority 25 is above 20" in shown
            assert f"manager/{blank}#" in shown and "commandRegex is empty" in shown
            # `apply --dry-run` compares a file with the running agent's intents: the failed entries
            # (unvalidated values) are shown in status but must not break it
            plan = lab.base / "plan.yaml"
            plan.write_text("id: plan\ncommandRegex: '^nothing$'\npriority: 1\n")
            dry = subprocess.run([str(GNODE), "apply", "-f", str(plan), "--dry-run", "--socket",
                                  str(agent.config.api.socket)], capture_output=True, text=True, timeout=60)
            assert dry.returncode == 0, dry.stderr
            assert agent.rest.stats().entries_failed == 4
            assert agent.stats().intents_by_state.get("failed", 0) >= 3
            assert any(e["event"] == "rest_entries_not_honoured" for e in logs)

            # a later policy is not blocked behind the failed ones
            later = [*policies, go_node_policy("665f1c2ab1d4e9a0c3b7f807", regex="^later$", prio=2)]
            assert manager("POST", "/api/v1/node-intents", {"policies": later})["accepted"] == 4
            assert manager("GET", "/api/v1/node-intents/merkle")["rootHash"] == shell_merkle(
                node_policy_rows(later)
            )
            # the 30 s re-push of the same set changes nothing
            assert manager("POST", "/api/v1/node-intents", {"policies": later})["changed"] is False
    finally:
        work.close()


def test_only_malformed_bodies_are_refused(lab: Lab) -> None:
    """What Go's decoder refuses upstream answers 400 to; so do we, naming the field, changing nothing.
    A body without `policies` empties the set (Go decodes it to a nil slice and ProcessNodePolicies
    stores it: api/decisionmaker/rest/node_policy_hdl.go, service/node_policy_svc.go)."""
    with lab.agent() as (agent, manager):
        manager("POST", "/api/v1/node-intents", {"policies": [go_node_policy("a" * 24, regex="^x$")]})
        for body, words in [("[]", "expected a JSON object"), ("{", "Invalid request payload"),
                            ('{"policies":{}}', "policies: expected a list"),
                            ('{"policies":[{"policyID":"b","priority":"5"}]}', "policies[0].priority"),
                            ('{"policies":[{"policyID":"b","executionTime":1.5}]}',
                             "policies[0].executionTime")]:
            reply = raw(manager, "POST", "/api/v1/node-intents", body)
            assert reply.status == 400 and words in reply.body["error"], (body, reply.body)
        assert [i.id for i in agent.store.get("manager").intents] == ["a" * 24]  # type: ignore[union-attr]
        assert manager("POST", "/api/v1/node-intents", {})["accepted"] == 0
        assert manager("GET", "/api/v1/node-intents/merkle")["rootHash"] == EMPTY_ROOT


# -- truthful after a restart ------------------------------------------------------------------------

def test_strategy_with_blank_regex_governs_the_pod_but_its_pause_container(lab: Lab) -> None:
    """StrategiesCard.jsx starts a strategy with `commandRegex: ''`; upstream's Decision Maker then matches
    every process of the pod whose comm is not "pause" (service/service.go resolveSchedulingIntents).
    Before: 400 `commandRegex is empty` for the whole push."""
    with pod_cgroups() as (uid_a, dir_a, _uid_b, _dir_b):
        pod = Workload(dir_a)
        try:
            worker, pause = pod.spawn(POD_WORKER), pod.spawn("pause")
            intents = [{"podName": "vllm-0", "podID": uid_a, "nodeID": NODE, "k8sNamespace": "ml",
                        "priority": 5, "podLabels": {"app": "vllm"}}]  # rest.Intent, omitempty
            with lab.agent() as (agent, manager):
                assert manager("POST", "/api/v1/intents", {"intents": intents})["accepted"] == 1
                (held,) = agent.store.get("manager-pods").intents  # type: ignore[union-attr]
                key = f"manager-pods/{held.id}"
                wait_for("the pod's worker governed", lambda: worker in tids(agent, key))
                assert pod.proc.pid in tids(agent, key)  # the process leader too
                assert pause not in tids(agent, key)

                def warned() -> bool:  # status is the status thread's projection: waited for, not read once
                    status = {s.key: s for s in agent.status("manager-pods").intents}
                    return key in status and any("every task of the pod but its pause container" in w
                                                 for w in status[key].warnings)

                wait_for("the intent's warning in status", warned)
                assert "every task of the pod but its pause container" in cli_status(agent)
                assert manager("GET", "/api/v1/intents/merkle")["rootHash"] == shell_merkle(
                    pod_intent_rows(intents)
                )
        finally:
            pod.close()


def test_restart_keeps_pod_intents_reported_and_a_missed_delete_is_cleaned_up(lab: Lab) -> None:
    """Before: pod records lived in memory only, so after a restart the pod root was sha256("") while the
    persisted pod intents were still applied; a strategy deleted while the agent was down (the Manager
    does not retry a DELETE) then looked clean to the Manager and was never removed."""
    with pod_cgroups() as (uid_a, dir_a, _uid_b, _dir_b):
        pod = Workload(dir_a)
        try:
            worker = pod.spawn(POD_WORKER)
            intents = [{"podName": "vllm-0", "podID": uid_a, "nodeID": NODE, "k8sNamespace": "ml",
                        "commandRegex": f"^{POD_WORKER}$", "priority": 5, "podLabels": {"app": "vllm"}}]
            with lab.agent() as (agent, manager):
                assert manager("POST", "/api/v1/intents", {"intents": intents})["accepted"] == 1
                (held,) = agent.store.get("manager-pods").intents  # type: ignore[union-attr]
                key = f"manager-pods/{held.id}"
                wait_for("the pod's worker governed", lambda: worker in tids(agent, key))
                expected = shell_merkle(pod_intent_rows(intents))
                assert manager("GET", "/api/v1/intents/merkle")["rootHash"] == expected
                listed = manager("GET", "/api/v1/intents")

            # restarted: the same root (it was sha256("") before), the same entries, applied again
            with lab.agent() as (agent, manager):
                assert manager("GET", "/api/v1/intents/merkle")["rootHash"] == expected
                again = manager("GET", "/api/v1/intents")
                assert again["rootHash"] == expected and again["intents"][0]["podID"] == uid_a
                assert [r["podName"] for r in again["intents"]] == [r["podName"] for r in listed["intents"]]
                wait_for("governed after the restart", lambda: worker in tids(agent, key))

            # while the agent is down the strategy is deleted; the DELETE never arrives. After the restart
            # the Manager sees a root that is not the empty one it expects and clears the node.
            with lab.agent() as (agent, manager):
                root = manager("GET", "/api/v1/intents/merkle")["rootHash"]
                assert root != EMPTY_ROOT  # what makes the Manager act (cron_svc.go resyncIntentsToDMs)
                manager("DELETE", "/api/v1/intents", {"all": True})
                wait_for("the stale pod intent is gone",
                         lambda: worker not in {m.tid for m in agent.matches()})
                assert manager("GET", "/api/v1/intents/merkle")["rootHash"] == EMPTY_ROOT
        finally:
            pod.close()


def test_node_policies_dropped_when_the_manager_checks_only_pod_intents(lab: Lab) -> None:
    """All node policies deleted while the agent was down: the Manager then holds no node intent anywhere
    and skips every node check (cron_svc.go resyncNodeIntentsToDMs returns early), but still checks pod
    intents every cycle. Held node policies would stay applied forever; they are dropped, loudly."""
    policies = [go_node_policy("c" * 24, regex=f"^{ENGINE}$", prio=4)]
    with lab.agent() as (agent, manager):
        manager("POST", "/api/v1/node-intents", {"policies": policies})
    with lab.agent(node_policy_silence_s=1.0) as (agent, manager), structlog.testing.capture_logs() as logs:
        assert manager("GET", "/api/v1/node-intents")["policies"][0]["policyID"] == "c" * 24  # persisted
        manager("GET", "/api/v1/intents/merkle")  # cycle 1: pod check only
        time.sleep(1.2)
        manager("GET", "/api/v1/intents/merkle")  # cycle 2: still no node check
        assert manager("GET", "/api/v1/node-intents")["policies"] == []
        assert agent.rest.stats().node_policies_expired == 1
        assert any(e["event"] == "rest_node_policies_expired" for e in logs)
    with lab.agent() as (agent, manager):  # and it stays dropped
        assert manager("GET", "/api/v1/node-intents/merkle")["rootHash"] == EMPTY_ROOT


# -- the other endpoints the Manager calls ---------------------------------------------------------------

def test_metrics_runtime_config_pods_and_version(lab: Lab) -> None:
    with pod_cgroups() as (uid_a, dir_a, _uid_b, _dir_b):
        pod = Workload(dir_a)
        try:
            worker = pod.spawn(POD_WORKER)
            intent = {"podName": "vllm-0", "podID": uid_a, "nodeID": NODE, "k8sNamespace": "ml",
                      "commandRegex": f"^{POD_WORKER}$", "priority": 5}
            runtime = {"configVersion": "v7", "mode": "gthulhu", "sliceNsDefault": 20_000_000,
                       "sliceNsMin": 500_000, "kernelMode": True, "schedulerEnabled": True,
                       "monitoringEnabled": True}  # runtime_config_handler.go ApplyRuntimeConfigRequest
            with lab.agent(runtime_config_allow=["sliceNsDefault"]) as (agent, manager):
                manager("POST", "/api/v1/intents", {"intents": [intent]})
                wait_for("worker governed", lambda: worker in {m.tid for m in agent.matches()})

                # /metrics: what deicison_maker_metrics.go scrapes, over the same mTLS
                text = call(manager.base, "GET", "/metrics", None, {}, manager.ctx).body
                labels = f'namespace="ml",node_name="{NODE}",pod_name="vllm-0",pod_uid="{uid_a}"'
                assert f"gthulhu_pod_process_count{{{labels}}} 1.0" in text
                assert f"gthulhu_pod_wait_time_nanoseconds_total{{{labels}}}" in text
                assert f"gthulhu_pod_cpu_migrations_total{{{labels}}}" in text  # se.nr_migrations
                with pytest.raises(OSError):  # no client certificate, no TLS, no metrics
                    call(manager.base, "GET", "/metrics", None, {}, client_context(lab.pki, with_cert=False))

                data = manager("POST", "/api/v1/runtime-config", runtime)
                assert data["pendingReload"] == ["sliceNsDefault"]
                assert set(data["notApplicable"]) == {"mode", "sliceNsMin", "kernelMode", "schedulerEnabled",
                                                      "monitoringEnabled"}
                assert manager("GET", "/api/v1/runtime-config")["configVersion"] == "v7"
                assert any("sliceNsDefault" in n for s in agent.status("manager").sources for n in s.notes)
                again = manager("POST", "/api/v1/runtime-config", runtime)  # every cycle: no change
                assert again["pendingReload"] == ["sliceNsDefault"]

                pods = manager("GET", "/api/v1/pods/pids")
                mine = [p for p in pods["pods"] if p["pod_uid"] == uid_a]
                assert mine and pod.proc.pid in {q["pid"] for q in mine[0]["processes"]}
                assert pods["node_name"] == NODE

                version = call(manager.base, "GET", "/version", None, {}, manager.ctx)
                assert version.status == 200 and version.body["version"]
            with lab.agent(runtime_config_allow=["sliceNsDefault"]) as (agent, _manager):
                assert agent.config.scheduler.default_slice_ns == 20_000_000  # applied at the next load
            with lab.agent() as (agent, _manager):  # not allowed any more: the node's own setting
                assert agent.config.scheduler.default_slice_ns == 5_000_000
        finally:
            pod.close()
