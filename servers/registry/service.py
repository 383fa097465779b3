"""`gymrpc.v1.RegistryService` over a `Table`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from gymrpc.errors import InvalidArgument, ResourceExhausted
from gymrpc.ids import check_address, check_endpoint_id, check_service_name
from gymrpc.pbtime import duration, request_seconds, timestamp
from gymrpc.servers.registry.table import Entry, Table
from gymrpc.v1 import registry_service_pb2 as pb
from gymrpc.v1 import registry_service_pb2_grpc as pb_grpc

CONTROL_METHODS = ("Register", "KeepAlive", "Deregister")
_EVENT = {
    "added": pb.WATCH_EVENT_TYPE_ADDED,
    "removed": pb.WATCH_EVENT_TYPE_REMOVED,
    "expired": pb.WATCH_EVENT_TYPE_EXPIRED,
}
MAX_LABELS = 32


def endpoint_message(entry: Entry, *, with_lease: bool = False) -> pb.Endpoint:
    """The wire form; the lease id only for its holder (it proves the entry is the caller's own)."""
    return pb.Endpoint(
        name=entry.name,
        endpoint_id=entry.endpoint_id,
        address=entry.address,
        lease_id=entry.lease_id if with_lease else "",
        expire_time=timestamp(entry.expires_at),
        register_time=timestamp(entry.registered_at),
        labels=entry.labels,
    )


class RegistryServicer(pb_grpc.RegistryServiceServicer):
    """Serves the table; an expiry task removes dead endpoints so watchers hear about them."""

    def __init__(self, table: Table | None = None) -> None:
        self.table = table or Table()
        self._expiry: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._expiry = asyncio.get_running_loop().create_task(self._expire_forever())

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()

    async def _expire_forever(self) -> None:
        while True:
            self.table.expire()
            await asyncio.sleep(0.1)

    async def Register(self, request: pb.RegisterRequest, context: grpc.aio.ServicerContext) -> pb.RegisterResponse:
        name = check_service_name(request.name)
        endpoint_id = check_endpoint_id(request.endpoint_id or "0")
        address = check_address(request.address)
        if len(request.labels) > MAX_LABELS or any(len(k) + len(v) > 512 for k, v in request.labels.items()):
            raise InvalidArgument(f"at most {MAX_LABELS} labels of at most 512 characters each")
        ttl = request_seconds(request.ttl, "ttl") if request.HasField("ttl") else 0.0
        entry = self.table.register(name, endpoint_id, address, ttl, dict(request.labels), request.lease_id[:64])
        return pb.RegisterResponse(endpoint=endpoint_message(entry, with_lease=True), ttl=duration(entry.ttl))

    async def KeepAlive(self, request: pb.KeepAliveRequest, context: grpc.aio.ServicerContext) -> pb.KeepAliveResponse:
        entry = self.table.keep_alive(request.lease_id)
        return pb.KeepAliveResponse(expire_time=timestamp(entry.expires_at))

    async def Resolve(self, request: pb.ResolveRequest, context: grpc.aio.ServicerContext) -> pb.ResolveResponse:
        name = check_service_name(request.name)
        return pb.ResolveResponse(endpoints=[endpoint_message(e) for e in self.table.resolve(name)])

    async def ListEndpoints(
        self, request: pb.ListEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListEndpointsResponse:
        return pb.ListEndpointsResponse(endpoints=[endpoint_message(e) for e in self.table.list(request.name_prefix)])

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchResponse]:
        queue = self.table.subscribe()
        try:
            for entry in self.table.list(request.name_prefix):
                yield pb.WatchResponse(type=pb.WATCH_EVENT_TYPE_EXISTING, endpoint=endpoint_message(entry))
            while True:
                change = await queue.get()
                if change is None:
                    raise ResourceExhausted("watch fell behind by 10000 events and was dropped; watch again")
                if change.entry.name.startswith(request.name_prefix):
                    yield pb.WatchResponse(type=_EVENT[change.kind], endpoint=endpoint_message(change.entry))
        finally:
            self.table.unsubscribe(queue)

    async def Deregister(
        self, request: pb.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeregisterResponse:
        return pb.DeregisterResponse(removed=self.table.deregister(request.lease_id))
