"""The Decision Maker REST API over a real socket: a real aiohttp server on loopback in its own thread,
a real HTTP client (urllib), real keys and certificates, the real intent store."""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import urllib.error
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jwt
import pytest
import structlog

from gthulhu_node.config import RestConfig
from gthulhu_node.intents.model import Intent
from gthulhu_node.intents.store import IntentStore
from gthulhu_node.rest import RestConfigError, RestServer
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

RFC3339 = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
NODE = "node-a"


class Env:
    """A running server plus what a client needs to talk to it."""

    def __init__(self, server: RestServer, store: IntentStore, key: Any, ctx: ssl.SSLContext | None,
                 pki: Pki | None) -> None:
        self.server, self.store, self.key, self.ctx, self.pki = server, store, key, ctx, pki
        host = "localhost" if ctx is not None else "127.0.0.1"
        self.base = f"{server.scheme}://{host}:{server.port}"

    def call(self, method: str, path: str, body: Any = None, token: str | None = None,
             ctx: ssl.SSLContext | str | None = "default") -> Any:
        headers = {}
        data = None
        if body is not None:
            data = body if isinstance(body, (str, bytes)) else json.dumps(body)
            headers["Content-Type"] = "application/json"
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        return call(self.base, method, path, data, headers, self.ctx if ctx == "default" else ctx)

    def token(self) -> str:
        reply = self.call("POST", "/api/v1/auth/token",
                          {"public_key": public_pem(self.key), "client_id": "manager-client"})
        assert reply.status == 200, reply.body
        return str(reply.body["data"]["token"])


def start(tmp_path: Path, *, insecure: bool, store: IntentStore | None = None, **extra: Any) -> Env:
    key = write_rsa_key(tmp_path / "jwt.key")
    pki = None if insecure else make_pki(tmp_path)
    cfg = RestConfig(
        enabled=True,
        listen="127.0.0.1:0",
        jwt_private_key=tmp_path / "jwt.key",
        insecure_allow_plain_http=insecure,
        tls_cert=pki.server_cert if pki else None,
        tls_key=pki.server_key if pki else None,
        tls_client_ca=pki.ca if pki else None,
        **extra,
    )
    store = store or IntentStore(tmp_path / "state")
    server = RestServer(cfg, store, node_name=NODE)
    server.start()
    return Env(server, store, key, client_context(pki) if pki else None, pki)


@pytest.fixture
def plain(tmp_path: Path) -> Iterator[Env]:
    env = start(tmp_path, insecure=True)
    yield env
    env.server.stop()


@pytest.fixture
def mtls(tmp_path: Path) -> Iterator[Env]:
    env = start(tmp_path, insecure=False)
    yield env
    env.server.stop()


def policy(pid: str, regex: str = "^worker$", prio: int = 5, slice_ns: int = 2_000_000,
           node: str = NODE) -> dict[str, Any]:
    """A node policy as the Manager's Go encoder writes it (zero values omitted: `omitempty`)."""
    out: dict[str, Any] = {"policyID": pid, "nodeID": node, "commandRegex": regex}
    if prio:
        out["priority"] = prio
    if slice_ns:
        out["executionTime"] = slice_ns
    return out


def held(store: IntentStore, source: str) -> dict[str, Intent]:
    current = store.get(source)
    return {i.id: i for i in current.intents} if current else {}


# -- the Manager's exchange, replayed ------------------------------------------------------------------

GO_HEADERS = {"User-Agent": "Go-http-client/1.1", "Accept-Encoding": "gzip"}


def manager_request(env: Env, method: str, path: str, body: str | None, token: str | None) -> Any:
    """One request exactly as the Manager's Go client builds it: Content-Type only when there is a
    body, Authorization only with a token, Go's default User-Agent and Accept-Encoding."""
    headers = dict(GO_HEADERS)
    if body is not None:
        headers["Content-Type"] = "application/json"
    if token is not None:
        headers["Authorization"] = "Bearer " + token
    return call(env.base, method, path, body, headers, env.ctx)


def manager_token(env: Env) -> str:
    """The Manager's token request (v1.3.0 TokenRequest: expired_at has no omitempty, so 0 is sent)."""
    pem = json.dumps(public_pem(env.key))
    body = '{"public_key":' + pem + ',"client_id":"manager-client","expired_at":0}'
    tok = manager_request(env, "POST", "/api/v1/auth/token", body, None)
    assert tok.status == 200
    assert tok.body["success"] is True
    assert RFC3339.match(tok.body["timestamp"])
    token, expired_at = tok.body["data"]["token"], tok.body["data"]["expired_at"]
    assert isinstance(token, str) and isinstance(expired_at, int)
    assert time.time() < expired_at <= time.time() + 3600 + 5
    claims = jwt.decode(token, env.key.public_key(), algorithms=["RS256"], issuer="decision-maker-service")
    assert claims["client_id"] == "manager-client" and claims["sub"] == "manager-client"
    assert claims["exp"] == expired_at and claims["nbf"] <= claims["iat"] + 1
    return str(token)


def test_manager_exchange_contract(mtls: Env) -> None:
    """Token, push, merkle check, delete one, delete all: the exact bodies and headers the Manager sends
    (Go's encoder: omitempty, compact JSON). The v1.3.0 Manager computes its token cache lifetime with the
    wrong sign, so it fetches a fresh token before every call: replayed here too."""
    env = mtls
    policies = [
        policy("665f1c2ab1d4e9a0c3b7f812", "^EngineCore(_DP[0-9]+)?$", 10, 2_000_000),
        policy("665f1c2ab1d4e9a0c3b7f813", "nginx", 0, 5_000_000),
        policy("665f1c2ab1d4e9a0c3b7f811", "^a&b<c>$", 3, 0),
    ]
    # Go escapes <, > and & in strings
    push_body = json.dumps({"policies": policies}, separators=(",", ":")).replace("&", "\\u0026") \
        .replace("<", "\\u003c").replace(">", "\\u003e")
    push = manager_request(env, "POST", "/api/v1/node-intents", push_body, manager_token(env))
    assert push.status == 200 and push.body["success"] is True
    assert held(env.store, "manager").keys() == {p["policyID"] for p in policies}
    assert held(env.store, "manager")["665f1c2ab1d4e9a0c3b7f813"].priority == 0
    assert held(env.store, "manager")["665f1c2ab1d4e9a0c3b7f811"].command_regex == "^a&b<c>$"

    # merkle check: no body; equals the root the Manager expects
    merkle = manager_request(env, "GET", "/api/v1/node-intents/merkle", None, manager_token(env))
    assert merkle.status == 200 and merkle.body["success"] is True
    assert merkle.body["data"]["rootHash"] == shell_merkle(node_policy_rows(policies))

    # delete one policy, then all
    one = manager_request(env, "DELETE", "/api/v1/node-intents", '{"policyId":"665f1c2ab1d4e9a0c3b7f812"}',
                          manager_token(env))
    assert one.status == 200 and one.body["success"] is True
    assert "665f1c2ab1d4e9a0c3b7f812" not in held(env.store, "manager")
    merkle = manager_request(env, "GET", "/api/v1/node-intents/merkle", None, manager_token(env))
    assert merkle.body["data"]["rootHash"] == shell_merkle(node_policy_rows(policies[1:]))
    everything = manager_request(env, "DELETE", "/api/v1/node-intents", '{"all":true}', manager_token(env))
    assert everything.status == 200 and everything.body["success"] is True
    assert held(env.store, "manager") == {}
    merkle = manager_request(env, "GET", "/api/v1/node-intents/merkle", None, manager_token(env))
    assert merkle.body["data"]["rootHash"] == shell_merkle([])

    # neither policyId nor all (Go omits all=false): 400 in the error envelope
    neither = manager_request(env, "DELETE", "/api/v1/node-intents", "{}", manager_token(env))
    assert neither.status == 400 and neither.body["success"] is False and neither.body["error"]
    assert env.server.stats().tokens_issued == 7


def test_health_needs_no_token(plain: Env) -> None:
    reply = plain.call("GET", "/health")
    assert reply.status == 200
    assert reply.body["status"] == "healthy" and RFC3339.match(reply.body["timestamp"])
    assert reply.body["service"]


# -- merkle against roots computed without the implementation ------------------------------------------

@pytest.mark.parametrize("count", [0, 1, 2, 3])
def test_merkle_root_matches_independent_computation(plain: Env, count: int) -> None:
    token = plain.token()
    # ids and node names chosen so that sorting by policyID first (upstream's own Decision Maker) would
    # give another order than the Manager's nodeID-first order
    policies = [
        policy("ccc000000000000000000001", "^w1$", 1, 1_000_000, node="node-a"),
        policy("aaa000000000000000000002", "^w2$", 20, 0, node="node-b"),
        policy("bbb000000000000000000003", "^w3$", 0, 50_000, node="node-a"),
    ][:count]
    reply = plain.call("POST", "/api/v1/node-intents", {"policies": policies}, token)
    assert reply.status == 200, reply.body
    root = plain.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"]
    assert root == shell_merkle(node_policy_rows(policies))
    assert root == reference_merkle(node_policy_rows(policies))  # the reference used for large sets
    if count == 0:
        assert root == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"


# -- refused tokens change nothing ---------------------------------------------------------------------

def _bad_tokens(env: Env, tmp_path: Path) -> dict[str, str | None]:
    now = int(time.time())
    claims = {"client_id": "manager-client", "sub": "manager-client", "iss": "decision-maker-service",
              "iat": now, "nbf": now, "exp": now + 600}
    other = write_rsa_key(tmp_path / "other.key", "other")
    return {
        "missing": None,
        "expired": jwt.encode({**claims, "iat": now - 7200, "nbf": now - 7200, "exp": now - 3600},
                              env.key, algorithm="RS256"),
        "forged": jwt.encode(claims, other, algorithm="RS256"),
        "wrong issuer": jwt.encode({**claims, "iss": "someone-else"}, env.key, algorithm="RS256"),
        "not yet valid": jwt.encode({**claims, "nbf": now + 3600}, env.key, algorithm="RS256"),
        "no exp": jwt.encode({k: v for k, v in claims.items() if k != "exp"}, env.key, algorithm="RS256"),
        "HS256 with the public key": jwt.encode(claims, "secret-key-" * 4, algorithm="HS256"),
        "garbage": "not-a-jwt",
    }


def test_refused_tokens_get_401_and_change_nothing(plain: Env, tmp_path: Path) -> None:
    good = plain.token()
    kept = [policy("aaaaaaaaaaaaaaaaaaaaaaaa")]
    assert plain.call("POST", "/api/v1/node-intents", {"policies": kept}, good).status == 200
    before = plain.store.snapshot()
    for name, token in _bad_tokens(plain, tmp_path).items():
        for method, path, body in [
            ("POST", "/api/v1/node-intents", {"policies": [policy("bbbbbbbbbbbbbbbbbbbbbbbb")]}),
            ("POST", "/api/v1/node-intents", {"policies": []}),
            ("DELETE", "/api/v1/node-intents", {"all": True}),
            ("GET", "/api/v1/node-intents/merkle", None),
            ("POST", "/api/v1/intents", {"intents": []}),
        ]:
            reply = plain.call(method, path, body, token)
            assert reply.status == 401, (name, method, path, reply.body)
            assert reply.body["success"] is False and reply.body["error"], name
    assert plain.store.snapshot() == before
    # a bearer header that is not "Bearer ..."
    raw = call(plain.base, "DELETE", "/api/v1/node-intents", '{"all":true}',
               {"Authorization": f"Token {good}"})
    assert raw.status == 401 and plain.store.snapshot() == before
    assert plain.server.stats().auth_refused >= 41


def test_token_needs_our_public_key(plain: Env, tmp_path: Path) -> None:
    other = write_rsa_key(tmp_path / "x.key", "other")
    for pem in [public_pem(other), "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "x"]:
        reply = plain.call("POST", "/api/v1/auth/token", {"public_key": pem, "client_id": "m"})
        assert reply.status == 401 and reply.body == {"success": False, "error": reply.body["error"]}
    # the same key in another encoding (PKCS#1, CRLF line ends, surrounding blanks) is the same key
    pkcs1 = "\n  " + public_pem(plain.key, "pkcs1").replace("\n", "\r\n") + "  \n"
    reply = plain.call("POST", "/api/v1/auth/token", {"public_key": pkcs1, "client_id": "m"})
    assert reply.status == 200 and reply.body["data"]["token"]
    # a client may ask for a shorter lifetime, not a longer one
    soon = int(time.time()) + 120
    short = plain.call("POST", "/api/v1/auth/token",
                       {"public_key": public_pem(plain.key), "client_id": "m", "expired_at": soon})
    assert short.body["data"]["expired_at"] == soon
    late = plain.call("POST", "/api/v1/auth/token",
                      {"public_key": public_pem(plain.key), "client_id": "m", "expired_at": soon + 10**6})
    assert late.body["data"]["expired_at"] <= int(time.time()) + 3600 + 1
    assert plain.call("POST", "/api/v1/auth/token", {"client_id": "m"}).status == 400


# -- validation: the store's, naming the field -------------------------------------------------------

@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"policyID": "not/valid", "commandRegex": "x", "priority": 1}, "id must be"),
        ({"policyID": "b" * 24, "commandRegex": "x", "priority": 25}, "priority 25 is above 20"),
        ({"policyID": "b" * 24, "commandRegex": "(unclosed", "priority": 1}, "not valid RE2"),
        ({"policyID": "b" * 24, "priority": 1}, "commandRegex is empty"),
        ({"policyID": "a" * 24, "commandRegex": "x", "priority": 1}, "duplicate policyID"),
        ({"policyID": "b" * 24, "commandRegex": r"\pL{1000}", "priority": 1}, "pattern too large"),
        ({"policyID": "b" * 254, "commandRegex": "x", "priority": 1}, "policyID is 254 characters"),
        ({"policyID": "b" * 24, "nodeID": "n" * 254, "commandRegex": "x"}, "nodeID is 254 characters"),
    ],
)
def test_unusable_policy_is_accepted_as_a_failed_entry(plain: Env, bad: dict[str, Any], reason: str) -> None:
    """Upstream's Decision Maker accepts these and skips them when matching: a 400 would make the Manager
    re-push the same set forever. Before this change each of them was a 400 for the whole push."""
    token = plain.token()
    good = policy("a" * 24)
    reply = plain.call("POST", "/api/v1/node-intents", {"policies": [good, bad]}, token)
    assert reply.status == 200 and reply.body["success"] is True, reply.body
    assert reply.body["data"]["accepted"] == 1
    [failed] = reply.body["data"]["failed"]
    assert reason in failed["reason"] and re.search(r"#[0-9a-f]{12}$", failed["key"])
    assert held(plain.store, "manager").keys() == {"a" * 24}
    # its key is its content's, not its position's: the same set in another order is no change
    again = plain.call("POST", "/api/v1/node-intents", {"policies": [bad, good]}, token)
    assert again.body["data"]["changed"] is False and again.body["data"]["failed"] == [failed]
    merkle = plain.call("GET", "/api/v1/node-intents/merkle", token=token)
    assert merkle.body["data"]["rootHash"] == shell_merkle(node_policy_rows([good, bad]))
    rows = plain.call("GET", "/api/v1/node-intents", token=token).body["data"]["policies"]
    assert rows[1]["state"] == "failed" and reason in rows[1]["reason"]


@pytest.mark.parametrize(
    ("bad", "field"),
    [
        ({"policyID": "b" * 24, "commandRegex": "x", "priority": "high"}, "policies[1].priority"),
        ({"policyID": "b" * 24, "commandRegex": "x", "priority": 1.5}, "policies[1].priority"),
        ({"policyID": "b" * 24, "commandRegex": "x", "executionTime": 2**63}, "policies[1].executionTime"),
        ({"policyID": 7, "commandRegex": "x"}, "policies[1].policyID"),
        ({"policyID": "b" * 24, "commandRegex": ["x"]}, "policies[1].commandRegex"),
    ],
)
def test_wrong_json_types_are_refused_naming_the_field(plain: Env, bad: dict[str, Any], field: str) -> None:
    """What Go's decoder refuses (upstream answers 400 "Invalid request payload"): nothing changes."""
    token = plain.token()
    good = policy("a" * 24)
    assert plain.call("POST", "/api/v1/node-intents", {"policies": [good]}, token).status == 200
    before = plain.store.snapshot()
    reply = plain.call("POST", "/api/v1/node-intents", {"policies": [good, bad]}, token)
    assert reply.status == 400 and reply.body["success"] is False
    assert reply.body["error"].startswith(field), reply.body["error"]
    assert plain.store.snapshot() == before


def test_malformed_bodies(plain: Env) -> None:
    token = plain.token()
    for body in ["", "{", "[]", '{"policies": 3}', '{"policies": [1]}']:
        reply = plain.call("POST", "/api/v1/node-intents", body, token)
        assert reply.status == 400 and reply.body["success"] is False, body
    assert plain.call("GET", "/api/v1/nowhere", token=token).status == 404
    assert plain.call("PUT", "/api/v1/node-intents", "{}", token).status == 405


@pytest.mark.parametrize("path", ["/api/v1/auth/token", "/api/v1/node-intents", "/api/v1/intents"])
@pytest.mark.parametrize("depth", [33, 100_000])
def test_deeply_nested_bodies_are_400_naming_the_limit(plain: Env, path: str, depth: int) -> None:
    """They used to be 500 (RecursionError), on the token route too."""
    token = None if path.endswith("token") else plain.token()
    for body in ["[" * depth + "]" * depth, '{"policies": ' + "[" * depth + "]" * depth + "}"]:
        reply = plain.call("POST", path, body, token)
        assert reply.status == 400, (path, reply.status)
        assert "nested more than 32 levels deep" in reply.body["error"]


@pytest.mark.parametrize("path", ["/api/v1/auth/token", "/api/v1/node-intents", "/api/v1/intents",
                                  "/api/v1/runtime-config"])
def test_undecodable_numbers_are_400_naming_them(plain: Env, path: str) -> None:
    """A 5,000-digit integer anywhere was a 500 on every route (Python's int-digit limit, raised by the
    JSON decoder), the token route included, with a traceback logged each time."""
    token = None if path.endswith("token") else plain.token()
    before = plain.store.snapshot()
    for body, words in (('{"policies": [{"priority": ' + "9" * 5000 + "}]}", "an integer of 5000 digits"),
                        ('{"client_id": "x", "expired_at": NaN}', "NaN is not a JSON number")):
        reply = plain.call("POST", path, body, token)
        assert reply.status == 400, (path, reply.status)
        assert words in reply.body["error"]
    assert plain.store.snapshot() == before


def test_body_size_limit(tmp_path: Path) -> None:
    env = start(tmp_path, insecure=True, max_body_bytes=4096)
    try:
        token = env.token()
        big = {"policies": [policy(f"{i:024x}") for i in range(100)]}
        reply = env.call("POST", "/api/v1/node-intents", big, token)
        assert reply.status == 413 and reply.body["success"] is False
        assert env.store.get("manager") is None
    finally:
        env.server.stop()


# -- only the manager source ---------------------------------------------------------------------------

def test_manager_push_never_drops_other_sources(plain: Env) -> None:
    store = plain.store
    store.apply("local", 0, [Intent(id="vllm", commandRegex="^EngineCore")], allow_reserved=True)
    store.apply("ops-team", 7, [Intent(id="db", commandRegex="^postgres$", priority=3)])
    others = {k: v for k, v in store.snapshot().items() if k != "manager"}
    token = plain.token()
    steps = [
        ("POST", "/api/v1/node-intents", {"policies": [policy("a" * 24), policy("b" * 24)]}),
        ("POST", "/api/v1/node-intents", {"policies": [policy("c" * 24)]}),
        ("DELETE", "/api/v1/node-intents", {"policyId": "c" * 24}),
        ("POST", "/api/v1/node-intents", {"policies": []}),
        ("DELETE", "/api/v1/node-intents", {"all": True}),
    ]
    for method, path, body in steps:
        assert plain.call(method, path, body, token).status == 200
        assert {k: v for k, v in store.snapshot().items() if k != "manager"} == others


class HeldStore(IntentStore):
    """An IntentStore whose `manager` applies wait until `release` is set: a push in progress (compiling
    thousands of patterns, fsyncing the state file) for as long as the test needs."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.entered = threading.Event()
        self.release = threading.Event()

    def apply(self, source: str, generation: int, intents: Sequence[Intent], **kw: Any) -> Any:
        if source == "manager":
            self.entered.set()
            self.release.wait(60)
        return super().apply(source, generation, intents, **kw)


def test_a_push_in_progress_stalls_no_other_request(tmp_path: Path) -> None:
    """The Manager's merkle check and /health answer while a push is being applied. Before, the node
    routes took the push's lock on the event loop's thread to note the Manager's contact: a check that
    came during a push stopped every request of the listener until the push ended (seconds at 10,000
    intents)."""
    store = HeldStore(tmp_path / "state")
    env = start(tmp_path, insecure=True, store=store)
    try:
        token = env.token()
        with ThreadPoolExecutor(2) as pool:
            push = pool.submit(env.call, "POST", "/api/v1/node-intents", {"policies": [policy("a" * 24)]},
                               token)
            assert store.entered.wait(30), "the push did not reach the store"
            merkle = pool.submit(env.call, "GET", "/api/v1/node-intents/merkle", None, token)
            try:
                # the push is held for up to 60 s: an answer before that is an answer during the push
                assert merkle.result(timeout=30).status == 200
                assert env.call("GET", "/health").status == 200
                assert not push.done()
            finally:
                store.release.set()
            assert push.result(timeout=30).status == 200
    finally:
        store.release.set()
        env.server.stop()


def test_push_is_persisted(tmp_path: Path) -> None:
    env = start(tmp_path, insecure=True)
    try:
        token = env.token()
        policies = [policy("a" * 24, node="node-x"), policy("b" * 24)]
        assert env.call("POST", "/api/v1/node-intents", {"policies": policies}, token).status == 200
        root = env.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"]
    finally:
        env.server.stop()
    # a restarted agent loads the state and answers the same root (the Manager does not re-push)
    reloaded = IntentStore(tmp_path / "state")
    assert reloaded.load() == 2
    (tmp_path / "again").mkdir()
    env2 = start(tmp_path / "again", insecure=True, store=reloaded)
    try:
        token = env2.token()
        assert env2.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"] == root
        assert root == shell_merkle(node_policy_rows(policies))
    finally:
        env2.server.stop()


@pytest.mark.parametrize("field", ["policyID", "commandRegex", "nodeID"])
def test_lone_surrogate_changes_nothing_and_the_api_keeps_answering(tmp_path: Path, field: str) -> None:
    """A lone surrogate (JSON "\\ud800") decodes into a str that UTF-8 cannot hold. It used to replace
    the set in memory, fail the journal write with an error the store did not catch (500), and leave
    every later GET of the routes and the merkle root a 500 while disk kept the old set."""
    env = start(tmp_path, insecure=True)
    try:
        token = env.token()
        good = {"policies": [policy("a" * 24)]}
        assert env.call("POST", "/api/v1/node-intents", good, token).status == 200
        before = env.store.snapshot()
        root = env.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"]
        bad = policy("b" * 24)
        bad[field] = "x\ud800"
        body = json.dumps({"policies": [policy("a" * 24), bad]})  # ensure_ascii: the escape as sent
        assert "\\ud800" in body
        reply = env.call("POST", "/api/v1/node-intents", body, token)
        assert reply.status == 400, reply.body
        assert f"policies[1].{field}: not valid Unicode" in reply.body["error"], reply.body
        assert env.store.snapshot() == before
        for path in ("/api/v1/node-intents", "/api/v1/node-intents/merkle"):
            assert env.call("GET", path, token=token).status == 200, path
        assert env.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"] == root
    finally:
        env.server.stop()
    on_disk = IntentStore(tmp_path / "state")
    on_disk.load()
    assert {k: v.intents for k, v in on_disk.snapshot().items()} == {k: v.intents for k, v in before.items()}


def test_state_from_before_entries_were_kept(tmp_path: Path) -> None:
    """A state file of the previous version: `manager` intents without entries still answer the root the
    Manager expects; `manager-pods` intents without entries cannot be hashed as it does, so they are
    forgotten at start (counted, logged) rather than hidden behind sha256("")."""
    old = IntentStore(tmp_path / "state")
    old.apply("manager", 0, [Intent(id="a" * 24, commandRegex="^worker$", priority=5, nodeNames=[NODE])],
              allow_reserved=True)
    old.apply("manager-pods", 0, [Intent(id=f"{POD_A}.0123456789ab", commandRegex="x", podUID=POD_A)],
              allow_reserved=True)
    store = IntentStore(tmp_path / "state")
    store.load()
    env = start(tmp_path, insecure=True, store=store)
    try:
        token = env.token()
        root = env.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"]
        assert root == shell_merkle(node_policy_rows([policy("a" * 24, slice_ns=0)]))
        assert env.call("GET", "/api/v1/node-intents", token=token).body["data"]["policies"][0]["policyID"] \
            == "a" * 24
        assert held(store, "manager-pods") == {}
        assert env.server.stats().pod_intents_forgotten == 1
    finally:
        env.server.stop()


def test_entries_over_the_limit_fail_in_merkle_order_whatever_the_push_order(tmp_path: Path) -> None:
    """More entries than api.max_intents_per_source were a 400 for the whole push (so the Manager re-pushed
    it forever). Now the first ones in the Manager's merkle order are applied, the rest are failed entries,
    and the root is the Manager's; only more than 4 times the limit cannot be held (400)."""
    env = start(tmp_path, insecure=True, store=IntentStore(tmp_path / "state", max_intents_per_source=3))
    try:
        token = env.token()
        policies = [policy(f"{i:024x}", f"^w{i}$") for i in range(5)]
        reply = env.call("POST", "/api/v1/node-intents", {"policies": policies[::-1]}, token)
        assert reply.status == 200 and reply.body["data"]["accepted"] == 3, reply.body
        assert held(env.store, "manager").keys() == {f"{i:024x}" for i in range(3)}
        assert all("api.max_intents_per_source" in f["reason"] for f in reply.body["data"]["failed"])
        root = env.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"]
        assert root == shell_merkle(node_policy_rows(policies))
        assert env.call("POST", "/api/v1/node-intents", {"policies": policies}, token).body["data"][
            "changed"] is False
        many = [policy(f"{i:024x}") for i in range(13)]
        refused = env.call("POST", "/api/v1/node-intents", {"policies": many}, token)
        assert refused.status == 400 and "more than can be held" in refused.body["error"]
    finally:
        env.server.stop()


def test_a_long_pattern_is_applied_and_kept_across_a_restart(tmp_path: Path) -> None:
    """Upstream takes a commandRegex of any length; a 5,000-character one was a 400 for the whole push.
    Kept across a restart: the state file is read with the Manager's (absent) limit, not the local 256."""
    env = start(tmp_path, insecure=True)
    pattern = "^worker$|" + "|".join(f"^w{i:04d}$" for i in range(700))
    assert len(pattern) > 4096
    try:
        body = {"policies": [policy("a" * 24, pattern)]}
        reply = env.call("POST", "/api/v1/node-intents", body, env.token())
        assert reply.status == 200 and reply.body["data"]["accepted"] == 1, reply.body
    finally:
        env.server.stop()
    store = IntentStore(tmp_path / "state")
    store.load()
    assert held(store, "manager")["a" * 24].command_regex == pattern


def test_other_node_intents_are_applied_and_reported(plain: Env) -> None:
    """The Manager chose this node: an entry naming another node is applied all the same (it was recorded
    but never applied before) and the mismatch is reported."""
    token = plain.token()
    reply = plain.call("POST", "/api/v1/node-intents",
                       {"policies": [policy("a" * 24), policy("b" * 24, node="node-z")]}, token)
    assert reply.status == 200
    assert reply.body["data"]["nodeNameMismatch"] == ["b" * 24]
    assert held(plain.store, "manager")["b" * 24].node_names == ()


def test_thousand_intents_are_applied_and_acknowledged(plain: Env) -> None:
    token = plain.token()
    policies = [policy(f"{i:024x}", f"^worker-{i}$", 1 + i % 20, 1_000_000 + i) for i in range(1000)]
    reply = plain.call("POST", "/api/v1/node-intents", {"policies": policies}, token)
    assert reply.status == 200 and reply.body["success"] is True
    assert reply.body["data"]["accepted"] == 1000 and reply.body["data"]["changed"] is True
    stored = held(plain.store, "manager")
    assert len(stored) == 1000 and stored[f"{999:024x}"].execution_time == 1_000_999
    listing = plain.call("GET", "/api/v1/node-intents", token=token)
    assert len(listing.body["data"]["policies"]) == 1000
    root = plain.call("GET", "/api/v1/node-intents/merkle", token=token).body["data"]["rootHash"]
    assert root == reference_merkle(node_policy_rows(policies))
    # the Manager's 30 s re-push of the same set is a no-op
    again = plain.call("POST", "/api/v1/node-intents", {"policies": list(reversed(policies))}, token)
    assert again.status == 200 and again.body["data"]["changed"] is False


# -- transport security ----------------------------------------------------------------------------

def test_client_without_certificate_is_refused(mtls: Env, tmp_path: Path) -> None:
    assert mtls.pki is not None
    no_cert = client_context(mtls.pki, with_cert=False)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        mtls.call("GET", "/health", ctx=no_cert)
    stranger = make_pki(tmp_path, prefix="other-")
    foreign = client_context(mtls.pki, cert_from=stranger)
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        mtls.call("POST", "/api/v1/auth/token", {"public_key": public_pem(mtls.key), "client_id": "m"},
                  ctx=foreign)
    # plain HTTP to the TLS port gets nothing served, but an answer naming what to set (it was an empty
    # reply: curl's exit 52, nothing in either log), logged once per peer
    with structlog.testing.capture_logs() as logs:
        for _ in range(2):
            plain = call(f"http://127.0.0.1:{mtls.server.port}", "POST", "/api/v1/auth/token", "{}",
                         {"Content-Type": "application/json"})
            assert plain.status == 400 and plain.body["success"] is False
            assert "mtls.enabled: true" in plain.body["error"]
            assert "rest.insecure_allow_plain_http" in plain.body["error"]
    told = [e for e in logs if e["event"] == "rest_plain_http_on_tls_port"]
    # once per peer at warning (the repeat is at debug, which the logging set-up may filter out)
    assert [e["log_level"] for e in told if e["log_level"] != "debug"] == ["warning"]
    assert mtls.server.stats().plain_http_refused == 2
    assert mtls.call("GET", "/health").status == 200


def test_mutual_tls_is_required_unless_insecure_is_explicit(tmp_path: Path) -> None:
    write_rsa_key(tmp_path / "jwt.key")
    store = IntentStore(None)
    cfg = RestConfig(enabled=True, listen="127.0.0.1:0", jwt_private_key=tmp_path / "jwt.key")
    with pytest.raises(RestConfigError, match=r"rest\.tls_cert, rest\.tls_key, rest\.tls_client_ca"):
        RestServer(cfg, store, node_name=NODE).start()
    no_key = RestConfig(enabled=True, listen="127.0.0.1:0", insecure_allow_plain_http=True)
    with pytest.raises(RestConfigError, match="jwt_private_key"):
        RestServer(no_key, store, node_name=NODE).start()
    other = write_rsa_key(tmp_path / "other.key", "other")
    (tmp_path / "other.pub").write_text(public_pem(other))
    mismatched = RestConfig(enabled=True, listen="127.0.0.1:0", insecure_allow_plain_http=True,
                            jwt_private_key=tmp_path / "jwt.key", jwt_public_key=tmp_path / "other.pub")
    with pytest.raises(RestConfigError, match="not the public half"):
        RestServer(mismatched, store, node_name=NODE).start()


def test_insecure_mode_works_and_says_so(tmp_path: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        env = start(tmp_path, insecure=True, insecure_warning_interval_s=0.2)
        try:
            token = env.token()
            assert env.call("POST", "/api/v1/node-intents", {"policies": [policy("a" * 24)]},
                            token).status == 200
            deadline = time.monotonic() + 30
            while sum(e["event"] == "rest_insecure_plain_http" for e in logs) < 2:
                assert time.monotonic() < deadline, "no periodic warning"
                time.sleep(0.1)
        finally:
            env.server.stop()
    warnings = [e for e in logs if e["event"] == "rest_insecure_plain_http"]
    assert warnings[0]["log_level"] == "warning" and "token" in warnings[0]["risk"]
    assert env.server.stats().insecure is True


# -- pod intents (source manager-pods) -------------------------------------------------------------

POD_A = "0b9f3a7e-1c2d-4e5f-8a9b-0c1d2e3f4a5b"
POD_B = "7d6c5b4a-3928-4170-9e8d-7c6b5a493827"


def test_pod_intents_push_merkle_delete(plain: Env) -> None:
    token = plain.token()
    intents = [
        {"podName": "vllm-0", "podID": POD_A, "nodeID": NODE, "k8sNamespace": "ml",
         "commandRegex": "^EngineCore", "priority": 10, "executionTime": 2_000_000,
         "podLabels": {"tier": "gpu", "app": "vllm"}},
        {"podName": "vllm-0", "podID": POD_A, "nodeID": NODE, "k8sNamespace": "ml",
         "commandRegex": "^tokenizer$", "priority": 1},
        {"podName": "web-1", "podID": POD_B, "nodeID": NODE, "k8sNamespace": "default",
         "commandRegex": "^nginx$", "executionTime": 500_000},
    ]
    node_before = plain.call("POST", "/api/v1/node-intents", {"policies": [policy("a" * 24)]}, token)
    assert node_before.status == 200
    reply = plain.call("POST", "/api/v1/intents", {"intents": intents}, token)
    assert reply.status == 200 and reply.body["data"]["accepted"] == 3
    pods = held(plain.store, "manager-pods")
    assert sorted(i.pod_uid or "" for i in pods.values()) == [POD_A, POD_A, POD_B]
    assert len(held(plain.store, "manager")) == 1  # node policies are another source
    merkle = plain.call("GET", "/api/v1/intents/merkle", token=token)
    assert merkle.body["data"]["rootHash"] == shell_merkle(pod_intent_rows(intents))
    # the same push again (the Manager's re-push) keeps the ids: nothing changes
    again = plain.call("POST", "/api/v1/intents", {"intents": intents[::-1]}, token)
    assert again.body["data"]["changed"] is False and held(plain.store, "manager-pods") == pods
    gone = plain.call("DELETE", "/api/v1/intents", {"podId": POD_A}, token)
    assert gone.status == 200
    assert [i.pod_uid for i in held(plain.store, "manager-pods").values()] == [POD_B]
    merkle = plain.call("GET", "/api/v1/intents/merkle", token=token)
    assert merkle.body["data"]["rootHash"] == shell_merkle(pod_intent_rows(intents[2:]))
    assert plain.call("DELETE", "/api/v1/intents", {"all": True}, token).status == 200
    assert held(plain.store, "manager-pods") == {} and len(held(plain.store, "manager")) == 1
    assert plain.call("DELETE", "/api/v1/intents", {"all": False}, token).status == 400


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        ({"podID": "not a uid", "commandRegex": "x"}, "podID is not a pod UID"),
        ({"commandRegex": "x"}, "podID is empty"),
        ({"podID": POD_A, "commandRegex": "x", "priority": 99}, "priority 99 is above 20"),
    ],
)
def test_unusable_pod_intent_is_a_failed_entry(plain: Env, bad: dict[str, Any], reason: str) -> None:
    """Accepted (upstream would), counted in the root, reported failed; each was a 400 before."""
    token = plain.token()
    reply = plain.call("POST", "/api/v1/intents", {"intents": [bad]}, token)
    assert reply.status == 200, reply.body
    assert reason in reply.body["data"]["failed"][0]["reason"]
    assert held(plain.store, "manager-pods") == {}
    merkle = plain.call("GET", "/api/v1/intents/merkle", token=token)
    assert merkle.body["data"]["rootHash"] == shell_merkle(pod_intent_rows([bad]))


def test_pod_intent_with_wrong_label_types_is_refused(plain: Env) -> None:
    bad = {"podID": POD_A, "commandRegex": "x", "podLabels": {"a": 1}}
    reply = plain.call("POST", "/api/v1/intents", {"intents": [bad]}, plain.token())
    assert reply.status == 400 and reply.body["error"].startswith("intents[0].podLabels"), reply.body
    assert plain.store.get("manager-pods") is None


def test_metrics_route_is_optional(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    env = start(tmp_path / "a", insecure=True)
    try:
        assert env.call("GET", "/metrics").status == 404
    finally:
        env.server.stop()
    write_rsa_key(tmp_path / "jwt.key")
    cfg = RestConfig(enabled=True, listen="127.0.0.1:0", jwt_private_key=tmp_path / "jwt.key",
                     insecure_allow_plain_http=True)
    server = RestServer(cfg, IntentStore(None), node_name=NODE,
                        metrics_text=lambda: b"gthulhu_node_up 1\n")
    server.start()
    try:
        reply = call(f"http://127.0.0.1:{server.port}", "GET", "/metrics")
        assert reply.status == 200 and reply.body == "gthulhu_node_up 1\n"
    finally:
        server.stop()


# -- client assertions (newer Managers) ------------------------------------------------------------

def _assertion(key: Any, client_id: str = "manager-client", **override: Any) -> str:
    """What a newer Manager sends: a one-minute RS256 JWT signed with its own key."""
    now = int(time.time())
    claims = {"client_id": client_id, "token_type": "dm_client_assertion", "iss": client_id,
              "sub": client_id, "aud": ["gthulhu-decision-maker-token"], "iat": now, "nbf": now,
              "exp": now + 60, **override}
    return jwt.encode(claims, key, algorithm="RS256")


def test_client_assertion_tokens(tmp_path: Path) -> None:
    manager_key = write_rsa_key(tmp_path / "manager.key", "manager")
    (tmp_path / "manager.pub").write_text(public_pem(manager_key))
    env = start(tmp_path, insecure=True, trusted_client_public_key=tmp_path / "manager.pub",
                expected_client_id="manager-client")
    try:
        def ask(body: dict[str, Any]) -> Any:
            return env.call("POST", "/api/v1/auth/token", body)

        good = ask({"client_id": "manager-client", "client_assertion": _assertion(manager_key)})
        assert good.status == 200 and good.body["success"] is True
        token = good.body["data"]["token"]
        assert env.call("POST", "/api/v1/node-intents", {"policies": [policy("a" * 24)]}, token).status == 200
        other = write_rsa_key(tmp_path / "other.key", "other")
        now = int(time.time())
        refused = {
            "another key": _assertion(other),
            "wrong audience": _assertion(manager_key, aud=["gthulhu-decision-maker-api"]),
            "wrong type": _assertion(manager_key, token_type="dm_access"),
            "other subject": _assertion(manager_key, sub="intruder"),
            "expired": _assertion(manager_key, iat=now - 600, nbf=now - 600, exp=now - 300),
            "our own access token": token,
        }
        for name, assertion in refused.items():
            reply = ask({"client_id": "manager-client", "client_assertion": assertion})
            assert reply.status == 401 and reply.body["success"] is False, name
        wrong_client = ask({"client_id": "intruder", "client_assertion": _assertion(manager_key, "intruder")})
        assert wrong_client.status == 401
        # with assertions configured, showing our public key is not enough any more
        assert ask({"client_id": "manager-client", "public_key": public_pem(env.key)}).status == 400
        assert env.server.stats().tokens_refused == len(refused) + 1
    finally:
        env.server.stop()


def test_a_connection_that_sent_its_request_head_outlives_the_head_deadline(tmp_path: Path) -> None:
    """Issue 38 item 4: the deadline is for the handshake and the first request head only. A peer that
    sends nothing is dropped at it; a keep-alive connection that was served is not (its first head marks
    it finished, through aiohttp's request factory)."""
    import http.client
    import socket
    import time

    env = start(tmp_path, insecure=True, handshake_timeout_s=0.5)
    try:
        served = http.client.HTTPConnection("127.0.0.1", env.server.port, timeout=5)
        served.request("GET", "/health")
        first = served.getresponse()
        assert first.status == 200 and first.read()
        with socket.create_connection(("127.0.0.1", env.server.port), timeout=5) as silent:
            time.sleep(1.5)  # three deadlines' worth
            assert silent.recv(1) == b""  # closed by the agent
        served.request("GET", "/health")
        assert served.getresponse().status == 200  # the same connection, still held
        served.close()
    finally:
        env.server.stop()
