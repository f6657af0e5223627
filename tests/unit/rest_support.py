"""Test support for the REST API tests: keys and certificates made with `cryptography`, a small HTTP
client on urllib (a real client over a real socket), and merkle roots computed with coreutils.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import ssl
import subprocess
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


@functools.cache
def rsa_key(slot: str) -> rsa.RSAPrivateKey:
    """One 2048-bit key per name per test session (generating one takes a while on a busy machine)."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def write_rsa_key(path: Path, slot: str = "node") -> rsa.RSAPrivateKey:
    """Write the key named `slot` to `path`; other slots are other keys."""
    key = rsa_key(slot)
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)
    return key


def public_pem(key: rsa.RSAPrivateKey, fmt: str = "spki") -> str:
    pub_format = (
        serialization.PublicFormat.SubjectPublicKeyInfo if fmt == "spki" else serialization.PublicFormat.PKCS1
    )
    return key.public_key().public_bytes(serialization.Encoding.PEM, pub_format).decode()


@dataclass
class Pki:
    """A private CA, a server certificate for `localhost`, and a client certificate (the Manager's)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


def make_pki(directory: Path, prefix: str = "") -> Pki:
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name(f"{prefix}test CA"))
        .issuer_name(_name(f"{prefix}test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(cn: str, server: bool) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH if server
                     else x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
            )
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False
            )
        return builder.sign(ca_key, hashes.SHA256()), key

    server_cert, server_key = leaf("localhost", True)
    client_cert, client_key = leaf("manager-client", False)
    pki = Pki(
        ca=directory / f"{prefix}ca.pem",
        server_cert=directory / f"{prefix}server.pem",
        server_key=directory / f"{prefix}server.key",
        client_cert=directory / f"{prefix}client.pem",
        client_key=directory / f"{prefix}client.key",
    )
    pki.ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    pki.server_cert.write_bytes(server_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.server_key, server_key)
    pki.client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.client_key, client_key)
    return pki


def client_context(
    pki: Pki | None, *, with_cert: bool = True, cert_from: Pki | None = None
) -> ssl.SSLContext:
    """What the Manager configures: our CA as root, its client certificate, server name `localhost`."""
    assert pki is not None
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if with_cert:
        src = cert_from or pki
        ctx.load_cert_chain(str(src.client_cert), str(src.client_key))
    return ctx


@dataclass
class Reply:
    status: int
    body: Any
    headers: dict[str, str]


def call(
    base: str,
    method: str,
    path: str,
    body: bytes | str | None = None,
    headers: dict[str, str] | None = None,
    ctx: ssl.SSLContext | None = None,
) -> Reply:
    """One HTTP request; the JSON body (or text) and status, whatever the status."""
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(base + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=60) as resp:
            status, raw, hdrs = resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as err:
        status, raw, hdrs = err.code, err.read(), dict(err.headers)
    try:
        parsed: Any = json.loads(raw)
    except ValueError:
        parsed = raw.decode(errors="replace")
    return Reply(status, parsed, hdrs)


# -- merkle roots computed without the implementation: coreutils sha256sum, C-locale sort, bash printf --

_MERKLE_SH = r"""
set -euo pipefail
# stdin: one "sortkey<TAB>leaftext" line per intent
mapfile -t lines < <(LC_ALL=C sort -t $'\t' -k1,1 | cut -f2-)
level=()
for text in "${lines[@]}"; do
  level+=("$(printf '%s' "$text" | sha256sum | cut -d' ' -f1)")
done
if [ ${#level[@]} -eq 0 ]; then printf '' | sha256sum | cut -d' ' -f1; exit 0; fi
while [ ${#level[@]} -gt 1 ]; do
  next=()
  for ((i = 0; i < ${#level[@]}; i += 2)); do
    l=${level[i]}; r=${level[i+1]:-$l}
    next+=("$(printf "$(printf '%s' "$l$r" | sed 's/../\\x&/g')" | sha256sum | cut -d' ' -f1)")
  done
  level=("${next[@]}")
done
echo "${level[0]}"
"""


def shell_merkle(rows: list[tuple[str, str]]) -> str:
    """Merkle root of (sort key, leaf text) rows, computed by bash + coreutils."""
    stdin = "".join(f"{key}\t{text}\n" for key, text in rows)
    out = subprocess.run(
        ["bash", "-c", _MERKLE_SH], input=stdin, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


def node_policy_rows(policies: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The Manager's sort key and leaf text of each node policy, as the Manager documents them."""
    rows = []
    for p in policies:
        node, pid, rx = p.get("nodeID", ""), p.get("policyID", ""), p.get("commandRegex", "")
        prio, slice_ns = p.get("priority", 0), p.get("executionTime", 0)
        rows.append(
            (
                f"{node}|{pid}|{rx}|{prio}|{slice_ns}",
                f"nodeID={node}|policyID={pid}|commandRegex={rx}|priority={prio}|executionTime={slice_ns}",
            )
        )
    return rows


def pod_intent_rows(intents: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The Manager's sort key and leaf text of each pod intent (labels as sorted `k=v`, comma-joined)."""
    rows = []
    for i in intents:
        labels = ",".join(sorted(f"{k}={v}" for k, v in i.get("podLabels", {}).items()))
        values = [i.get("podName", ""), i.get("podID", ""), i.get("nodeID", ""), i.get("k8sNamespace", ""),
                  i.get("commandRegex", ""), str(i.get("priority", 0)), str(i.get("executionTime", 0))]
        names = ["podName", "podID", "nodeID", "k8sNamespace", "commandRegex", "priority", "executionTime"]
        text = "|".join(f"{n}={v}" for n, v in zip(names, values, strict=True)) + f"|podLabels={labels}"
        rows.append(("|".join([*values, labels]), text))
    return rows


def reference_merkle(rows: list[tuple[str, str]]) -> str:
    """The same computation as `shell_merkle` written out in the test (hashlib, no shared code with the
    implementation); for sets too large to fork coreutils for every hash."""
    ordered = sorted(rows, key=lambda r: r[0].encode())
    level = [hashlib.sha256(text.encode()).hexdigest() for _, text in ordered]
    if not level:
        return hashlib.sha256(b"").hexdigest()
    while len(level) > 1:
        pairs = [(level[i], level[min(i + 1, len(level) - 1)]) for i in range(0, len(level), 2)]
        level = [hashlib.sha256(bytes.fromhex(a) + bytes.fromhex(b)).hexdigest() for a, b in pairs]
    return level[0]
