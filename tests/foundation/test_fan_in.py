"""Fan-in without drops (issue 18): thousands of concurrent calls at one server all succeed, and a
server past its in-flight limit pushes back with OVERLOADED + RetryInfo, which `gymrpc.Client` honours."""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

import gymrpc
from gymrpc import errors
from gymrpc.channels import insecure_channel, service_channel_options
from gymrpc.pbtime import duration
from gymrpc.servers.bootstrap import ServerConfig, ServiceBinding, start_server
from gymrpc.servers.registry.service import CONTROL_METHODS, RegistryServicer
from gymrpc.v1 import registry_service_pb2 as reg_pb
from gymrpc.v1 import registry_service_pb2_grpc as reg_grpc
from gymrpc.v1 import resources_service_pb2 as pb
from gymrpc.v1 import resources_service_pb2_grpc as pb_grpc

COUNTER = {"servers": [{"name": "resources/counter", "role": "resources", "args": {"environment": "counter"}}]}
CALLS = 5_000
TOKEN = "fan-in-token"


async def _fan_in(call) -> collections.Counter[str]:  # type: ignore[no-untyped-def]
    outcomes: collections.Counter[str] = collections.Counter()

    async def one() -> None:
        try:
            reply = await call()
            outcomes["ok" if reply.environment == "counter" else "wrong reply"] += 1
        except grpc.RpcError as exc:
            outcomes[exc.code().name] += 1
        except errors.GymrpcError as exc:
            outcomes[exc.code.name] += 1

    await asyncio.gather(*(one() for _ in range(CALLS)))
    return outcomes


@pytest.mark.slow
def test_five_thousand_concurrent_calls_at_one_server_all_succeed(start_stack):
    """gRPC core used to cancel calls waiting beyond 1,000 (all beyond 3,000) with a bare CANCELLED."""
    stack = start_stack(COUNTER)
    address = stack.server("resources/counter")["address"]

    async def scenario() -> tuple[collections.Counter[str], collections.Counter[str]]:
        async with insecure_channel(address, service_channel_options(), token=stack.token) as channel:
            raw = pb_grpc.ResourcesServiceStub(channel)
            # No client-side retries here: the server itself must take every call.
            direct = await _fan_in(lambda: raw.ListTools(pb.ListToolsRequest(), timeout=120))
        async with gymrpc.Client(run_dir=stack.run_dir) as client:
            counter = client.resources("resources/counter")
            named = await _fan_in(lambda: counter.ListTools(pb.ListToolsRequest(), timeout=120))
        return direct, named

    direct, named = asyncio.run(scenario())
    assert direct == {"ok": CALLS}
    assert named == {"ok": CALLS}


def test_a_server_past_its_limit_answers_overloaded_and_the_client_retries():
    async def scenario() -> None:
        servicer = RegistryServicer()
        binding = ServiceBinding(
            reg_pb.DESCRIPTOR.services_by_name["RegistryService"],
            servicer,
            reg_grpc.add_RegistryServiceServicer_to_server,
            CONTROL_METHODS,
        )
        server = await start_server(ServerConfig(name="registry/test", token=TOKEN, max_inflight_calls=2), [binding])
        assert server.admission is not None
        try:
            async with insecure_channel(server.address, service_channel_options()) as channel:
                raw = reg_grpc.RegistryServiceStub(channel)
                register = reg_pb.RegisterRequest(name="registry/test", address=server.address, ttl=duration(600))
                await raw.Register(register, metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=10)
                async with gymrpc.Client(registry=server.address, token=TOKEN) as client:
                    named = client.stub(
                        "registry/test",
                        reg_grpc.RegistryServiceStub,
                        reg_pb.DESCRIPTOR.services_by_name["RegistryService"],
                    )
                    resolve = reg_pb.ResolveRequest(name="registry/test")
                    await named.Resolve(resolve)  # resolves the name while there is room
                    # Two open watches fill the server's two slots; each is admitted once it answers.
                    watches = [raw.Watch(reg_pb.WatchRequest()) for _ in range(2)]
                    for watch in watches:
                        assert (await watch.read()).type == reg_pb.WATCH_EVENT_TYPE_EXISTING

                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await raw.Resolve(resolve, timeout=10)
                    err = errors.from_rpc_error(info.value)
                    assert isinstance(err, errors.ResourceExhausted)
                    assert err.reason == "OVERLOADED"
                    assert err.retry_delay is not None
                    assert err.retry_delay > 0
                    assert err.metadata["limit"] == "2"

                    rejected = server.admission.rejected
                    retried = asyncio.create_task(named.Resolve(resolve, timeout=60))
                    # Polls a counter (no timing margin): the client's first attempt was turned away.
                    while server.admission.rejected == rejected:  # noqa: ASYNC110
                        await asyncio.sleep(0.01)
                    assert not retried.done()
                    watches[0].cancel()
                    reply = await retried
                    assert reply.endpoints[0].address == server.address
                    watches[1].cancel()
        finally:
            await server.stop(0)

    asyncio.run(scenario())


def test_only_resource_exhausted_with_a_retry_delay_is_retried():
    assert errors.ResourceExhausted("x", reason="OVERLOADED", retry_delay=0.05).retry_delay == 0.05
    # Without RetryInfo (a message too large, an engine that is saturated) nothing is retried.
    from gymrpc.client import _is_retryable

    assert _is_retryable(errors.ResourceExhausted("busy", reason="OVERLOADED", retry_delay=0.05))
    assert not _is_retryable(errors.ResourceExhausted("too large"))
