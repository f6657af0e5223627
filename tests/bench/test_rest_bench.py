"""How long a Manager push takes end to end over mutual TLS, against the same work done in-process.

Baseline (same run): translating the Manager's JSON into intents and storing them (validation, RE2
compilation, atomic persist) without HTTP. Measured: the full exchange the Manager makes (token, push,
merkle check) over a real TLS socket. The ratio shows what the transport and auth add.
Run: `.venv/bin/python -m pytest -m bench -s tests/bench/test_rest_bench.py`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import pytest

from gthulhu_node.config import RestConfig
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.rest import RestServer
from gthulhu_node.rest.translate import node_policies
from tests.unit.rest_support import call, client_context, make_pki, public_pem, write_rsa_key

pytestmark = pytest.mark.bench
ROUNDS = 5


def body(n: int, salt: int) -> dict[str, Any]:
    return {"policies": [
        {"policyID": f"{salt:08x}{i:016x}", "nodeID": "bench-node", "commandRegex": f"^worker-{i}(_[0-9]+)?$",
         "priority": 1 + i % 20, "executionTime": 1_000_000 + i}
        for i in range(n)
    ]}


@pytest.mark.parametrize("n", [1, 1000, 10_000])
def test_push_latency(tmp_path: Path, n: int) -> None:
    key = write_rsa_key(tmp_path / "jwt.key")
    pki = make_pki(tmp_path)
    cfg = RestConfig(enabled=True, listen="127.0.0.1:0", tls_cert=pki.server_cert, tls_key=pki.server_key,
                     tls_client_ca=pki.ca, jwt_private_key=tmp_path / "jwt.key")
    server = RestServer(cfg, IntentStore(tmp_path / "state-http"), node_name="bench-node")
    server.start()
    ctx = client_context(pki)
    base = f"https://localhost:{server.port}"
    direct_store = IntentStore(tmp_path / "state-direct")
    direct, http = [], []
    try:
        for r in range(ROUNDS):
            doc = body(n, r)
            t0 = time.perf_counter()
            push = node_policies(doc, 100_000)
            direct_store.apply("manager", 0, push.intents, allow_reserved=True, entries=push.entries)
            direct.append(time.perf_counter() - t0)

            raw = json.dumps(doc)
            t0 = time.perf_counter()
            tok = call(base, "POST", "/api/v1/auth/token",
                       json.dumps({"public_key": public_pem(key), "client_id": "manager-client"}),
                       {"Content-Type": "application/json"}, ctx)
            token = tok.body["data"]["token"]
            auth = {"Authorization": f"Bearer {token}"}
            push = call(base, "POST", "/api/v1/node-intents", raw,
                        {**auth, "Content-Type": "application/json"}, ctx)
            merkle = call(base, "GET", "/api/v1/node-intents/merkle", None, auth, ctx)
            http.append(time.perf_counter() - t0)
            assert push.status == 200 and push.body["data"]["accepted"] == n
            assert merkle.status == 200
    finally:
        server.stop()
    d, h = statistics.median(direct) * 1e3, statistics.median(http) * 1e3
    print(f"\nREST push of {n} policies: token+push+merkle over mTLS median {h:.1f} ms; "
          f"in-process translate+store median {d:.1f} ms; ratio {h / d:.2f} ({ROUNDS} rounds)")
