"""Shared-secret challenge-response: each side proves it knows the secret without sending it.

The client sends a nonce; the server answers with its own nonce and an HMAC over both; the client
checks it and answers with an HMAC over both in the other order. Nonces are fresh per connection,
so a recorded exchange cannot be replayed, and the secret never crosses the wire.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, role + b"\0" + first + second, hashlib.sha256).digest()


def server_proof(secret: bytes | None, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What the server sends to show it knows the secret (empty without a secret)."""
    return _proof(secret, b"server", client_nonce, server_nonce) if secret else b""


def client_proof(secret: bytes | None, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What the client sends to show it knows the secret (empty without a secret)."""
    return _proof(secret, b"client", server_nonce, client_nonce) if secret else b""


def verify(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison."""
    return hmac.compare_digest(expected, received)


#: Bytes of randomness in a request's capability token (``TransferParams.token``).
TOKEN_BYTES = 24


def new_token() -> str:
    """A fresh capability token for one request: unguessable, URL- and JSON-safe."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def token_matches(expected: str, received: str) -> bool:
    """Whether a peer's token is the request's (constant time; an empty one never is)."""
    return bool(expected) and hmac.compare_digest(expected.encode(), received.encode())
