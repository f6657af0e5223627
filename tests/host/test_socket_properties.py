"""Property-based tests of every socket edge of a real `gthulhu-node run` process (issue 38, item 8): the
metrics port, the REST port (mutual TLS) and the unix API socket (gRPC), each fed what hypothesis makes of
random bytes, random Unicode, large integers and deep and wide JSON. After every example the edge has
answered or closed the connection (never hung it), and the agent still serves its clients: a scrape, a
Manager token, a status call, and its local policy applied.

The agent is test_hostile.py's (dry-run backend, fd limit 512). Integers stay below 4,300 digits and
strings are well-formed Unicode here: a 5,000-digit integer and a lone surrogate in a REST body are the
decoding boundary's cases (issue 38, items 1 and 2), tested where that boundary is.
"""

from __future__ import annotations

import json
import socket
import ssl
import urllib.error
import urllib.request
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from tests.host.test_hostile import Agent, agent, manager_call, scraped  # noqa: F401 (agent: the fixture)
from tests.unit.rest_support import client_context

pytestmark = pytest.mark.host

EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
ANSWER_S = 10.0  # an edge that neither answers nor closes within this has hung the connection

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**300), 10**300) | st.floats(allow_nan=False)
    | st.text(max_size=50),
    lambda inner: st.lists(inner, max_size=8) | st.dictionaries(st.text(max_size=20), inner, max_size=8),
    max_leaves=60,
)
# bodies shaped like the Manager's, with any value in any field
policy_fields = st.fixed_dictionaries({}, optional={
    "policyID": json_values, "nodeID": json_values, "commandRegex": json_values, "priority": json_values,
    "executionTime": json_values, "podID": json_values, "selectors": json_values,
})
manager_bodies = st.one_of(json_values,
                           st.fixed_dictionaries({"policies": st.lists(policy_fields, max_size=5)}))


def still_serving(agent: Agent) -> None:  # noqa: F811
    assert agent.proc.poll() is None
    assert scraped(agent)
    assert manager_call(agent)
    assert agent.states()["local/engine"] == pb.INTENT_STATE_APPLIED


def exchange(sock: socket.socket, data: bytes) -> bytes:
    """Send `data`, half-close, read what comes back until the agent closes (or ANSWER_S: a failure)."""
    sock.settimeout(ANSWER_S)
    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return b""  # closed on us while sending: an answer too
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


@given(st.one_of(
    st.binary(max_size=4096),
    st.builds(lambda method, path, headers: f"{method} {path} HTTP/1.1\r\n{headers}\r\n\r\n".encode(
        "utf-8", "surrogatepass"), st.text(max_size=20), st.text(max_size=200),
        st.text(max_size=2000)),
))
@EXAMPLES
def test_metrics_port_answers_or_closes_on_any_bytes(agent: Agent, data: bytes) -> None:  # noqa: F811
    with socket.create_connection(("127.0.0.1", agent.metrics_port)) as sock:
        reply = exchange(sock, data)  # closed by the agent within ANSWER_S, or a TimeoutError
    # an HTTP/1.x answer, or for a request line without a version http.server's HTTP/0.9 one (the page)
    assert reply == b"" or reply.startswith((b"HTTP/1.0 ", b"<!DOCTYPE HTML>")), reply[:200]
    assert not reply.startswith(b"HTTP/1.0 500"), reply[:200]
    assert scraped(agent)


@given(st.binary(max_size=4096))
@EXAMPLES
def test_rest_port_closes_on_any_bytes_before_the_handshake(agent: Agent, data: bytes) -> None:  # noqa: F811
    with socket.create_connection(("127.0.0.1", agent.rest_port)) as sock:
        exchange(sock, data)  # no certificate, no TLS: never an HTTP answer; a close or a TLS alert
    assert manager_call(agent)


def tls_request(agent: Agent, raw: bytes) -> bytes:  # noqa: F811
    """`raw`, then a complete request (so that what precedes it is either a request of its own or a bad
    line, never a head still waiting for its end), over mutual TLS; the first answer's head, or what came
    before the agent closed. A TimeoutError when neither happens within ANSWER_S."""
    ctx = client_context(agent.pki)
    with socket.create_connection(("127.0.0.1", agent.rest_port)) as plain, \
            ctx.wrap_socket(plain, server_hostname="localhost") as sock:
        sock.settimeout(ANSWER_S)
        sock.sendall(raw + b"\r\nGET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        out = b""
        try:
            while b"\r\n\r\n" not in out and (chunk := sock.recv(65536)):
                out += chunk
        except (ssl.SSLError, ConnectionResetError):
            pass
        return out


@given(st.binary(max_size=4096).filter(lambda b: b"\r\n\r\n" not in b))
@EXAMPLES
def test_rest_port_answers_any_bytes_after_the_handshake(agent: Agent, data: bytes) -> None:  # noqa: F811
    reply = tls_request(agent, data)
    assert reply == b"" or reply.startswith(b"HTTP/1.")
    assert not reply.startswith((b"HTTP/1.1 500", b"HTTP/1.0 500")), reply[:300]
    still_serving(agent)


def post(agent: Agent, path: str, body: bytes, token: str = "") -> int:  # noqa: F811
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(f"https://localhost:{agent.rest_port}{path}", data=body, method="POST",
                                 headers=headers)
    try:
        with urllib.request.urlopen(req, context=client_context(agent.pki), timeout=ANSWER_S) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


@pytest.fixture(scope="module")
def token(agent: Agent) -> str:  # noqa: F811
    reply = agent.manager_token()
    assert reply.status == 200
    return str(reply.body["data"]["token"])


@given(manager_bodies)
@EXAMPLES
def test_rest_bodies_get_a_client_error_never_a_server_error(
    agent: Agent, token: str, body: Any  # noqa: F811
) -> None:
    raw = json.dumps(body).encode()
    for path, bearer in (("/api/v1/auth/token", ""), ("/api/v1/node-intents", token),
                         ("/api/v1/intents", token)):
        status = post(agent, path, raw, bearer)
        assert status < 500, (path, status, raw[:300])
    still_serving(agent)


METHODS = ["ApplyIntents", "DeleteIntent", "GetStatus", "ListMatches"]
REFUSALS = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
            grpc.StatusCode.RESOURCE_EXHAUSTED)


@given(st.sampled_from(METHODS), st.binary(max_size=2048))
@EXAMPLES
def test_unix_socket_refuses_undecodable_messages_as_invalid(
    agent: Agent, method: str, data: bytes  # noqa: F811
) -> None:
    with grpc.insecure_channel(f"unix://{agent.socket}") as channel:
        call = channel.unary_unary(f"/gthulhu.node.v1.NodeAgent/{method}")
        try:
            call(data, timeout=ANSWER_S)
        except grpc.RpcError as exc:
            assert exc.code() in REFUSALS, exc
    with socket.socket(socket.AF_UNIX) as raw:  # and below gRPC: any bytes on the socket itself
        raw.connect(str(agent.socket))
        exchange(raw, data)
    assert agent.status().agent.ready
