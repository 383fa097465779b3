"""Channel and server options chosen on purpose, shared by every client and server."""

from __future__ import annotations

import json
from typing import Any

import grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Limit for one message either way. Session snapshots of table environments reach a
few MB; 64 MiB leaves room while still refusing a runaway payload (default is 4 MiB)."""

MAX_PENDING_CALLS = 100_000
"""Calls a server lets wait for a free slot (each holds only its headers and request bytes)."""

_COMMON: list[tuple[str, Any]] = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted server comes back within a second; the default 1 s..120 s backoff is too slow.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
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
        # the guard's in-flight limit (servers.guard.Admission) is the one that pushes back.
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


def insecure_channel(target: str, options: list[tuple[str, Any]]) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(target, options=options)
