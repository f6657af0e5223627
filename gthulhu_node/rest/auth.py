"""Tokens as upstream's Decision Maker issues them: RS256 JWTs against the configured RSA key pair.

A client gets a token by presenting the public half of the node's key pair (that is upstream's scheme and
what the Manager does). That proves little by itself (a public key is not a secret), which is why the
listener also requires a client certificate (mutual TLS) unless it is explicitly told not to; see
docs/rest.md. The keys are read from configured files; none is shipped in the repository.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
import structlog
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPrivateKey, RSAPublicKey

from gthulhu_node.errors import InvalidInput, Unauthenticated

log = structlog.get_logger(__name__)

ISSUER = "decision-maker-service"
# Newer Managers prove who they are with a short-lived JWT signed by their own key (a client assertion).
ASSERTION_TYPE = "dm_client_assertion"
ASSERTION_AUDIENCE = "gthulhu-decision-maker-token"
ALGORITHM = "RS256"
# Tolerated clock skew between the Manager and this node when checking nbf/exp.
LEEWAY_S = 30
CLIENT_ID_MAX = 256


class TokenError(Unauthenticated):
    """A bearer token that is refused; the message says why (it goes into the 401 body)."""


class KeyFileError(InvalidInput):
    """A configured key file that cannot be used; the message names the file."""


def load_private_key(path: Path) -> RSAPrivateKey:
    """Read the node's RSA private key (PEM, PKCS#1 or PKCS#8, unencrypted)."""
    try:
        blob = path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"rest.jwt_private_key {path}: {exc.strerror or exc}") from None
    try:
        key = serialization.load_pem_private_key(blob, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise KeyFileError(f"rest.jwt_private_key {path}: not an unencrypted PEM key ({exc})") from None
    if not isinstance(key, RSAPrivateKey):
        raise KeyFileError(f"rest.jwt_private_key {path}: not an RSA key (RS256 needs RSA)")
    mode = os.stat(path).st_mode
    if mode & 0o077:
        log.warning("rest_private_key_readable_by_others", path=str(path), mode=oct(mode & 0o777))
    return key


def parse_public_key(pem: str) -> RSAPublicKey | None:
    """An RSA public key from PEM text (SubjectPublicKeyInfo or PKCS#1), or None if it is not one."""
    text = pem.replace("\r\n", "\n").strip()
    if not text:
        return None
    try:
        key = serialization.load_pem_public_key(text.encode())
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return None
    return key if isinstance(key, RSAPublicKey) else None


def load_public_key(path: Path, setting: str) -> RSAPublicKey:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"{setting} {path}: {exc}") from None
    key = parse_public_key(text)
    if key is None:
        raise KeyFileError(f"{setting} {path}: not a PEM RSA public key")
    return key


class TokenAuthority:
    """Issues and checks the bearer tokens of the REST API."""

    def __init__(
        self,
        private_key: RSAPrivateKey,
        *,
        ttl_s: int,
        trusted_client_key: RSAPublicKey | None = None,
        expected_client_id: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`trusted_client_key`: the Manager's public key. When set, tokens are issued only against a
        client assertion it signed (the newer Manager's scheme), never against a presented public key."""
        self._private = private_key
        self._trusted_client = trusted_client_key
        self._expected_client_id = expected_client_id
        self._public = private_key.public_key()
        self._public_numbers = self._public.public_numbers()
        self._ttl = ttl_s
        self._clock = clock

    @classmethod
    def from_files(
        cls,
        private_path: Path,
        public_path: Path | None,
        *,
        ttl_s: int,
        trusted_client_path: Path | None = None,
        expected_client_id: str = "",
    ) -> TokenAuthority:
        """Load the key pair; a configured public key must be the private key's own half."""
        private = load_private_key(private_path)
        trusted = (
            load_public_key(trusted_client_path, "rest.trusted_client_public_key")
            if trusted_client_path is not None
            else None
        )
        if public_path is not None:
            public = load_public_key(public_path, "rest.jwt_public_key")
            if public.public_numbers() != private.public_key().public_numbers():
                raise KeyFileError(
                    f"rest.jwt_public_key {public_path} is not the public half of rest.jwt_private_key "
                    f"{private_path}"
                )
        return cls(private, ttl_s=ttl_s, trusted_client_key=trusted, expected_client_id=expected_client_id)

    @property
    def wants_assertions(self) -> bool:
        return self._trusted_client is not None

    def check_client_assertion(self, client_id: str, assertion: str) -> None:
        """Raise TokenError unless `assertion` is a valid client assertion of `client_id` signed by the
        trusted Manager key: RS256, `token_type` dm_client_assertion, audience
        gthulhu-decision-maker-token, `client_id` = `sub` = `iss` = the requesting client, within its
        `nbf`..`exp`."""
        if self._trusted_client is None:
            raise TokenError("client assertions are not configured (rest.trusted_client_public_key)")
        if not client_id.strip():
            raise TokenError("client_id is required")
        if self._expected_client_id and client_id != self._expected_client_id:
            raise TokenError("unauthorized client_id")
        try:
            claims = jwt.decode(
                assertion,
                self._trusted_client,
                algorithms=[ALGORITHM],
                audience=ASSERTION_AUDIENCE,
                issuer=client_id,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iat", "nbf", "iss", "sub", "aud"]},
            )
        except jwt.PyJWTError as exc:
            raise TokenError(str(exc) or type(exc).__name__) from None
        if claims.get("token_type") != ASSERTION_TYPE:
            raise TokenError("invalid client assertion type")
        if claims.get("client_id") != client_id or claims.get("sub") != client_id:
            raise TokenError("client assertion subject mismatch")

    @property
    def public_key(self) -> RSAPublicKey:
        return self._public

    def public_key_pem(self) -> str:
        return self._public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ).decode()

    def public_key_matches(self, pem: str) -> bool:
        """Whether `pem` holds our public key. Compares the key itself (modulus and exponent), so a
        PKCS#1 or SPKI encoding, other line breaks or surrounding whitespace all match."""
        key = parse_public_key(pem)
        return key is not None and key.public_numbers() == self._public_numbers

    def issue(self, client_id: str, requested_exp: int = 0) -> tuple[str, int]:
        """A token for `client_id`; returns (token, expiry as unix seconds).

        A client may ask for an earlier expiry (`expired_at` in the request) but never a later one than
        the configured lifetime.
        """
        now = int(self._clock())
        exp = now + self._ttl
        if now < requested_exp < exp:
            exp = requested_exp
        claims = {
            "client_id": client_id,
            "exp": exp,
            "iat": now,
            "nbf": now,
            "iss": ISSUER,
            "sub": client_id,
        }
        return jwt.encode(claims, self._private, algorithm=ALGORITHM), exp

    def verify(self, token: str) -> dict[str, Any]:
        """The claims of a valid token; raises TokenError (bad signature, expired, not yet valid, wrong
        issuer, missing claims, another algorithm)."""
        try:
            claims: dict[str, Any] = jwt.decode(
                token,
                self._public,
                algorithms=[ALGORITHM],
                issuer=ISSUER,
                leeway=LEEWAY_S,
                options={"require": ["exp", "iat", "nbf", "iss", "sub"]},
            )
        except jwt.PyJWTError as exc:
            raise TokenError(str(exc) or type(exc).__name__) from None
        return claims
