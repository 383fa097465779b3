"""Client side of `gymrpc.v1.RegistryService`: resolving names and holding a server's lease."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path

import grpc

from gymrpc import auth
from gymrpc.channels import open_channel, stable_channel_options
from gymrpc.errors import (
    AlreadyExists,
    DeadlineExceeded,
    GymrpcError,
    NotFound,
    RegistryUnavailable,
    Unavailable,
    from_rpc_error,
)
from gymrpc.pbtime import duration
from gymrpc.tls import TlsFiles
from gymrpc.v1 import registry_service_pb2 as pb
from gymrpc.v1 import registry_service_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["RegistryService"].full_name


class RegistryClient:
    """Async client of one registry; the registry's address never moves, so its channel waits for it."""

    def __init__(
        self, target: str, *, token: str | None = None, timeout: float = 5.0, tls: TlsFiles | None = None
    ) -> None:
        self.target = target
        self._channel = open_channel(target, stable_channel_options(SERVICE), tls=tls)
        self._stub = pb_grpc.RegistryServiceStub(self._channel)
        self._md = auth.metadata(token)
        self._timeout = timeout

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RegistryClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def register(
        self,
        name: str,
        address: str,
        *,
        endpoint_id: str = "0",
        ttl: float = 10.0,
        labels: Mapping[str, str] | None = None,
        lease_id: str = "",
    ) -> pb.RegisterResponse:
        """`lease_id`: this server's previous lease of the name, which lets it replace its old entry."""
        request = pb.RegisterRequest(
            name=name,
            endpoint_id=endpoint_id,
            address=address,
            ttl=duration(ttl),
            labels=dict(labels or {}),
            lease_id=lease_id,
        )
        return await self._call(self._stub.Register, request, self._md)

    async def keep_alive(self, lease_id: str) -> pb.KeepAliveResponse:
        return await self._call(self._stub.KeepAlive, pb.KeepAliveRequest(lease_id=lease_id), self._md)

    async def deregister(self, lease_id: str) -> bool:
        reply = await self._call(self._stub.Deregister, pb.DeregisterRequest(lease_id=lease_id), self._md)
        return reply.removed

    async def resolve(self, name: str, *, timeout: float | None = None) -> list[pb.Endpoint]:
        reply = await self._call(self._stub.Resolve, pb.ResolveRequest(name=name), (), timeout)
        return list(reply.endpoints)

    async def list(self, prefix: str = "") -> list[pb.Endpoint]:
        reply = await self._call(self._stub.ListEndpoints, pb.ListEndpointsRequest(name_prefix=prefix), ())
        return list(reply.endpoints)

    async def _call(self, method, request, md, timeout: float | None = None):  # type: ignore[no-untyped-def]
        try:
            return await method(request, metadata=md, timeout=timeout or self._timeout)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            # The channel waits for the registry (wait-for-ready), so a dead one shows as a timeout.
            if isinstance(err, Unavailable | DeadlineExceeded):
                raise RegistryUnavailable(
                    f"the registry at {self.target} does not answer: {err.message}", metadata={"registry": self.target}
                ) from exc
            raise err from exc


class NameLease:
    """Keeps a server's name registered: renews every third of the TTL, re-registers after a
    registry restart, and deregisters on close.

    With a `lease_file` the lease id is kept there (mode 0600), so the same server restarted on a
    new address proves the old entry is its own and replaces it at once; without one, a restarted
    server finds its name taken (NAME_TAKEN) and waits, up to the old lease's TTL, for it to expire.
    """

    def __init__(
        self,
        registry: RegistryClient,
        name: str,
        address: str,
        *,
        endpoint_id: str = "0",
        ttl: float = 10.0,
        labels: Mapping[str, str] | None = None,
        lease_file: Path | None = None,
    ) -> None:
        self.registry, self.name, self.address = registry, name, address
        self.endpoint_id, self.ttl = endpoint_id, ttl
        self.labels = {"pid": str(os.getpid()), "host": socket.gethostname(), **(labels or {})}
        self.lease_id: str | None = None
        self.lease_file = lease_file
        self._previous = ""
        if lease_file is not None:
            with contextlib.suppress(FileNotFoundError):
                self._previous = lease_file.read_text().strip()[:64]
        self._task: asyncio.Task[None] | None = None

    async def start(self, *, taken_timeout: float | None = None) -> None:
        """Register, waiting while another live lease holds the name (at most `taken_timeout`, default 2 TTLs)."""
        deadline = time.monotonic() + (2 * self.ttl + 5 if taken_timeout is None else taken_timeout)
        while True:
            try:
                await self._register()
                break
            except AlreadyExists as exc:
                if exc.reason != "NAME_TAKEN" or time.monotonic() >= deadline:
                    raise
                log.warning("name taken by a live lease; waiting for it to expire", extra={"service": self.name})
                await asyncio.sleep(min(max(exc.retry_delay or 0.2, 0.05), 1.0))
        self._task = asyncio.get_running_loop().create_task(self._renew_forever())

    async def _register(self) -> None:
        reply = await self.registry.register(
            self.name,
            self.address,
            endpoint_id=self.endpoint_id,
            ttl=self.ttl,
            labels=self.labels,
            lease_id=self.lease_id or self._previous,
        )
        self.lease_id = reply.endpoint.lease_id
        if self.lease_file is not None and self.lease_id != self._previous:
            _write_private(self.lease_file, self.lease_id + "\n")
            self._previous = self.lease_id
        log.info("registered", extra={"service": self.name, "address": self.address, "lease_ttl": self.ttl})

    async def _renew_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl / 3)
            try:
                if self.lease_id is None:
                    await self._register()
                else:
                    await self.registry.keep_alive(self.lease_id)
            except NotFound:
                log.warning(
                    "lease lost (registry restarted or lease expired); registering again",
                    extra={"service": self.name},
                )
                self.lease_id = None
                await self._retry_register()
            except GymrpcError as exc:
                log.warning("lease renewal failed: %s", exc, extra={"service": self.name})

    async def _retry_register(self) -> None:
        try:
            await self._register()
        except GymrpcError as exc:
            log.warning("register failed: %s", exc, extra={"service": self.name})

    async def close(self) -> None:
        """Stop renewing and remove the name; best effort, the lease expires anyway."""
        if self._task is not None:
            self._task.cancel()
        if self.lease_id is not None:
            try:
                await self.registry.deregister(self.lease_id)
                log.info("deregistered", extra={"service": self.name})
            except GymrpcError as exc:
                log.warning("deregister failed: %s", exc, extra={"service": self.name})
            self.lease_id = None


def _write_private(path: Path, text: str) -> None:
    """Replace `path` with `text`, readable by its owner only (a lease id proves ownership of a name)."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(temp, path)
