"""A dead stack says so: `RegistryUnavailable` when the registry itself is gone, not a long wait.

A server that restarts keeps its name in a registry that still answers, and calls go on; a
registry that stays silent past `RetryPolicy.registry_grace` fails the call with
`RegistryUnavailable` (a controller's operations too), well before the call's own deadline.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from gymrpc.client import Client
from gymrpc.controller import Controller
from gymrpc.errors import RegistryUnavailable
from gymrpc.retry import RetryPolicy
from gymrpc.v1 import resources_service_pb2 as pb

COUNTER = {"servers": [{"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}}]}


def test_a_restart_goes_on_and_a_dead_stack_raises_registry_unavailable(start_stack, run_dir: Path) -> None:  # type: ignore[no-untyped-def]
    stack = start_stack(COUNTER)

    async def main() -> None:
        policy = RetryPolicy(deadline=600.0, registry_grace=1.0)
        async with Client(run_dir=stack.run_dir, retry=policy) as client:
            resources = client.resources("resources/counter")
            await resources.ListTools(pb.ListToolsRequest())
            stack.kill("resources/counter")  # one server restarting: the registry answers, the call goes on
            await resources.ListTools(pb.ListToolsRequest())

            pids = [stack.process.pid] + [s["pid"] for s in stack.state()["servers"]]
            for pid in pids:  # the launcher first, so nothing is restarted
                os.kill(pid, signal.SIGKILL)
            stack.process.wait(timeout=30)
            with pytest.raises(RegistryUnavailable) as caught:
                await resources.ListTools(pb.ListToolsRequest())
            assert caught.value.reason == "REGISTRY_UNAVAILABLE"
            assert caught.value.metadata["registry"] == client.registry.target
            assert "not one server restarting" in caught.value.message
            with pytest.raises(RegistryUnavailable):
                await Controller(client).discover()
            with pytest.raises(RegistryUnavailable):
                await Controller(client, names=["resources/counter"]).discover()

    asyncio.run(main())
