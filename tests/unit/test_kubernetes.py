"""The Kubernetes manifests (deploy/kubernetes/), offline: every document validates against the Kubernetes
schema (kubernetes-validate, strict: an unknown or misspelt field fails), and the parts that make them
work with gthulhu-node are there: the Manager's discovery (app=decisionmaker, the REST port first, host
network), the privileged agent's host namespaces and mounts, and a ConfigMap the agent accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gthulhu_node.config import AgentConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
MANIFESTS = sorted(DEPLOY.glob("*.yaml"))
# The oldest Kubernetes release still supported upstream when these were written, and the newest the
# validator knows: the manifests must hold for both.
VERSIONS = ("1.32.0", kubernetes_validate.utils.latest_version())


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def by_kind(path: Path, kind: str) -> dict[str, Any]:
    return next(d for d in documents(path) if d["kind"] == kind)


def test_manifests_exist() -> None:
    assert [p.name for p in MANIFESTS] == ["agent-daemonset.yaml", "agent-plain-http.yaml",
                                           "decisionmaker-daemonset.yaml"]


def test_plain_http_mode_listens_on_the_pod_ip_and_admits_only_the_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Upstream's Helm default (mtls.enabled: false): the agent in the insecure mode, on the pod's IP
    (never 0.0.0.0), and a NetworkPolicy that lets only the Manager's pods reach the REST port."""
    path = DEPLOY / "agent-plain-http.yaml"
    config = yaml.safe_load(by_kind(path, "ConfigMap")["data"]["config.yaml"])
    monkeypatch.setenv("POD_IP", "10.42.0.7")
    agent = AgentConfig.model_validate(config)
    assert agent.rest.insecure_allow_plain_http and agent.rest.listen == "10.42.0.7:8080"
    monkeypatch.delenv("POD_IP")
    with pytest.raises(ValueError, match="POD_IP"):
        AgentConfig.model_validate(config)
    ds = by_kind(DEPLOY / "agent-daemonset.yaml", "DaemonSet")
    env = ds["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in env
    policy = by_kind(path, "NetworkPolicy")["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    rest_rule = next(r for r in policy["ingress"] if {"protocol": "TCP", "port": 8080} in r["ports"])
    assert rest_rule["from"] and all("podSelector" in peer for peer in rest_rule["from"])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_valid_against_the_kubernetes_schema(path: Path, version: str) -> None:
    for doc in documents(path):
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_a_misspelt_field_is_caught() -> None:
    """The check is strict: the same DaemonSet with one field misspelt does not pass."""
    doc = by_kind(DEPLOY / "agent-daemonset.yaml", "DaemonSet")
    doc["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)


def _port(spec: dict[str, Any]) -> int:
    return int(spec["containers"][0]["ports"][0]["containerPort"])


def test_decision_maker_daemonset_is_what_the_manager_discovers() -> None:
    ds = by_kind(DEPLOY / "decisionmaker-daemonset.yaml", "DaemonSet")
    template = ds["spec"]["template"]
    assert template["metadata"]["labels"]["app"] == "decisionmaker"
    assert ds["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    spec = template["spec"]
    assert spec["hostNetwork"] is True and _port(spec) == 8080
    assert spec["nodeSelector"] == {"gthulhu.io/node-agent": "host"}


def test_agent_daemonset_has_the_host_access_the_agent_needs() -> None:
    path = DEPLOY / "agent-daemonset.yaml"
    ds = by_kind(path, "DaemonSet")
    template = ds["spec"]["template"]
    spec = template["spec"]
    container = spec["containers"][0]
    assert spec["hostPID"] is True and spec["hostNetwork"] is True
    assert container["securityContext"]["privileged"] is True
    # the host's cgroup namespace: joined before the agent starts
    assert container["command"][:3] == ["nsenter", "--cgroup=/proc/1/ns/cgroup", "--"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    host_paths = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    for needed in ("/sys/fs/bpf", "/sys/kernel/btf", "/sys/kernel/sched_ext", "/var/lib/gthulhu-node"):
        assert host_paths[mounts[needed]] == needed, needed
    node_name = {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
    assert node_name in container["env"]
    # discovered by the Manager directly, on the port the agent's REST listener uses
    assert template["metadata"]["labels"]["app"] == "decisionmaker"
    config = yaml.safe_load(by_kind(path, "ConfigMap")["data"]["config.yaml"])
    agent = AgentConfig.model_validate(config)
    assert agent.rest.enabled and agent.rest.listen.endswith(f":{_port(spec)}")
    assert agent.metrics.listen.endswith(":9812")
    assert agent.state.directory == Path("/var/lib/gthulhu-node")
