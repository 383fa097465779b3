"""Bearer tokens for control calls: generated per stack, sent as metadata, compared in constant time."""

from __future__ import annotations

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
