"""`GET /api/v1/explain` in the real agent's REST listener: served under mutual TLS with the Explain
RPC's answer (comm, owner, cgroup, exe, every intent), refused with a clear 403 on a plain-HTTP listener
(it shows who runs what)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from gthulhu_node.rest.private_views import PRIVATE_VIEW_REFUSAL
from tests.host.agent_support import NamedThread, running_agent, short_dir, wait_for
from tests.host.test_rest_agent import agent_with_rest
from tests.unit.rest_support import call, public_pem, write_rsa_key

pytestmark = pytest.mark.host


def test_explain_over_mtls() -> None:
    with agent_with_rest() as (agent, manager), NamedThread("gn-rx-eng") as t:
        manager("POST", "/api/v1/node-intents", {"policies": [
            {"policyID": "p1", "nodeID": "test-node", "commandRegex": "^gn-rx-eng$", "priority": 7,
             "executionTime": 0}]})
        agent.sync()
        wait_for(lambda: any(m.tid == t.tid for m in agent.matches()), what="the thread matched")
        data = manager("GET", f"/api/v1/explain?tid={t.tid}")
        (thread,) = data["threads"]
        assert thread["comm"] == "gn-rx-eng" and thread["tgid"] == os.getpid()
        assert thread["exe"] == os.readlink(f"/proc/{os.getpid()}/exe") and thread["cgroup"]
        assert thread["uid"] == os.getuid() and thread["ownerKnown"]  # uid 0 shown, not left out
        assert thread["winner"].startswith("manager/") and thread["agentWinner"] == thread["winner"]
        # what the kernel did with it lately (schedstat), and the probe's absence, in words
        assert thread["schedstatNote"] == "" and thread["recent"]["seconds"] >= 0.5
        assert int(thread["sinceStart"]["timeslices"]) > 0
        assert thread["probeNote"] == "not running: probe.enabled is false" and thread["agentBoost"] == ""
        by_key = {i["intent"]: i for i in thread["intents"]}
        assert by_key["local/local-engine"]["field"] == "commandRegex"
        by_comm = manager("GET", "/api/v1/explain?comm=^gn-rx-")
        assert [x["tid"] for x in by_comm["threads"]] == [t.tid]
        bad = call(manager.base, "GET", "/api/v1/explain?tid=x",
                   headers={"Authorization": f"Bearer {manager.token}"}, ctx=manager.ctx)
        assert bad.status == 400 and "numbers" in bad.body["error"]
        gone = call(manager.base, "GET", "/api/v1/explain?tid=4194303",
                    headers={"Authorization": f"Bearer {manager.token}"}, ctx=manager.ctx)
        assert gone.status == 404 and "no task" in gone.body["error"]
        anonymous = call(manager.base, "GET", f"/api/v1/explain?tid={t.tid}", ctx=manager.ctx)
        assert anonymous.status == 401
        # a preview of a push that would give the thread to another policy, and one entry it cannot honour
        held = agent.store.snapshot()
        preview = manager("POST", "/api/v1/preview", {"policies": [
            {"policyID": "p2", "nodeID": "test-node", "commandRegex": "^gn-rx-eng$", "priority": 9,
             "executionTime": 0},
            {"policyID": "p3", "nodeID": "test-node", "commandRegex": "(", "priority": 1,
             "executionTime": 0}]})
        (row,) = preview["matches"]
        assert row["tid"] == t.tid and row["intent"].startswith("manager/")
        assert row["intent"] != thread["winner"]
        assert [f["key"] for f in preview["failed"]] and preview["displaced"] == []  # its own source
        assert agent.store.snapshot() == held


def test_explain_refused_on_plain_http() -> None:
    base = short_dir()
    try:
        key = write_rsa_key(base / "jwt.key")
        rest = {"enabled": True, "listen": "127.0.0.1:0", "insecure_allow_plain_http": True,
                "jwt_private_key": str(base / "jwt.key")}
        with running_agent(base, rest=rest) as agent:
            url = f"http://127.0.0.1:{agent.rest.port}" if agent.rest else ""
            token = call(url, "POST", "/api/v1/auth/token",
                         json.dumps({"public_key": public_pem(key), "client_id": "ui"}),
                         {"Content-Type": "application/json"}).body["data"]["token"]
            reply = call(url, "GET", f"/api/v1/explain?pid={os.getpid()}",
                         headers={"Authorization": f"Bearer {token}"})
            refusal = {"success": False,
                       "error": f"{PRIVATE_VIEW_REFUSAL} (rest.insecure_allow_plain_http is set)"}
            assert (reply.status, reply.body) == (403, refusal)
            body = json.dumps({"policies": [{"policyID": "p", "nodeID": "test-node", "commandRegex": "^x$",
                                             "priority": 1, "executionTime": 0}]})
            reply = call(url, "POST", "/api/v1/preview", body,
                         {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            assert (reply.status, reply.body) == (403, refusal)
    finally:
        shutil.rmtree(base, ignore_errors=True)


