"""Validation of every identifier that crosses the wire or reaches a file name (docs/design.md §2).

Nothing from a request is used as a path, a log key or a registry key before it
passes one of these checks; failures are `InvalidArgument` with the field named.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gymrpc.errors import InvalidArgument

ROLLOUT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""Rollout, session and checkpoint ids: safe as file names, bounded length."""
NAME_PART = re.compile(r"[a-z0-9][a-z0-9_.-]{0,62}")
"""Each half of a service name `role/instance`."""
ENDPOINT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_ADDRESS_LEN = 256
MAX_ATTEMPT = 2**32 - 2
"""The largest episode attempt a request may name: a restore continues attempt N as N + 1, which
must still fit the wire's uint32."""


MAX_SHOWN = 64
"""Characters of a refused value quoted in an error message (the value, bounded, is in its metadata)."""


def shown(value: str) -> str:
    """`value` quoted for an error message, cut to `MAX_SHOWN` characters: a huge id must not make the
    error itself too large to send."""
    return repr(value) if len(value) <= MAX_SHOWN else f"{value[:MAX_SHOWN]!r}... ({len(value)} characters)"


def check_id(value: str, field: str) -> str:
    """Validate a rollout, session or checkpoint id."""
    if not ROLLOUT_ID.fullmatch(value) or value in {".", ".."}:
        raise InvalidArgument(
            f"{field} {shown(value)} is invalid: it must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,127}}$",
            metadata={"field": field, "value": value},
        )
    return value


_ROLLOUT_IDS = re.compile(r"(?:[A-Za-z0-9][A-Za-z0-9._-]{0,127}\n)*")
"""`ROLLOUT_ID` repeated, each one ended by a newline (which no id holds)."""


def all_ids_valid(values: Sequence[str]) -> bool:
    """Whether `check_id` accepts every one of `values`, in one regex pass: cheap for thousands of ids.

    The newline count guards the separator: an id holding one ("a\nb") would otherwise pass as two.
    """
    if not values:
        return True
    joined = "\n".join(values) + "\n"
    return joined.count("\n") == len(values) and _ROLLOUT_IDS.fullmatch(joined) is not None


def check_attempt(value: int, field: str) -> int:
    """Validate an episode attempt (a uint32 on the wire; its successor must be one too)."""
    if not 0 <= value <= MAX_ATTEMPT:
        raise InvalidArgument(
            f"{field} {value} is out of range: attempts are 0..{MAX_ATTEMPT} (a restore continues one as attempt + 1)",
            metadata={"field": field},
        )
    return value


def check_service_name(name: str, field: str = "name") -> str:
    """Validate a stable service name `role/instance` (for example `agent/simple`)."""
    role, sep, instance = name.partition("/")
    if not sep or not NAME_PART.fullmatch(role) or not NAME_PART.fullmatch(instance):
        raise InvalidArgument(
            f"{field} {shown(name)} is invalid: expected 'role/instance', each part lowercase "
            "letters, digits, '_', '.', '-' (at most 63 characters)",
            metadata={"field": field, "name": name[:200]},
        )
    return name


def check_endpoint_id(value: str) -> str:
    """Validate a replica id behind a name."""
    if not ENDPOINT_ID.fullmatch(value):
        raise InvalidArgument(
            f"endpoint_id {shown(value)} is invalid: it must match ^[A-Za-z0-9][A-Za-z0-9._-]{{0,63}}$",
            metadata={"field": "endpoint_id", "value": value},
        )
    return value


def check_address(address: str) -> str:
    """Validate a gRPC target a server registers (host:port or a unix socket)."""
    ok = 0 < len(address) <= MAX_ADDRESS_LEN and address.isprintable() and " " not in address
    if ok and address.startswith(("unix:", "unix-abstract:")):
        ok = len(address.split(":", 1)[1]) > 0
    elif ok:
        host, sep, port = address.rpartition(":")
        ok = bool(sep and host and port.isdigit() and 0 < int(port) < 65536)
    if not ok:
        raise InvalidArgument(
            f"address {address[:100]!r} is invalid: expected host:port, unix:/path or unix-abstract:name",
            metadata={"field": "address"},
        )
    return address
