"""A server slow to answer the HTTP/2 handshake (a busy machine) is still reached within the call's deadline.

gRPC core gives a connection attempt `grpc.min_reconnect_backoff_ms` to finish its handshake.
gymrpc once set it to 100 ms for fast reconnects, and under load calls to live servers failed at
once with UNAVAILABLE "connection attempt timed out before receiving SETTINGS frame". A proxy that
holds every new connection for longer than that stands in for the busy machine.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc

from gymrpc.channels import insecure_channel, server_options, service_channel_options

HELD_S = 0.5
"""How long the proxy holds a new connection before it lets bytes through (well above 100 ms)."""


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.close()


async def _slow_proxy(backend_port: int) -> asyncio.Server:
    async def handle(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(HELD_S)
        backend_reader, backend_writer = await asyncio.open_connection("127.0.0.1", backend_port)
        await asyncio.gather(_pipe(client_reader, backend_writer), _pipe(backend_reader, client_writer))

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_call_waits_out_a_slow_handshake_within_its_deadline() -> None:
    async def scenario() -> bytes:
        server = grpc.aio.server(options=server_options())

        async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            return request

        handler = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Echo", {"Echo": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        proxy = await _slow_proxy(port)
        proxy_port = proxy.sockets[0].getsockname()[1]
        try:
            async with insecure_channel(f"127.0.0.1:{proxy_port}", service_channel_options()) as channel:
                return await channel.unary_unary("/test.Echo/Echo")(b"ping", timeout=30)
        finally:
            proxy.close()
            await server.stop(None)

    assert asyncio.run(scenario()) == b"ping"
