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

log = structlog.get_logger(__name__)

ISSUER = "decision-maker-service"
ALGORITHM = "RS256"
# Tolerated clock skew between the Manager and this node when checking nbf/exp.
LEEWAY_S = 30
CLIENT_ID_MAX = 256


class TokenError(Exception):
    """A bearer token that is refused; the message says why (it goes into the 401 body)."""


class KeyFileError(ValueError):
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


def load_public_key(path: Path) -> RSAPublicKey:
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"rest.jwt_public_key {path}: {exc}") from None
    key = parse_public_key(text)
    if key is None:
        raise KeyFileError(f"rest.jwt_public_key {path}: not a PEM RSA public key")
    return key


class TokenAuthority:
    """Issues and checks the bearer tokens of the REST API."""

    def __init__(
        self, private_key: RSAPrivateKey, *, ttl_s: int, clock: Callable[[], float] = time.time
    ) -> None:
        self._private = private_key
        self._public = private_key.public_key()
        self._public_numbers = self._public.public_numbers()
        self._ttl = ttl_s
        self._clock = clock

    @classmethod
    def from_files(cls, private_path: Path, public_path: Path | None, *, ttl_s: int) -> TokenAuthority:
        """Load the key pair; a configured public key must be the private key's own half."""
        private = load_private_key(private_path)
        if public_path is not None:
            public = load_public_key(public_path)
            if public.public_numbers() != private.public_key().public_numbers():
                raise KeyFileError(
                    f"rest.jwt_public_key {public_path} is not the public half of rest.jwt_private_key "
                    f"{private_path}"
                )
        return cls(private, ttl_s=ttl_s)

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
