"""The registry does not let a token holder take a live server's name, and says where servers listen.

- `Register` of a live server's name and endpoint id at another address is ALREADY_EXISTS
  `NAME_TAKEN` (with a RetryInfo of the lease's time left), whatever lease id is guessed; the entry
  still points at the live server, and `Resolve` never hands out lease ids.
- The same server restarted (SIGKILL, a new port) proves the entry is its own with the lease id it
  kept in its `--lease-file` and replaces it at once, long before the old lease (300 s) would expire.
- A wildcard bind is advertised under this machine's address, not loopback, with a warning.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc

from gymrpc.pbtime import duration
from gymrpc.servers.bootstrap import node_address
from gymrpc.v1 import registry_service_pb2 as pb
from gymrpc.v1 import registry_service_pb2_grpc as pb_grpc
from tests.security.helpers import CONTROL, ServerProcess, channel, refused


async def resolve(registry: str, name: str) -> list[pb.Endpoint]:
    async with channel(registry) as ch:
        reply = await pb_grpc.RegistryServiceStub(ch).Resolve(pb.ResolveRequest(name=name), timeout=10)
        return list(reply.endpoints)


def test_a_live_servers_name_cannot_be_taken_and_a_restart_proves_its_lease(tmp_path: Path) -> None:
    socket = f"unix:{tmp_path}/registry.sock"
    registry = ServerProcess("gymrpc.servers.registry", "registry/main", ["--bind", socket], tmp_path / "registry")
    lease_file = tmp_path / "counter.lease"
    args = ["--environment", "counter", "--registry", socket, "--lease-ttl", "300", "--lease-file", str(lease_file)]
    server = ServerProcess("gymrpc.servers.resources", "resources/r", args, tmp_path / "r1")
    restarted = None
    try:
        assert oct(lease_file.stat().st_mode & 0o777) == "0o600"
        lease = lease_file.read_text().strip()

        async def hijack() -> None:
            [endpoint] = await resolve(socket, "resources/r")
            assert (endpoint.address, endpoint.lease_id) == (server.address, "")  # no lease ids for readers
            async with channel(socket) as ch:
                stub = pb_grpc.RegistryServiceStub(ch)
                for guess in ("", "0" * 24, lease[:-1] + ("0" if lease[-1] != "0" else "1")):
                    request = pb.RegisterRequest(
                        name="resources/r", address="127.0.0.1:1", ttl=duration(300), lease_id=guess
                    )
                    error = await refused(
                        stub.Register(request, timeout=10, metadata=CONTROL),
                        grpc.StatusCode.ALREADY_EXISTS,
                        "NAME_TAKEN",
                        says="registered by another live server",
                    )
                    assert error.details()
                    [still] = await resolve(socket, "resources/r")
                    assert still.address == server.address

        asyncio.run(hijack())
        os.kill(server.pid, signal.SIGKILL)
        server.process.wait()
        # Restarted with the same lease file: it registers at once (the helper waits for its ready file),
        # although the old lease has almost 300 s to run.
        restarted = ServerProcess("gymrpc.servers.resources", "resources/r", args, tmp_path / "r2")
        [endpoint] = asyncio.run(resolve(socket, "resources/r"))
        assert endpoint.address == restarted.address != server.address
        assert lease_file.read_text().strip() != lease
    finally:
        for process in (restarted, server, registry):
            if process is not None:
                process.stop()


def test_a_wildcard_bind_is_advertised_under_this_machines_address_with_a_warning(tmp_path: Path) -> None:
    server = ServerProcess(
        "gymrpc.servers.resources", "resources/w", ["--bind", "0.0.0.0:0", "--insecure"], tmp_path / "w"
    )
    try:
        host, _, port = server.address.rpartition(":")
        assert host == node_address()
        assert int(port) > 0
        log = server.log_path.read_text()
        assert "listening on every interface" in log
    finally:
        server.stop()
