"""The listener's TLS: mutual TLS, because a token is handed to anyone who shows the public key.

The Manager presents a client certificate signed by the cluster's private CA and checks our certificate
against the same CA with the server name it is configured with (upstream's default: `localhost`).
"""

from __future__ import annotations

import ssl
from pathlib import Path


def server_context(cert: Path, key: Path, client_ca: Path) -> ssl.SSLContext:
    """A server context that refuses any client without a certificate signed by `client_ca`.

    Raises ValueError naming the file that could not be loaded.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(certfile=str(cert), keyfile=str(key))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"rest.tls_cert {cert} / rest.tls_key {key}: {exc}") from None
    try:
        ctx.load_verify_locations(cafile=str(client_ca))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"rest.tls_client_ca {client_ca}: {exc}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx
