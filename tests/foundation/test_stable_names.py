"""Stable names across crashes: SIGKILL a server, the supervisor restarts it on a new port,
and a client that calls it by name never notices (issue 2)."""

from __future__ import annotations

import asyncio
import time

import pytest

import gymrpc
from gymrpc import errors
from gymrpc.retry import RetryPolicy
from gymrpc.v1 import resources_service_pb2 as pb

COUNTER = {"servers": [{"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}}]}


def test_calls_by_name_survive_sigkill_and_restart_on_a_new_port(start_stack):
    stack = start_stack(COUNTER)
    before = stack.server("resources/counter")

    async def scenario() -> tuple[int, int, set[str]]:
        async with gymrpc.Client(run_dir=stack.run_dir, retry=RetryPolicy(deadline=30)) as client:
            counter = client.resources("resources/counter")
            ok = failed = 0
            killed = False
            addresses: set[str] = set()
            started = time.monotonic()
            while time.monotonic() - started < 60:
                try:
                    reply = await counter.ListTools(pb.ListToolsRequest())
                    assert reply.environment == "counter"
                    ok += 1
                    addresses.add(await client.resolve("resources/counter"))
                except errors.GymrpcError:
                    failed += 1
                if ok == 20 and not killed:
                    stack.kill("resources/counter")
                    killed = True
                if killed and len(addresses) > 1 and ok > 60:
                    break
            return ok, failed, addresses

    ok, failed, addresses = asyncio.run(scenario())
    after = stack.wait_for("resources/counter", lambda s: s["state"] == "serving")
    assert failed == 0
    assert after["restarts"] == 1
    assert after["last_exit"] == "signal SIGKILL"
    assert after["pid"] != before["pid"]
    assert addresses == {before["address"], after["address"]}
    assert ok > 60


def test_call_fails_by_its_own_deadline_when_the_server_stays_down(start_stack):
    stack = start_stack({**COUNTER, "restart": {"max_restarts": 0}})

    async def scenario() -> float:
        async with gymrpc.Client(run_dir=stack.run_dir, retry=RetryPolicy(deadline=1.5)) as client:
            counter = client.resources("resources/counter")
            await counter.ListTools(pb.ListToolsRequest())
            stack.kill("resources/counter")
            started = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded, match="resources/counter") as info:
                await counter.ListTools(pb.ListToolsRequest())
            assert "attempts" in info.value.metadata
            return time.monotonic() - started

    elapsed = asyncio.run(scenario())
    assert stack.wait_for("resources/counter", lambda s: s["state"] == "failed")["restarts"] == 0
    assert 1.0 < elapsed < 10.0  # bounded by the call's deadline, not by a count of retries


def test_lease_expires_when_its_server_is_gone(start_stack):
    stack = start_stack({**COUNTER, "restart": {"max_restarts": 0}, "lease_ttl": 1.0})

    async def scenario() -> errors.NotFound:
        async with gymrpc.Client(run_dir=stack.run_dir) as client:
            (endpoint,) = await client.registry.resolve("resources/counter")
            assert endpoint.address == stack.server("resources/counter")["address"]
            stack.kill("resources/counter")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                try:
                    await client.registry.resolve("resources/counter")
                except errors.NotFound as exc:
                    return exc
                await asyncio.sleep(0.1)
            raise AssertionError("the lease never expired")

    expired = asyncio.run(scenario())
    assert expired.reason == "LEASE_EXPIRED"
    assert "resources/counter" in expired.message


def test_unknown_name_is_a_clear_not_found(start_stack):
    stack = start_stack(COUNTER)

    async def scenario() -> None:
        async with gymrpc.Client(run_dir=stack.run_dir) as client:
            started = time.monotonic()
            with pytest.raises(errors.NotFound) as info:
                await client.resources("resources/nope").ListTools(pb.ListToolsRequest())
            assert time.monotonic() - started < 5  # a wrong name is not retried until the deadline
            assert info.value.reason == "NOT_FOUND"
            assert "'resources/nope' was never registered" in info.value.message
            assert "resources/counter" in info.value.message  # says what is registered
            with pytest.raises(errors.InvalidArgument, match="role/instance"):
                client.resources("not a name")

    asyncio.run(scenario())


def test_client_finds_the_stack_from_the_run_folder_alone(start_stack, monkeypatch):
    stack = start_stack(COUNTER)
    monkeypatch.delenv("GYMRPC_REGISTRY", raising=False)
    monkeypatch.setenv("GYMRPC_RUN_DIR", str(stack.run_dir))

    async def scenario() -> str:
        async with gymrpc.Client() as client:
            return (await client.resources("resources/counter").ListTools(pb.ListToolsRequest())).environment

    assert asyncio.run(scenario()) == "counter"


def test_no_stack_gives_an_actionable_error(run_dir):
    with pytest.raises(FileNotFoundError, match="gymrpc up"):
        gymrpc.Client(run_dir=run_dir)


def test_a_registry_killed_and_restarted_gets_every_name_back_while_calls_go_on(start_stack):
    """The registry keeps no state on disk: servers re-register on their next renewal, and
    clients keep calling the addresses they resolved while it is down."""
    stack = start_stack({**COUNTER, "lease_ttl": 1.5})
    before = stack.server("registry/main")

    async def scenario() -> tuple[int, int]:
        async with gymrpc.Client(run_dir=stack.run_dir, retry=RetryPolicy(deadline=30)) as client:
            counter = client.resources("resources/counter")
            await counter.ListTools(pb.ListToolsRequest())
            stack.kill("registry/main")
            ok = failed = 0
            started = time.monotonic()
            while time.monotonic() - started < 3:  # through the registry's restart
                try:
                    await counter.ListTools(pb.ListToolsRequest())
                    ok += 1
                except errors.GymrpcError:
                    failed += 1
                await asyncio.sleep(0.01)
            return ok, failed

    ok, failed = asyncio.run(scenario())
    after = stack.wait_for("registry/main", lambda s: s["state"] == "serving")
    assert (after["restarts"], after["last_exit"]) == (1, "signal SIGKILL")
    assert after["pid"] != before["pid"]
    assert ok > 10
    assert failed == 0

    async def resolve_fresh() -> str:
        # A new client knows nothing: it must find the name in the restarted registry.
        async with gymrpc.Client(run_dir=stack.run_dir, retry=RetryPolicy(deadline=15)) as client:
            reply = await client.resources("resources/counter").ListTools(pb.ListToolsRequest())
            assert reply.environment == "counter"
            return await client.resolve("resources/counter")

    assert asyncio.run(resolve_fresh()) == stack.server("resources/counter")["address"]
