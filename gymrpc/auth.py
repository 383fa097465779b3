"""Bearer tokens: generated per stack, sent as metadata, compared in constant time.

The stack token may make every call. Narrower role tokens are derived from it
(`role_token`), so every server that holds the stack token can check them without
another file: an agent token may call resources and model servers, a trainer token
may call agents; neither passes a control call (docs/security.md).
"""

from __future__ import annotations

import base64
import hmac
import os
import secrets
from pathlib import Path

METADATA_KEY = "authorization"
SCHEME = "Bearer "


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries the token; empty when there is none."""
    return ((METADATA_KEY, SCHEME + token),) if token else ()


ROLES = ("agent", "trainer")
"""Roles with a token of their own (`role_token`)."""
ROLE_TOKEN_FILES = {role: f"{role}.token" for role in ROLES}
"""Run-folder files `gymrpc up` writes the role tokens into (mode 0600)."""


def role_token(stack_token: str, role: str) -> str:
    """The token of `role` in the stack of `stack_token`: an HMAC, so it reveals nothing of the stack token."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; roles with tokens: {', '.join(ROLES)}")
    digest = hmac.new(stack_token.encode(), f"gymrpc-role-token:{role}".encode(), "sha256").digest()
    return f"{role}.{base64.urlsafe_b64encode(digest).rstrip(b'=').decode()}"


def presented_token(metadata: object) -> str | None:
    """The `authorization` value of call metadata (a sequence of key/value pairs), or None."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key == METADATA_KEY:
            return value if isinstance(value, str) else value.decode()
    return None


def check(presented: str | None, expected: str) -> bool:
    """True when `presented` is `Bearer <expected>`; constant time in the token."""
    if presented is None or not presented.startswith(SCHEME):
        return False
    return hmac.compare_digest(presented[len(SCHEME) :].encode(), expected.encode())


def write_token_file(path: Path, token: str) -> None:
    """Write the token readable by the owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")


def read_token_file(path: Path) -> str:
    """Read a token written by `write_token_file`."""
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"token file {path} is empty")
    return token
