"""Channel and server options chosen on purpose, shared by every client and server."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from gymrpc.tls import TlsFiles

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Limit for one message either way. Session snapshots of table environments reach a
few MB; 64 MiB leaves room while still refusing a runaway payload (default is 4 MiB)."""

MAX_PENDING_CALLS = 100_000
"""Calls a server lets wait for a free slot (each holds only its headers and request bytes)."""

_COMMON: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted server comes back within a second; the default 1 s..120 s backoff is too slow.
    # Not `grpc.min_reconnect_backoff_ms`: gRPC core uses it as the minimum time a connection
    # attempt gets to finish its handshake, and at 100 ms a busy machine failed calls to live
    # servers with UNAVAILABLE "connection attempt timed out before receiving SETTINGS frame".
    # A refused connection fails at once whatever that timeout; the call's deadline bounds the rest.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


def server_options() -> list[tuple[str, Any]]:
    """Server options: size limits and no SO_REUSEPORT, so two servers never share a fixed port."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        # gRPC core cancels calls that wait for the application beyond a soft limit of 1,000
        # (randomly, up to all beyond 3,000), with a bare CANCELLED. Let them queue instead:
        # the guard's in-flight limit (gymrpc.servers.guard.Admission) is the one that pushes back.
        ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
        ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
    ]


def service_channel_options() -> list[tuple[str, Any]]:
    """Channel to a resolved address: fail fast, so the client can re-resolve a moved name."""
    return [*_COMMON, ("grpc.enable_retries", 0)]


def stable_channel_options(service: str) -> list[tuple[str, Any]]:
    """Channel to an address that does not move (the registry): wait for it to come back."""
    config = {
        "methodConfig": [
            {
                "name": [{"service": service}],
                "waitForReady": True,
                "retryPolicy": {
                    "maxAttempts": 5,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
    return [*_COMMON, ("grpc.enable_retries", 1), ("grpc.service_config", json.dumps(config))]


def insecure_channel(target: str, options: list[tuple[str, Any]], *, token: str | None = None) -> grpc.aio.Channel:
    """A plaintext channel; with `token`, every call on it carries the credential."""
    return grpc.aio.insecure_channel(target, options=options, interceptors=bearer_interceptors(token) or None)


def open_channel(
    target: str, options: list[tuple[str, Any]], *, tls: TlsFiles | None = None, token: str | None = None
) -> grpc.aio.Channel:
    """A channel to `target`: TLS (mTLS with a client certificate) when `tls` is given, else plaintext."""
    if tls is None:
        return insecure_channel(target, options, token=token)
    return grpc.aio.secure_channel(
        target,
        tls.channel_credentials(),
        options=[*options, *tls.channel_options(target)],
        interceptors=bearer_interceptors(token) or None,
    )


def open_sync_channel(target: str, options: list[tuple[str, Any]], *, tls: TlsFiles | None = None) -> grpc.Channel:
    """The blocking twin of `open_channel` (the `gymrpc call` command)."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, tls.channel_credentials(), options=[*options, *tls.channel_options(target)])


class _Bearer:
    """Adds the bearer credential to a call's metadata."""

    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", "Bearer " + token),)

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        if any(key == "authorization" for key, _ in details.metadata or ()):
            return details  # the call brought its own credential (a control token, or a wrong one on purpose)
        metadata = tuple(details.metadata or ()) + self._metadata
        return grpc.aio.ClientCallDetails(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready
        )


class _BearerUnary(_Bearer, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


class _BearerStream(_Bearer, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return await continuation(self._details(details), request)


def bearer_interceptors(token: str | None) -> list[Any]:
    """Client interceptors that send `token` with every call; none without a token.

    `gymrpc.Client` passes its credential itself; this is for raw generated stubs
    (tests, benchmarks, tools) on a stack whose data plane needs credentials. (grpc.aio files
    an interceptor under its first kind only, hence one object per kind.)
    """
    return [_BearerUnary(token), _BearerStream(token)] if token else []
