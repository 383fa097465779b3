"""Who may call what (`gymrpc.servers.credentials`), which binds count as loopback, and the `tls:` config."""

from __future__ import annotations

import pytest

from gymrpc import auth
from gymrpc.launch.spec import parse_stack_spec
from gymrpc.servers.credentials import DataPlaneCredentials
from gymrpc.tls import TlsFiles, is_loopback_bind

STACK = "stack-token"
SERVERS = [{"name": "resources/counter", "role": "resources"}]


def bearer(token: str | None) -> str | None:
    return None if token is None else auth.SCHEME + token


@pytest.mark.parametrize(
    ("service", "token", "outcome"),
    [
        ("gymrpc.v1.ResourcesService", STACK, None),
        ("gymrpc.v1.ResourcesService", auth.role_token(STACK, "agent"), None),
        ("gymrpc.v1.ModelService", auth.role_token(STACK, "agent"), None),
        ("gymrpc.v1.AgentService", auth.role_token(STACK, "trainer"), None),
        ("gymrpc.v1.AgentService", auth.role_token(STACK, "agent"), "ROLE_NOT_ALLOWED"),
        ("gymrpc.v1.ResourcesService", auth.role_token(STACK, "trainer"), "ROLE_NOT_ALLOWED"),
        ("gymrpc.v1.ModelService", None, "UNAUTHENTICATED"),
        ("gymrpc.v1.ModelService", "guess", "UNAUTHENTICATED"),
        ("gymrpc.v1.ModelService", auth.role_token("other-stack", "agent"), "UNAUTHENTICATED"),
        ("gymrpc.v1.ParticipantService", None, None),  # control calls: gymrpc.servers.guard checks them
        ("grpc.health.v1.Health", None, None),
    ],
)
def test_who_may_call_what(service: str, token: str | None, outcome: str | None) -> None:
    refusal = DataPlaneCredentials(STACK).refusal(f"/{service}/Method", bearer(token))
    assert (refusal.reason if refusal else None) == outcome


def test_role_tokens_differ_by_role_and_stack_and_hide_the_stack_token() -> None:
    tokens = {auth.role_token(s, r) for s in ("a", "b") for r in auth.ROLES}
    assert len(tokens) == 4
    assert all(STACK not in auth.role_token(STACK, r) for r in auth.ROLES)
    with pytest.raises(ValueError, match="unknown role"):
        auth.role_token(STACK, "admin")


@pytest.mark.parametrize(
    ("bind", "loopback"),
    [
        ("127.0.0.1:0", True),
        ("127.0.0.2:5000", True),
        ("localhost:0", True),
        ("[::1]:0", True),
        ("unix:/tmp/x.sock", True),
        ("0.0.0.0:0", False),
        ("[::]:0", False),
        (":0", False),
        ("10.1.2.3:0", False),
        ("node.example:0", False),
    ],
)
def test_only_loopback_and_unix_binds_may_be_plaintext(bind: str, loopback: bool) -> None:
    assert is_loopback_bind(bind) is loopback


def test_tls_config_forms() -> None:
    assert parse_stack_spec({"servers": SERVERS, "tls": True}).tls.generate  # type: ignore[union-attr]
    assert parse_stack_spec({"servers": SERVERS}).tls is None
    assert parse_stack_spec({"servers": SERVERS, "insecure": True}).insecure
    with pytest.raises(ValueError, match="give cert, key, ca, client_cert, client_key"):
        parse_stack_spec({"servers": SERVERS, "tls": {}})
    with pytest.raises(ValueError, match="generate makes its own CA"):
        parse_stack_spec({"servers": SERVERS, "tls": {"generate": True, "cert": "/x"}})
    with pytest.raises(ValueError, match="unexpected keyword argument 'certificate'"):
        parse_stack_spec({"servers": SERVERS, "tls": {"certificate": "/x"}})
    with pytest.raises(ValueError, match="insecure must be true or false"):
        parse_stack_spec({"servers": SERVERS, "insecure": "yes"})
    with pytest.raises(ValueError, match="a certificate and its key together"):
        TlsFiles(cert="/x")
