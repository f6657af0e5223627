"""Connecting to a running agent: the unix socket by default, or TCP with mutual TLS. Used by the CLI
(and the tests), so connection errors read the same everywhere."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import grpc

from gthulhu_node.api.gen.gthulhu.node.v1 import agent_pb2_grpc as pb_grpc
from gthulhu_node.api.server import MAX_SEND_BYTES
from gthulhu_node.config import ApiConfig
from gthulhu_node.errors import Unavailable

DEFAULT_SOCKET = ApiConfig().socket
START_HINT = "start it with `systemctl start gthulhu-node` (or `gthulhu-node run`)"


class ConnectError(Unavailable):
    """The agent cannot be reached; the message says where it looked and what to do."""


@dataclass(frozen=True, slots=True)
class Target:
    socket: Path = DEFAULT_SOCKET
    address: str | None = None  # host:port: TCP with mutual TLS
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    server_name: str | None = None

    def describe(self) -> str:
        return f"{self.address} (TLS)" if self.address else f"unix socket {self.socket}"


def check_socket(path: Path) -> None:
    """Fail early, with words, when the socket is missing or not ours to open."""
    try:
        path.stat()
    except FileNotFoundError:
        raise ConnectError(f"the agent is not running: no socket at {path}; {START_HINT}") from None
    except PermissionError:
        raise ConnectError(
            f"permission denied on {path}: the agent's API is root-only (run as root)"
        ) from None
    if not os.access(path, os.R_OK | os.W_OK):
        raise ConnectError(f"permission denied on {path}: the agent's API is root-only (run as root)")


def channel(target: Target) -> grpc.Channel:
    options: list[tuple[str, str | int]] = [("grpc.max_receive_message_length", MAX_SEND_BYTES)]
    if target.address is None:
        check_socket(target.socket)
        return grpc.insecure_channel(f"unix://{target.socket}", options=options)
    if target.tls_ca is None:
        raise ConnectError("--address needs --tls-ca (the CA that signed the agent's certificate)")
    if (target.tls_cert is None) != (target.tls_key is None):
        raise ConnectError("--tls-cert and --tls-key go together")
    try:
        ca = target.tls_ca.read_bytes()
        cert = target.tls_cert.read_bytes() if target.tls_cert else None
        key = target.tls_key.read_bytes() if target.tls_key else None
    except OSError as exc:
        raise ConnectError(f"cannot read TLS file: {exc}") from None
    creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    if target.server_name:
        options.append(("grpc.ssl_target_name_override", target.server_name))
    return grpc.secure_channel(target.address, creds, options=options)


def stub(target: Target) -> tuple[grpc.Channel, pb_grpc.NodeAgentStub]:
    ch = channel(target)
    return ch, pb_grpc.NodeAgentStub(ch)


def describe_rpc_error(exc: grpc.RpcError, target: Target) -> str:
    """One line for people: what the agent said, or why it could not be reached."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        if target.address is None:
            return f"cannot reach the agent on {target.describe()} ({details}); is it running? {START_HINT}"
        return f"cannot reach the agent at {target.describe()}: {details}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the agent on {target.describe()} did not answer in time"
    name = code.name if code is not None else "ERROR"
    return f"{name.lower().replace('_', ' ')}: {details}"
