"""TCP is served only with mutual TLS: certificates made here, a client with one is served, a client
without one (or with one from another CA) is refused, and TCP without the TLS files does not start."""

from __future__ import annotations

import datetime
import ipaddress
import os
import threading
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gthulhu_node.agent import Agent
from gthulhu_node.api.client import Target, stub
from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2 as pb
from gthulhu_node.api.server import ApiConfigError
from gthulhu_node.config import AgentConfig
from tests.host.agent_support import config_dict, intent, run_cli, running_agent, short_dir

pytestmark = pytest.mark.host


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


class CA:
    def __init__(self, cn: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(self.key, hashes.SHA256())
        )

    def issue(self, cn: str, *, server: bool) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        cert = builder.sign(self.key, hashes.SHA256())
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue = CA("gthulhu test CA"), CA("rogue CA")
    files: dict[str, bytes] = {"ca.pem": ca.pem()}
    files["server.pem"], files["server.key"] = ca.issue("localhost", server=True)
    files["client.pem"], files["client.key"] = ca.issue("manager", server=False)
    files["rogue.pem"], files["rogue.key"] = rogue.issue("intruder", server=False)
    out = {}
    for name, data in files.items():
        (d / name).write_bytes(data)
        out[name] = d / name
    return out


def _tls_api(pki: dict[str, Path]) -> dict[str, object]:
    return {
        "tcp_listen": "127.0.0.1:0",
        "tls_cert": str(pki["server.pem"]),
        "tls_key": str(pki["server.key"]),
        "tls_client_ca": str(pki["ca.pem"]),
    }


def test_mutual_tls(pki: dict[str, Path]) -> None:
    base = short_dir()
    with running_agent(base, api=_tls_api(pki)) as agent:
        assert agent.api is not None and agent.api.tcp_port
        address = f"127.0.0.1:{agent.api.tcp_port}"
        good = Target(
            address=address, tls_cert=pki["client.pem"], tls_key=pki["client.key"], tls_ca=pki["ca.pem"]
        )
        ch, s = stub(good)
        with ch:
            s.ApplyIntents(pb.ApplyIntentsRequest(source="tls", intents=[intent("a")]), timeout=10)
            assert [i.key for i in s.GetStatus(pb.GetStatusRequest(source="tls"), timeout=10).intents] == [
                "tls/a"
            ]
            # explain over the TCP listener: the same service, the same answer
            (me,) = s.Explain(pb.ExplainRequest(tid=threading.get_native_id()), timeout=10).threads
            assert me.tgid == os.getpid() and [i.intent for i in me.intents] == ["tls/a"]
        for who, target in {
            "no certificate": Target(address=address, tls_ca=pki["ca.pem"]),
            "another CA's certificate": Target(
                address=address, tls_cert=pki["rogue.pem"], tls_key=pki["rogue.key"], tls_ca=pki["ca.pem"]
            ),
        }.items():
            ch, s = stub(target)
            with ch, pytest.raises(grpc.RpcError) as exc:
                s.GetStatus(pb.GetStatusRequest(), timeout=10)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, who
        # The CLI speaks TLS too.
        ok = run_cli(
            "status",
            "--address",
            address,
            "--tls-cert",
            str(pki["client.pem"]),
            "--tls-key",
            str(pki["client.key"]),
            "--tls-ca",
            str(pki["ca.pem"]),
            "-o",
            "json",
        )
        assert ok.returncode == 0 and "tls/a" in ok.stdout
        refused = run_cli("status", "--address", address, "--tls-ca", str(pki["ca.pem"]))
        assert refused.returncode == 3


@pytest.mark.parametrize("missing", ["tls_cert", "tls_key", "tls_client_ca"])
def test_tcp_without_tls_files_refused(pki: dict[str, Path], missing: str) -> None:
    base = short_dir()
    api = _tls_api(pki)
    del api[missing]
    agent = Agent(AgentConfig.model_validate(config_dict(base, api=api)))
    with pytest.raises(ApiConfigError, match=f"api.{missing}"):
        agent.start()
    assert not agent.ready
    assert not agent.config.api.socket.exists()  # nothing left listening
