"""Contract test: a real agent process driven through the Manager's reconcile cycle, as upstream runs it.

The cycle follows Gthulhu/Gthulhu@c969a96b10cb551b28e2f4a8320b803d62fe3f9b (v1.3.0 plus two commits):
api/manager/service/cron_svc.go every 30 s (resyncIntentsToDMs: the pod-intent root, re-push on a
mismatch; resyncRuntimeConfigsToDMs: the runtime config, posted every cycle; resyncNodeIntentsToDMs: the
node-policy root when node intents exist, re-push on a mismatch), api/manager/client/deicison_maker.go (a
token request before every call, client id "manager-client") and deicison_maker_metrics.go (`/metrics`
every 10 s). Here the intervals are shortened to back-to-back cycles. The Manager's expected roots are
computed with bash + sha256sum from what it sends (tests/unit/rest_support.py).

Real parts: `gthulhu-node run` as its own process (dry-run backend), its REST listener on a loopback
socket (mutual TLS, or plain HTTP in the insecure mode), its journal (JSON lines), its state directory
across restarts, real threads in a real (test-made) pod cgroup, `gthulhu-node status` over its socket.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.host.agent_support import REPO, AgentProcess, wait_for, write_config
from tests.host.test_manager_contract import Lab
from tests.host.test_rest_agent import POD_WORKER, TAG, Workload, pod_cgroups
from tests.unit.rest_support import (
    Reply,
    call,
    client_context,
    node_policy_rows,
    pod_intent_rows,
    public_pem,
    shell_merkle,
)

pytestmark = pytest.mark.host

NODE = "test-node"  # what the agent calls itself (agent_support.config_dict)
K8S_NODE = "k8s-worker-1"  # what the Manager calls it
GNODE = REPO / ".venv" / "bin" / "gthulhu-node"
ENGINE, OTHER = f"Cyc{TAG}_eng", f"Cyc{TAG}_oth"
POLICY_IDS = [f"66{i:022x}" for i in range(10)]


@dataclass
class Cycle:
    """What one reconcile cycle saw."""

    pod_pushes: int = 0
    node_pushes: int = 0
    replies: list[Reply] = field(default_factory=list)
    metrics: str = ""
    runtime: dict[str, Any] = field(default_factory=dict)

    @property
    def pushes(self) -> int:
        return self.pod_pushes + self.node_pushes


class StandInManager:
    """Upstream's Manager towards one Decision Maker: the sets it holds for this node and its cycle."""

    def __init__(self, base: str, ctx: Any, key: Any) -> None:
        self.base, self.ctx, self.key = base, ctx, key
        self.policies: list[dict[str, Any]] = []
        self.pod_intents: list[dict[str, Any]] = []
        self.runtime: dict[str, Any] = {}

    def call(self, method: str, path: str, body: Any = None) -> Reply:
        """A token first, then the call (deicison_maker.go does both for every request)."""
        token = call(self.base, "POST", "/api/v1/auth/token",
                     json.dumps({"public_key": public_pem(self.key), "client_id": "manager-client"}),
                     {"Content-Type": "application/json"}, self.ctx)
        if token.status != 200:
            return token
        headers = {"Authorization": f"Bearer {token.body['data']['token']}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        data = json.dumps(body) if body is not None else None
        return call(self.base, method, path, data, headers, self.ctx)

    def cycle(self) -> Cycle:
        seen = Cycle()
        pod_root = self.call("GET", "/api/v1/intents/merkle")
        seen.replies.append(pod_root)
        if not _root_is(pod_root, shell_merkle(pod_intent_rows(self.pod_intents))):
            seen.replies.append(self.call("POST", "/api/v1/intents", {"intents": self.pod_intents}))
            seen.pod_pushes += 1
        if self.runtime:
            posted = self.call("POST", "/api/v1/runtime-config", self.runtime)
            seen.replies.append(posted)
            seen.runtime = posted.body.get("data", {}) if isinstance(posted.body, dict) else {}
        if self.policies:
            node_root = self.call("GET", "/api/v1/node-intents/merkle")
            seen.replies.append(node_root)
            if not _root_is(node_root, shell_merkle(node_policy_rows(self.policies))):
                seen.replies.append(self.call("POST", "/api/v1/node-intents", {"policies": self.policies}))
                seen.node_pushes += 1
        scrape = call(self.base, "GET", "/metrics", None, {}, self.ctx)
        seen.replies.append(scrape)
        seen.metrics = scrape.body if isinstance(scrape.body, str) else ""
        return seen

    def cycles(self, n: int) -> list[Cycle]:
        return [self.cycle() for _ in range(n)]


def _root_is(reply: Reply, expected: str) -> bool:
    return reply.status == 200 and reply.body["data"]["rootHash"] == expected


class Node(Lab):
    """One node's directory (state, keys, certificates) that agent processes are started on in turn."""

    @contextmanager
    def running(self, *, plain: bool = False, api: dict[str, Any] | None = None,
                **rest: Any) -> Iterator[AgentProcess]:
        settings: dict[str, Any] = {"enabled": True, "listen": "127.0.0.1:0",
                                    "jwt_private_key": str(self.base / "jwt.key"), **rest}
        if plain:
            settings["insecure_allow_plain_http"] = True
        else:
            settings.update(tls_cert=str(self.pki.server_cert), tls_key=str(self.pki.server_key),
                            tls_client_ca=str(self.pki.ca))
        config = write_config(self.base, rest=settings, metrics={"listen": "127.0.0.1:0"},
                              watch={"rescan_interval_s": 0.5}, **({"api": api} if api else {}))
        agent = AgentProcess(config, self.base / "run" / "api.sock")
        agent.start()
        try:
            yield agent
        finally:
            agent.signal(signal.SIGTERM)
            agent.stop()

    def log_lines(self) -> list[dict[str, Any]]:
        path = self.base / "agent.log"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def listening(self, event: str) -> str:
        """The address the last started agent logged for `event` (it listens on port 0)."""
        return [e["listen"] for e in self.log_lines() if e.get("event") == event][-1]

    def manager(self, *, plain: bool = False) -> StandInManager:
        host, _, port = self.listening("rest_listening").rpartition(":")
        if plain:
            return StandInManager(f"http://{host}:{port}", None, self.key)
        return StandInManager(f"https://localhost:{port}", client_context(self.pki), self.key)

    def own_metrics(self) -> str:
        reply = call(f"http://{self.listening('metrics_listening')}", "GET", "/metrics")
        return reply.body if isinstance(reply.body, str) else ""

    def status(self) -> str:
        out = subprocess.run([str(GNODE), "status", "--socket", str(self.base / "run" / "api.sock")],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout


@pytest.fixture
def node() -> Iterator[Node]:
    it = Node()
    yield it
    it.close()


# -- items 2, 5, 6: nothing the Manager can send starts a re-push loop or applies silently nothing -------
# One agent process for these cases (each test pushes its own set; the limit per source is 5 here).

LIMIT = 5


@dataclass
class Deployed:
    node: Node
    manager: StandInManager
    pod_uid: str


@pytest.fixture(scope="module")
def deployed() -> Iterator[Deployed]:
    node = Node()
    try:
        with pod_cgroups() as (uid, pod_dir, _uid_b, _dir_b):
            pod, host = Workload(pod_dir), Workload()
            try:
                host.spawn(ENGINE)
                host.spawn(OTHER)
                pod.spawn(POD_WORKER)
                with node.running(api={"max_intents_per_source": LIMIT}):
                    manager = node.manager()
                    manager.pod_intents = [{"podName": "vllm-0", "podID": uid, "nodeID": K8S_NODE,
                                            "k8sNamespace": "ml", "commandRegex": f"^{POD_WORKER}$",
                                            "priority": 5}]
                    yield Deployed(node, manager, uid)
            finally:
                pod.close()
                host.close()
    finally:
        node.close()


def node_pushes(deployed: Deployed, policies: list[dict[str, Any]], cycles: int = 3) -> list[int]:
    """The node-policy pushes of each of `cycles` cycles once the Manager holds `policies` (every call
    answered 200)."""
    deployed.manager.policies = policies
    out = []
    for _ in range(cycles):
        seen = deployed.manager.cycle()
        bad = [(r.status, r.body) for r in seen.replies if r.status != 200]
        assert not bad, bad[:2]
        out.append(seen.node_pushes)
    return out


def entry_rows(deployed: Deployed) -> list[dict[str, Any]]:
    reply = deployed.manager.call("GET", "/api/v1/node-intents")
    assert reply.status == 200, reply.body
    return list(reply.body["data"]["policies"])


def governs(deployed: Deployed, policy_id: str, what: str) -> None:
    def applied() -> bool:
        row = next(r for r in entry_rows(deployed) if r["policyID"] == policy_id)
        return row.get("state") == "applied" and row.get("matchedTasks") == 1
    wait_for(applied, timeout=30, what=what)


def test_cycle_long_regex_is_applied_without_a_repush_loop(deployed: Deployed) -> None:
    """Before: a commandRegex over 4,096 characters (upstream applies it) made the whole push a 400: the
    Manager re-pushed every cycle and nothing of the node applied."""
    long_regex = f"^{ENGINE}$|" + "|".join(f"^nothing{i:05d}$" for i in range(400))
    assert len(long_regex) > 4096
    policies = [{"policyID": POLICY_IDS[0], "nodeID": NODE, "commandRegex": long_regex, "priority": 10}]
    assert node_pushes(deployed, policies) == [1, 0, 0]
    governs(deployed, POLICY_IDS[0], "the 4,300-character pattern governs its thread")
    assert f"manager/{POLICY_IDS[0]}" in deployed.node.status()
    # `apply --dry-run` compares a plan with the running intents: the long pattern is one of them (the
    # CLI read it back with the local files' 256-byte limit and left it out)
    plan = deployed.node.base / "plan.yaml"
    plan.write_text(f"id: plan\ncommandRegex: '^{ENGINE}$'\npriority: 1\n")
    socket = str(deployed.node.base / "run" / "api.sock")
    dry = subprocess.run([str(GNODE), "apply", "-f", str(plan), "--dry-run", "--socket", socket],
                         capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0 and "compared with 2 intents of the running agent" in dry.stdout, dry.stdout


def test_cycle_unusable_entries_fail_with_their_reason_without_a_repush_loop(deployed: Deployed) -> None:
    """Before: a name over 253 characters made the whole push a 400 (re-pushed every cycle). Now each
    unusable entry is failed with its reason, over REST and in status, and the root is the Manager's."""
    policies = [
        {"policyID": POLICY_IDS[1], "nodeID": NODE, "commandRegex": f"^{ENGINE}$", "priority": 3},
        {"policyID": POLICY_IDS[2], "nodeID": NODE, "commandRegex": r"\pL{1000}", "priority": 2},
        {"policyID": "p" * 300, "nodeID": NODE, "commandRegex": "^y$"},
        {"policyID": POLICY_IDS[4], "nodeID": NODE},  # the UI's default: blank regex
    ]
    assert node_pushes(deployed, policies) == [1, 0, 0]
    failed = {r["policyID"][:24]: r["reason"] for r in entry_rows(deployed) if r.get("state") == "failed"}
    assert "pattern too large" in failed[POLICY_IDS[2]]  # RE2's own memory bound, not a length of ours
    assert "policyID is 300 characters" in failed["p" * 24]
    assert "commandRegex is empty" in failed[POLICY_IDS[4]]
    shown = deployed.node.status()
    assert "pattern too large" in shown and "policyID is 300 characters" in shown
    governs(deployed, POLICY_IDS[1], "the usable entry governs its thread")


def test_cycle_more_entries_than_the_limit_without_a_repush_loop(deployed: Deployed) -> None:
    """Before: more entries than api.max_intents_per_source made the whole push a 400, every cycle."""
    policies = [{"policyID": POLICY_IDS[i], "nodeID": NODE, "commandRegex": f"^z{i}$"} for i in range(LIMIT)]
    policies.append({"policyID": POLICY_IDS[LIMIT], "nodeID": NODE, "commandRegex": f"^{ENGINE}$"})
    policies.append({"policyID": POLICY_IDS[LIMIT + 1], "nodeID": NODE, "commandRegex": "^z9$"})
    assert node_pushes(deployed, policies) == [1, 0, 0]
    rows = entry_rows(deployed)
    over = [r for r in rows if "api.max_intents_per_source" in r.get("reason", "")]
    assert [r["policyID"] for r in over] == [POLICY_IDS[LIMIT], POLICY_IDS[LIMIT + 1]]  # last in merkle order
    assert sum(r.get("state") != "failed" for r in rows) == LIMIT


def test_cycle_intents_for_the_kubernetes_node_name_apply_with_a_warning(deployed: Deployed) -> None:
    """Before: an entry naming the node as Kubernetes does (not as the agent calls itself) applied nothing,
    while the roots matched and the Manager showed it as sent; the journal alone said so."""
    policies = [{"policyID": POLICY_IDS[6], "nodeID": K8S_NODE, "commandRegex": f"^{OTHER}$", "priority": 3}]
    assert node_pushes(deployed, policies) == [1, 0, 0]
    governs(deployed, POLICY_IDS[6], "the Manager's choice of node applies")
    shown = deployed.node.status()
    assert K8S_NODE in shown and "applied all the same" in shown
    # both manager sources hold one such entry (the pod intent names the node as Kubernetes does too)
    assert "gthulhu_node_rest_node_name_mismatch_entries 2.0" in deployed.node.own_metrics()


def test_cycle_the_same_set_in_another_order_is_no_change(deployed: Deployed) -> None:
    """Before: a failed entry's key held its position, so the Manager's database handing the same set back
    in another order was a change (a new generation, a rebuilt policy)."""
    policies = [
        {"policyID": POLICY_IDS[7], "nodeID": NODE, "commandRegex": f"^{ENGINE}$", "priority": 2},
        {"policyID": POLICY_IDS[8], "nodeID": NODE},  # failed: blank regex
        {"policyID": POLICY_IDS[9], "nodeID": NODE, "commandRegex": "^q$", "priority": 25},  # failed
    ]
    assert node_pushes(deployed, policies, cycles=1) == [1]
    again = deployed.manager.call("POST", "/api/v1/node-intents", {"policies": policies[::-1]})
    assert again.status == 200 and again.body["data"]["changed"] is False, again.body


def matches_of(deployed: Deployed) -> dict[str, str]:
    """comm -> the key of the intent governing it, as `gthulhu-node matches` shows (the real agent's)."""
    socket = str(deployed.node.base / "run" / "api.sock")
    out = subprocess.run([str(GNODE), "matches", "-o", "json", "--socket", socket],
                         capture_output=True, text=True, timeout=60, check=True)
    return {m["comm"]: m["intent"] for m in json.loads(out.stdout)["matches"]}


def test_cycle_priority_runs_upstreams_way(deployed: Deployed) -> None:
    """Issue 39, item 1: a Manager user's "engine 1, tokenizer 10" makes the engine the stronger, as
    upstream's kernel mode does (lower number stronger). Here the tokenizer's pattern also matches the
    engine's thread, so exactly one of the two governs it: before, the higher number won (the tokenizer's
    10), and the engine's own policy matched nothing. A policy at 0 applies as slice-only with a note that
    upstream's kernel mode would have made it the strongest, over REST and in `gthulhu-node status`."""
    engine, tokenizer, zero = (f"67{i:022x}" for i in range(3))
    policies = [
        {"policyID": engine, "nodeID": NODE, "commandRegex": f"^{ENGINE}$", "priority": 1},
        {"policyID": tokenizer, "nodeID": NODE, "commandRegex": f"^({ENGINE}|{OTHER})$", "priority": 10},
        {"policyID": zero, "nodeID": NODE, "commandRegex": "^nothing-here$", "priority": 0,
         "executionTime": 2_000_000},
    ]
    assert node_pushes(deployed, policies) == [1, 0, 0]
    governs(deployed, engine, "the engine's policy (priority 1) governs the engine thread")
    governs(deployed, tokenizer, "the tokenizer's policy governs the other thread only")
    got = matches_of(deployed)
    assert got.get(ENGINE) == f"manager/{engine}" and got.get(OTHER) == f"manager/{tokenizer}", got
    row = next(r for r in entry_rows(deployed) if r["policyID"] == zero)
    assert any("kernel mode" in w and "strongest" in w for w in row["warnings"]), row
    assert "upstream's kernel mode" in deployed.node.status()


def test_cycle_metrics_scrape_has_the_pods_cpu_migrations(deployed: Deployed) -> None:
    """Before: no gthulhu_pod_cpu_migrations_total in the /metrics the Manager scrapes."""
    labels = f'namespace="ml",node_name="{K8S_NODE}",pod_name="vllm-0",pod_uid="{deployed.pod_uid}"'
    wait_for(lambda: f"gthulhu_pod_cpu_migrations_total{{{labels}}}" in deployed.manager.cycle().metrics,
             timeout=20, what="the pod's migrations in the Manager's /metrics scrape")


def test_cycle_tokens_are_logged_at_info_once_per_client(deployed: Deployed) -> None:
    """Before: one rest_token_issued line at info per Manager call (about 3 per 30 s cycle). Runs after
    the cases above: all their calls together wrote one line at info."""
    deployed.manager.cycle()
    issued = [e for e in deployed.node.log_lines() if e.get("event") == "rest_token_issued"]
    assert [e.get("level") for e in issued] == ["info"], issued[:3]  # the rest at debug (not written)


# -- item 3: upstream's default deployment (mTLS off) ---------------------------------------------------

def test_cycle_of_a_manager_without_mtls(node: Node) -> None:
    """Before: a Manager with upstream's Helm default (mtls.enabled: false) speaking plain HTTP to the TLS
    port got an empty reply on every call, and neither log said why. Now every call gets a 400 naming the
    settings, the agent logs it once per peer; in the plain mode (the agent's insecure setting) the cycle
    works and status shows the insecure mode."""
    policies = [{"policyID": POLICY_IDS[0], "nodeID": NODE, "commandRegex": "^w$", "priority": 4}]
    with node.running():
        manager = node.manager(plain=True)  # http:// to the TLS port, no client certificate
        manager.policies = policies
        seen = manager.cycles(3)
        for reply in (r for c in seen for r in c.replies):
            assert reply.status == 400, reply.body
            assert "mtls.enabled: true" in reply.body["error"]
            assert "rest.insecure_allow_plain_http: true" in reply.body["error"]
    told = [e for e in node.log_lines() if e.get("event") == "rest_plain_http_on_tls_port"]
    assert len(told) == 1 and told[0]["level"] == "warning" and told[0]["peer"] == "127.0.0.1"

    with node.running(plain=True):  # docs/kubernetes.md: listen on the pod IP, NetworkPolicy
        manager = node.manager(plain=True)
        manager.policies = policies
        assert [c.pushes for c in manager.cycles(2)] == [1, 0]
        shown = node.status()
        assert "serves plain HTTP without client certificates" in shown
        assert "gthulhu_node_rest_insecure 1.0" in node.own_metrics()


# -- item 4: the runtime config the Manager posts every cycle ------------------------------------------

def test_cycle_runtime_config_is_the_truth_across_a_restart(node: Node) -> None:
    """Before: `applied: false` for everything accepted (the Manager's status page showed drift on every
    node), and after a restart `configAvailable: false` until the Manager posted again; no restartCount
    nor lastError. Now `applied` says whether the agent runs with it, kept across restarts."""
    runtime = {"configVersion": "v7", "mode": "gthulhu", "sliceNsDefault": 20_000_000, "sliceNsMin": 500_000,
               "kernelMode": True, "schedulerEnabled": True, "monitoringEnabled": True}
    with node.running():  # nothing allowed (the default): nothing of it applies here, nothing waits
        manager = node.manager()
        manager.runtime = runtime
        first = manager.cycles(2)
        assert all(c.runtime["applied"] is True for c in first), first[0].runtime
        assert first[0].runtime["restartCount"] == 0 and first[0].runtime["lastError"] == ""
    with node.running(runtime_config_allow=["sliceNsDefault"]):
        manager = node.manager()
        manager.runtime = runtime
        seen = manager.cycle().runtime
        assert seen["applied"] is False and seen["pendingReload"] == ["sliceNsDefault"]  # loaded at start
        bad = manager.call("POST", "/api/v1/runtime-config", {**runtime, "sliceNsDefault": 10}).body["data"]
        assert "outside" in bad["lastError"]
        manager.cycle()
    with node.running(runtime_config_allow=["sliceNsDefault"]):
        manager = node.manager()
        now = manager.call("GET", "/api/v1/runtime-config").body["data"]  # before the Manager posts again
        assert now["configAvailable"] is True and now["configVersion"] == "v7"
        assert now["applied"] is True and now["inEffect"] == {"sliceNsDefault": 20_000_000}
        assert now["restartCount"] == 1 and now["lastError"] == ""
        manager.runtime = runtime
        assert manager.cycle().runtime["applied"] is True
